"""Opt-in per-stage wall-clock accounting for the step loop (off: one attribute check per stage)."""

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

STEP_STAGES = ("schedule", "prefill", "draft", "build", "verify", "commit")
"""Engine stages in pipeline order; timing, logs and the benchmark share these names."""

MODEL_STAGES = ("draft_forward", "target_forward")
"""The two forward passes, timed inside the in-process workers (nested in draft / verify)."""


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
    def stage(self, name: str) -> Iterator[None]:
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
