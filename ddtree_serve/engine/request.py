"""One generation request: its tokens, slot, sampling state and the outputs it produces."""

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ddtree_serve.engine.interfaces import ContextSlice
from ddtree_serve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ddtree_serve.engine.stop import StopStringScan


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no slot yet
    RUNNING = "running"  # holds a slot; drafted and verified every step
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestStats:
    """Per-request speculation figures; `acceptance_length` is tokens per verify step (tau)."""

    num_prompt_tokens: int
    num_generated_tokens: int
    steps: int  # verify steps (the prefill token is not one)
    acceptance_length: float  # mean tokens one verify step produced, stop truncation not applied

    def as_dict(self) -> dict[str, float | int]:
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "steps": self.steps,
            "acceptance_length": self.acceptance_length,
        }


@dataclass(frozen=True)
class RequestOutput:
    """A snapshot of one request after a step: its generated tokens, what is new, whether done.

    The snapshot shares the request's append-only token list instead of copying it, so taking
    one costs the same at token 4,000 as at token 4; `num_tokens` bounds what it sees.
    Text is not decoded here (the engine decodes only for stop strings); `Detokenizer` turns
    these into text for callers that want it.
    """

    request_id: str
    generated_token_ids: Sequence[int] = field(repr=False, compare=False)  # read via the methods below
    num_tokens: int  # tokens generated so far, stop token excluded
    num_new_tokens: int  # how many of those are new since the previous output
    finished: bool
    finish_reason: str | None  # "stop" (EOS, stop token or string), "length", "abort"
    stop_text_offset: int | None  # decoded text ends here (a stop string starts at it); finished only
    stats: RequestStats

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every generated token so far (a copy; streaming callers read `token_ids_from`)."""
        return tuple(self.generated_token_ids[: self.num_tokens])

    def token_ids_from(self, start: int) -> list[int]:
        """Tokens `start` onwards: what a caller that has seen `start` tokens is missing."""
        return list(self.generated_token_ids[start : self.num_tokens])


class Request:
    """Mutable state of one request; owned by the engine, queued by the scheduler."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_output_tokens: int,
        tree_budget: int,
    ) -> None:
        """`max_output_tokens`: what the engine lets it generate (max_tokens, capped by the
        slot's room); `tree_budget`: draft nodes a step may verify for it
        (its draft_budget under the engine's budget). Both are fixed for the request's life and
        read every step, so the engine works them out once."""
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.max_output_tokens = max_output_tokens
        self.tree_budget = tree_budget
        self.status = RequestStatus.WAITING
        self.slot: int | None = None
        self.output_token_ids: list[int] = []  # append-only: outputs share it
        # Tokens in the slot's target cache, as prefill and commit report them; the drafter's
        # context must hold as many when it drafts (the newest token is never cached).
        self.num_cached_tokens = 0
        self.num_drafter_context_tokens = 0  # the drafter's context length at its last draft
        self.num_emitted_tokens = 0  # outputs already reported to the caller
        # The newest sampled token: root of the next tree, not yet in the target's cache.
        self.bonus_token: int | None = None
        # Features of tokens committed since the last draft, one slice per target call in
        # commit order (several after steps that did not draft); consumed by the next draft.
        self.pending_contexts: list[ContextSlice] = []
        self.finish_reason: str | None = None
        self.stop_text_offset: int | None = None
        self.stop_scan: StopStringScan | None = None  # the stop checker's, if params.stop is set
        self.steps = 0
        self.num_step_tokens = 0  # tokens produced by verify steps, before stop truncation
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason

    def stats(self) -> RequestStats:
        return RequestStats(
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=len(self.output_token_ids),
            steps=self.steps,
            acceptance_length=self.num_step_tokens / self.steps if self.steps else 0.0,
        )

    def take_output(self) -> RequestOutput:
        """The current snapshot; marks its tokens as reported. O(1): no tokens are copied."""
        num_tokens = len(self.output_token_ids)
        num_new = num_tokens - self.num_emitted_tokens
        self.num_emitted_tokens = num_tokens
        return RequestOutput(
            request_id=self.request_id,
            generated_token_ids=self.output_token_ids,
            num_tokens=num_tokens,
            num_new_tokens=num_new,
            finished=self.finished,
            finish_reason=self.finish_reason,
            stop_text_offset=self.stop_text_offset,
            stats=self.stats(),
        )
