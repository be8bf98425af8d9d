"""The seam between `SpecEngine` and the models: the `Drafter` and `Target` protocols.

The engine never touches a model directly. It calls these two protocols once per step with
the whole running batch, so the same loop runs in one process (`TargetStep` / `DraftStep`
called directly) and over Ray (the serving layer's actor proxies add transport, not logic).
Each call takes one input dataclass and returns one output dataclass, so a transport moves
the pair as a whole.

What crosses the seam is small: the drafter returns top-K log-probs and ids rather than
full logits; the target receives the tree batch, per-request sampling tensors and coins,
and returns accepted node indices and one bonus token per request. The one large payload,
the target's context features of the newly committed tokens, travels as an opaque
`ContextHandle`: the engine forwards it from `Target.verify_and_commit`/`Target.prefill` to the next
`Drafter.draft` without looking inside. In process it is a list of tensors; over Ray it is
an `ObjectRef` that the coordinator never pulls.

Per step, for the running requests in slots `slots` (batch order fixed by the engine):

    draft   = drafter.draft(DraftInput(slots, bonus_tokens, contexts, top_k))  # not in mode "ar"
    trees   = TreeBuilder.build(draft.logp, draft.ids, ...)  (engine: host, or draft's device)
    verdict = target.verify_and_commit(VerifyInput(slots, trees.batch, ...))
    # verdict.context -> ContextSlice(verdict.context, i) joins request i's next drafter context

Where tensors lie: the draft's top-K stays on the drafter's device. The engine's tree builder
copies it to the host in one copy and builds there (the default), or, in process, builds on
that device and hands the target a device batch, so nothing between the draft and the verify
forward waits for the host; over Ray the transport brings it to the host. Everything the target returns is
on the CPU, in one device -> host copy per call: the engine's bookkeeping reads it. Other
tensors passed in are CPU tensors that the implementation moves to its device.

Transports that can run the two actors at once also implement `PipelinedTarget` /
`PipelinedDrafter`: `submit_verify` / `submit_draft` return a `Pending` result at once, so the
engine's overlapped step (`SpecEngine(overlap=True)`) has the target verify one micro-batch
while the drafter drafts the other; in process the blocking calls stand in (`Ready`).

A target whose verify leaves the host idle while its device computes (CUDA in this process) or
its worker does (a Ray actor) is an `AsyncDeviceTarget`: the engine hands it host work for that
time (`while_verifying`).

A transport that reaches both actors in one round trip may also implement `DraftChainingTarget`:
`submit_verify_then_draft` verifies, and then the drafter drafts every verified request's next
block from the verdict's bonus tokens and features, before anything returns to the engine. The
serial step then costs one round trip instead of two (the engine keeps the chained draft for the
next step, as the overlapped step keeps its carried one).

When a model is lost the call raises: `DrafterUnavailableError` (the engine decodes plainly and
later rebuilds the drafter's context with `Target.encode_context`) or `TargetUnavailableError`
(the KV caches are gone: every running request ends).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

import torch

if TYPE_CHECKING:
    from ddtree_serve.tree import VerifyBatch

ContextHandle = Any
"""Opaque per-call holder of context features, one entry per request of the producing call.

Produced by `Target.prefill` (entry i: the prompt's features, `[T_i, F]`) and
`Target.verify_and_commit`
(entry i: features of the root and accepted nodes, `[1 + accept_len_i, F]`). Only the
`Drafter` that consumes it may look inside."""


class DrafterUnavailableError(RuntimeError):
    """The drafter cannot draft now (its process died, or is restarting): its context is lost.

    Not fatal: the drafter only speeds decoding up, so the engine verifies root-only trees
    (plain decoding, lossless) until `Drafter.is_available` says a drafter is back."""


class TargetUnavailableError(RuntimeError):
    """The target is gone (its process died): every slot's KV cache went with it.

    Fatal for the requests in flight; a caller may retry them once the target is back."""


@dataclass(frozen=True)
class ContextSlice:
    """One request's new drafter context: entry `index` of the call that produced `handle`.

    Requests join and leave between steps, so the drafter's batch is not the batch of any
    single earlier target call: each request carries a pointer into the call it came from.
    """

    handle: ContextHandle
    index: int


@dataclass(frozen=True)
class SamplingBatch:
    """Per-request sampling knobs of one target call, in the call's batch order (CPU)."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy (argmax)
    top_k: torch.Tensor  # [B] int64; 0 = no top-k cut
    top_p: torch.Tensor  # [B] float32; 1.0 = no nucleus cut
    all_greedy: bool  # True when every temperature is 0: the target may skip probabilities

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])


