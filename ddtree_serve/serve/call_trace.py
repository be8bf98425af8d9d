"""Opt-in time stamps inside a worker's calls: where a served step's milliseconds go.

A served step pays, per actor call, the hop in, the unwiring of its inputs, the model work, the
wiring of its outputs (which waits for the device) and the hop back. The Coordinator sees only
the sum; a worker with its trace on records when each part of a call ended, so
`bench/hop_breakdown.py` can set them beside the Coordinator's own stamps. Stamps are
`time.perf_counter()`, Linux's CLOCK_MONOTONIC: one clock for every process of a host, so a
worker's stamps and its caller's compare directly.

Off (the default) a call pays one attribute check and an empty context manager.
"""

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# Calls kept between two reads; older ones are dropped (a trace is read after a few steps).
_MAX_CALLS = 4096


@dataclass
class CallStamps:
    """One call's stamps: `marks` is (part name, seconds at its end) in order after `start_s`."""

    method: str
    start_s: float
    marks: list[tuple[str, float]] = field(default_factory=list)

    def mark(self, part: str) -> None:
        self.marks.append((part, time.perf_counter()))


class CallTrace:
    """The stamped calls of one worker, when `enabled`."""

    def __init__(self) -> None:
        self.enabled = False
        self._calls: deque[CallStamps] = deque(maxlen=_MAX_CALLS)

    @contextmanager
    def call(self, method: str) -> Iterator[CallStamps | None]:
        """Stamps one call (None when off); the body marks its parts, the exit marks "return"."""
        if not self.enabled:
            yield None
            return
        stamps = CallStamps(method, time.perf_counter())
        yield stamps
        stamps.mark("return")
        self._calls.append(stamps)

    def take(self) -> list[CallStamps]:
        """The calls stamped since the last `take`, oldest first."""
        calls = list(self._calls)
        self._calls.clear()
        return calls


def mark(stamps: CallStamps | None, part: str) -> None:
    """`stamps.mark(part)` when the trace is on."""
    if stamps is not None:
        stamps.mark(part)
