"""`SpecEngine` with a per-step observer: phase intervals and per-request tokens after each step.

The engine already times its stages through a `StageTimer`; `PhaseIntervals` keeps the wall
clock interval of each stage of the current step instead of a running sum, and
`ObservedEngine.step` hands them, with the step's outputs and the tokens each request's verify
produced (integers counted by the requests, never reconstructed from averages), to a callback
that feeds metrics and trace spans. The step loop itself is untouched.
"""

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from ddtree_serve.engine.budget import AdaptiveBudget, BudgetStep
from ddtree_serve.engine.interfaces import Drafter, Target
from ddtree_serve.engine.request import RequestOutput
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.engine.timing import StageTimer

if TYPE_CHECKING:
    from ddtree_serve.serve.config import ServeConfig


class PhaseIntervals(StageTimer):
    """Records `(start_ns, end_ns)` of every stage of the step in progress (epoch nanoseconds)."""

    def __init__(self) -> None:
        super().__init__(enabled=True)
        self.intervals_ns: dict[str, tuple[int, int]] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start_ns = time.time_ns()
        try:
            yield
        finally:
            self.intervals_ns[name] = (start_ns, time.time_ns())

    def take(self) -> dict[str, tuple[int, int]]:
        intervals, self.intervals_ns = self.intervals_ns, {}
        return intervals


@dataclass(frozen=True)
class StepRecord:
    """What one step did: its index, stage intervals, the outputs it produced, the tokens each
    verified request's step produced before stop truncation (1..block_size), by request id, and
    what the adaptive budget chose for it (None under the fixed policy or without a verify)."""

    index: int
    intervals_ns: dict[str, tuple[int, int]]
    outputs: Sequence[RequestOutput]
    num_step_tokens: Mapping[str, int]
    budget: BudgetStep | None = None


StepObserver = Callable[[StepRecord], None]


class ObservedEngine(SpecEngine):
    """A `SpecEngine` whose every step is reported to `observer` (called on the engine thread)."""

    def __init__(self, *args: object, observer: StepObserver, **kwargs: object) -> None:
        self._phases = PhaseIntervals()
        super().__init__(*args, timer=self._phases, **kwargs)  # type: ignore[arg-type]
        self._observer = observer
        self._num_steps = 0

    def step(self) -> list[RequestOutput]:
        # Every request this step may verify (running, or admitted by its schedule) and its
        # count so far: the step's tokens are the difference, finished requests included.
        counts_before = [(request, request.num_step_tokens) for request in self._requests.values()]
        budget_before = self._last_budget_step()
        outputs = super().step()
        budget = self._last_budget_step()
        self._num_steps += 1
        num_step_tokens = {
            request.request_id: request.num_step_tokens - count
            for request, count in counts_before
            if request.num_step_tokens > count
        }
        self._observer(
            StepRecord(
                self._num_steps,
                self._phases.take(),
                outputs,
                num_step_tokens,
                budget=budget if budget is not budget_before else None,  # a new record: this step's
            )
        )
        return outputs

    def _last_budget_step(self) -> BudgetStep | None:
        return None if self.budget_policy is None else self.budget_policy.last_step


def group_engine(
    config: "ServeConfig",
    target: Target,
    drafter: Drafter | None,
    tokenizer: Tokenizer,
    observer: StepObserver,
    budget_policy: AdaptiveBudget | None = None,
) -> ObservedEngine:
    """The speculation group's engine over its workers, as `config` shapes it (overlap, chained
    drafts), reporting each step to `observer`; `budget_policy`: a lost engine's, kept."""
    return ObservedEngine(
        config.engine.to_settings(),
        target,
        drafter,
        tokenizer,
        observer=observer,
        overlap=config.placement.overlap,
        budget_policy=budget_policy,
        chain_drafts=config.placement.chain_drafts,
    )