@dataclass(frozen=True)
class PrefillInput:
    """Prompts to cache in their (empty) slots, and how to sample each one's first token."""

    slots: Sequence[int]  # [B]; row i of every tensor below is slot slots[i]
    prompts: Sequence[Sequence[int]]  # [B][T_i] token ids
    sampling: SamplingBatch
    # [B] float32 uniform draws in [0, 1), for inverse-CDF sampling of the first token;
    # None when `sampling.all_greedy`
    coins: torch.Tensor | None


@dataclass(frozen=True)
class PrefillOutput:
    """Result of caching prompts: the first generated token of each and the prompt features."""

    first_tokens: torch.Tensor  # [B] int64, CPU; sampled from the last prompt position
    num_cached_tokens: tuple[int, ...]  # [B] the slots' cache lengths after the prefill
    context: ContextHandle  # entry i: features of prompt i's tokens, for the drafter


@dataclass(frozen=True)
class DraftInput:
    """One draft call: each slot's new context and bonus token, and how many ranks to return."""

    slots: Sequence[int]  # [B]
    bonus_tokens: torch.Tensor  # [B] int64, CPU; the newest token of each request (not cached)
    # contexts[i]: features of the tokens committed to slot i since its last draft (the prompt,
    # on a request's first draft), as one slice per producing call in commit order: several
    # when steps ran without drafting (an adaptive budget's plain decode steps)
    contexts: Sequence[Sequence[ContextSlice]]
    top_k: int  # K of the returned `DraftOutput` (1 for a chain, min(budget, vocab) for DDTree)


@dataclass(frozen=True)
class DraftOutput:
    """Top-K drafter proposals for the `L = block_size - 1` positions after each bonus token."""

    # [B, L, K] float32 on the drafter's device (CPU over Ray); log-probs over the full vocab,
    # descending in K
    logp: torch.Tensor
    ids: torch.Tensor  # [B, L, K] int64, where `logp` lies; token id of each (position, rank)
    # [B] context tokens each slot holds after taking its new context; the engine checks that
    # they equal the target's cached tokens (the drafter sees exactly the committed text)
    num_context_tokens: tuple[int, ...]


@dataclass(frozen=True)
class EncodeInput:
    """Each slot's cached text, to re-encode into context features for a drafter that lost it."""

    slots: Sequence[int]  # [B]
    token_ids: Sequence[Sequence[int]]  # [B][T_b]: exactly the T_b tokens in slot b's cache


@dataclass(frozen=True)
class VerifyInput:
    """One tree per slot to verify on top of its cache, with the coins of the sampling walk."""

    slots: Sequence[int]  # [B]; each tree's root sits at the slot's current cache length
    batch: "VerifyBatch"  # rows follow `slots`; on the host or the target's device
    sampling: SamplingBatch
    # coins [B, N] and coin_final [B]: float32 uniform draws in [0, 1) for the sampling
    # verification; None when `sampling.all_greedy`
    coins: torch.Tensor | None
    coin_final: torch.Tensor | None
    return_context: bool  # False when no drafter needs the accepted features (mode "ar")


@dataclass(frozen=True)
class VerifyOutput:
    """Outcome of verifying one tree per request and committing the accepted path.

    Field meanings follow `ddtree_serve.verify.VerifyResult`; `context` is absent when the
    caller asked for none (mode "ar" has no drafter to feed).
    """

    accept_index: torch.Tensor  # [B, D+1] int64, CPU; local node indices, root first, -1 padded
    # [B, D+1] int64, CPU; the tree token of each accept_index entry (entries past
    # 1 + accept_len are meaningless), so the engine needs no host copy of the trees
    accept_tokens: torch.Tensor
    accept_len: torch.Tensor  # [B] int64, CPU; accepted draft nodes, root excluded
    bonus_token: torch.Tensor  # [B] int64, CPU; next root, not yet in the target's cache
    num_cached_tokens: tuple[int, ...]  # [B] the slots' cache lengths after the commit
    context: ContextHandle | None  # entry i: features of root + accepted nodes of request i


