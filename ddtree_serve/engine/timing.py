"""Opt-in per-stage time accounting for the step loop (off: one attribute check per stage).

On a CPU a stage's time is its wall clock. On CUDA it is read from CUDA events recorded at
the stage's start and end on the current stream: the span of the device's timeline between
them, which charges queued GPU work to the stage that launched it without a synchronize, so
timing on does not change what it times (the step keeps its one host sync).
"""

import time
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum

import torch


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
    """Accumulates seconds per stage name when enabled; `cuda_events`: time stages on CUDA.

    Event pairs are read when they have completed (checked without waiting at every stage
    end) or when `seconds` is read, which waits for the last one.
    """

    def __init__(self, enabled: bool = False, cuda_events: bool = False) -> None:
        self.enabled = enabled
        self.cuda_events = cuda_events
        self._seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._pending: deque[tuple[str, torch.cuda.Event, torch.cuda.Event]] = deque()

    @property
    def seconds(self) -> dict[str, float]:
        self._collect(wait=True)
        return self._seconds

    @contextmanager
    def stage(self, name: Stage) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.cuda_events:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._pending.append((name, start, end))
                self.counts[name] += 1
                self._collect(wait=False)
            return
        start_s = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - start_s
            self.counts[name] += 1

    def reset(self) -> None:
        self._collect(wait=True)
        self._seconds.clear()
        self.counts.clear()

    def _collect(self, wait: bool) -> None:
        """Add the completed event pairs, oldest first (all of them after waiting if `wait`)."""
        while self._pending:
            name, start, end = self._pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            self._pending.popleft()
            self._seconds[name] += start.elapsed_time(end) / 1e3
