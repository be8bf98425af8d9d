"""Opt-in per-stage wall-clock accounting for the step loop (off: one attribute check per stage)."""

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum


class Stage(StrEnum):
    """Names of the timed stages; the step, timings, metrics, spans and benchmarks share them.

    A member is a `str` equal to its value, so timings keyed by it read as plain names.
    """

    SCHEDULE = "schedule"  # pick the running batch, admit newcomers
    PREFILL = "prefill"  # cache the newcomers' prompts, sample their first token
    DRAFT = "draft"  # the drafter's call: append new context, propose a block
    BUILD = "build"  # host side: trees and the padded verify batch
    VERIFY = "verify"  # the target's call: forward, walk, commit KV, gather features
    APPEND = "append"  # append accepted tokens to the requests, check stops
    DRAFT_FORWARD = "draft_forward"  # the drafter's forward pass (inside DRAFT)
    TARGET_FORWARD = "target_forward"  # the target's verify forward pass (inside VERIFY)


STEP_STAGES = (Stage.SCHEDULE, Stage.PREFILL, Stage.DRAFT, Stage.BUILD, Stage.VERIFY, Stage.APPEND)
"""Engine stages in pipeline order (`SpecEngine.step`)."""

MODEL_STAGES = (Stage.DRAFT_FORWARD, Stage.TARGET_FORWARD)
"""The two forward passes, timed inside the draft and target steps (nested in draft / verify)."""


class StageTimer:
    """Accumulates seconds per stage name when enabled.

    `synchronize` (e.g. `torch.cuda.synchronize`) runs before each clock read so GPU work is
    charged to the stage that launched it; it costs a host sync, which is why timing is opt-in.
    """

    def __init__(self, enabled: bool = False, synchronize: Callable[[], None] | None = None) -> None:
        self.enabled = enabled
        self._synchronize = synchronize
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def stage(self, name: Stage) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start
            self.counts[name] += 1

    def reset(self) -> None:
        self.seconds.clear()
        self.counts.clear()

    def _sync(self) -> None:
        if self._synchronize is not None:
            self._synchronize()