@runtime_checkable
class Target(Protocol):
    """The verifying model: owns the KV cache of every slot.

    Cache convention (docs/architecture.md): after `prefill` the slot holds the prompt; the
    newest token (first token, later each bonus) is never cached until it is verified as the
    root of the next tree.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def max_seq_len(self) -> int:
        """Positions a slot can hold; the engine keeps prompt + output + tree within it."""
        ...

    @property
    def verify_token_buckets(self) -> tuple[int, ...] | None:
        """Tree tokens per request a verify is padded to (its CUDA-graph buckets), so nodes up
        to the bucket cost nothing more; None: each verify runs at its own size (eager)."""
        ...

    def prefill(self, inputs: PrefillInput) -> PrefillOutput:
        """Cache each prompt in its (empty) slot and sample its first token."""
        ...

    def verify_and_commit(self, inputs: VerifyInput) -> VerifyOutput:
        """Run one forward pass over each slot's tree, verify it, and commit the accepted path.

        After the call the slot holds the root and the accepted nodes, contiguous; the bonus
        token is not cached.
        """
        ...

    def encode_context(self, inputs: EncodeInput) -> ContextHandle:
        """Context features of each slot's cached text (entry b: `[T_b, F]`); the cache is unchanged.

        A features-only forward for a drafter that lost its context: handed to it as every
        request's pending context, it makes the drafter's context equal the target's cache again.
        """
        ...

    def release(self, slot: int) -> None:
        """Forget the slot's cache so a new request can take it."""
        ...


@runtime_checkable
class Drafter(Protocol):
    """The block drafter: owns each slot's context features (its view of the committed text)."""

    @property
    def block_size(self) -> int:
        """Positions per draft block; a draft proposes `block_size - 1` tokens after the bonus."""
        ...

    def draft(self, inputs: DraftInput) -> DraftOutput:
        """Append each slot's new context, then propose the next block after its bonus token."""
        ...

    def is_available(self) -> bool:
        """Whether a drafter takes calls now; never blocks. Asked after a `DrafterUnavailableError`.

        Once it says True the engine releases every slot and hands each running request its
        whole context again, so a drafter that comes back (a fresh process, or the old one after
        a transient loss) needs no state of its own to resume.
        """
        ...

    def release(self, slot: int) -> None:
        """Forget the slot's context so a new request can take it."""
        ...


ResultT = TypeVar("ResultT", covariant=True)


class Pending(Protocol[ResultT]):
    """A submitted seam call: `result()` blocks until it is done and raises what the call raised."""

    def result(self) -> ResultT: ...


class Ready(Generic[ResultT]):
    """A `Pending` that is already done: a blocking call standing in for a submitted one."""

    def __init__(self, value: ResultT) -> None:
        self._value = value

    def result(self) -> ResultT:
        return self._value


@runtime_checkable
class PipelinedTarget(Protocol):
    """A `Target` whose verify can run while the engine does other work (another actor)."""

    def submit_verify(self, inputs: VerifyInput) -> Pending[VerifyOutput]:
        """Start `verify_and_commit(inputs)`; calls run in submission order."""
        ...


@runtime_checkable
class PipelinedDrafter(Protocol):
    """A `Drafter` whose draft can run while the target verifies another micro-batch."""

    def submit_draft(self, inputs: DraftInput) -> Pending[DraftOutput]:
        """Start `draft(inputs)`; calls run in submission order."""
        ...


@runtime_checkable
class AsyncDeviceTarget(Protocol):
    """A `Target` whose verify leaves the caller idle while its device computes (CUDA, in this
    process) or its worker does (a Ray actor): `while_verifying`, when set, runs once in that
    idle time, after the verify's work was launched or sent and before its results are read
    back (the engine's policy learns there)."""

    while_verifying: Callable[[], None] | None


@runtime_checkable
class DraftChainingTarget(Protocol):
    """A `Target` whose verify can hand its results straight to the drafter for the next draft."""

    def submit_verify_then_draft(
        self, inputs: VerifyInput, top_k: int
    ) -> tuple[Pending[VerifyOutput], Pending[DraftOutput]]:
        """Start `verify_and_commit(inputs)`, then a draft of the same slots from its results.

        The draft takes each slot's bonus token from the verdict and, as its one new context
        slice, the verdict's features (so each slot must have no undrafted context before the
        call; `inputs.return_context` must be True). The verdict comes back without a context:
        the drafter has it. A lost drafter shows in the draft's `result()` only.
        """
        ...
