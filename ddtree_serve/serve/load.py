"""What one speculation group reports to the autoscaling policy: slots, queue, wait, tau and
how often the budget fell to "no draft".

Serve calls the Coordinator's `record_autoscaling_stats` every few seconds and averages the
figures over its look-back window; `serve/autoscaling.py` reads them, keyed by the names below.
Two sources feed `GroupLoad`: the engine thread reports every step (`on_step`, tokens per
request and whether the adaptive budget drafted), and each request's stream is watched until
its first token (`watch`), so the age of the oldest request still waiting is known without a
queue timestamp inside the engine.
"""

import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TypeVar

from ddtree_serve.serve.observed_engine import StepRecord

# Keys of the figures a group reports (Serve's custom autoscaling metrics).
RUNNING = "ddtree_running"  # requests holding a KV slot
WAITING = "ddtree_waiting"  # requests admitted and waiting for a slot
MAX_NUM_SEQS = "ddtree_max_num_seqs"  # the group's KV slots
QUEUE_WAIT_S = "ddtree_queue_wait_s"  # age of the oldest request without its first token
TOKENS_PER_STEP = "ddtree_tokens_per_step"  # mean tokens one request committed per step (tau)
NO_DRAFT_SHARE = "ddtree_no_draft_share"  # share of recent steps the adaptive budget did not draft

_Item = TypeVar("_Item")


class GroupLoad:
    """The load figures of one Coordinator; written by the engine thread and the event loop."""

    def __init__(self, max_num_seqs: int, window_steps: int = 32) -> None:
        self._max_num_seqs = max_num_seqs
        # (tokens committed, requests verified, drafted) of the latest steps that verified something.
        self._steps: deque[tuple[int, int, bool]] = deque(maxlen=window_steps)
        self._steps_lock = threading.Lock()
        self._first_token_pending: dict[str, float] = {}  # request id -> monotonic start (event loop)

    def on_step(self, record: StepRecord) -> None:
        """Engine thread, after every step: keeps the step's tokens per verified request, and
        whether it drafted (a step of the fixed policy always counts as drafted: it chose no less;
        under the adaptive one a step without a drafter, lost for a while, counts as not)."""
        if record.num_step_tokens:
            drafted = record.budget is None or record.budget.drafted
            with self._steps_lock:
                self._steps.append(
                    (sum(record.num_step_tokens.values()), len(record.num_step_tokens), drafted)
                )

    async def watch(self, request_id: str, stream: AsyncIterator[_Item]) -> AsyncIterator[_Item]:
        """`stream` unchanged; the request counts as waiting until its first item arrives."""
        self._first_token_pending[request_id] = time.monotonic()
        try:
            async with aclosing(stream):
                async for item in stream:
                    self._first_token_pending.pop(request_id, None)
                    yield item
        finally:
            self._first_token_pending.pop(request_id, None)

    def stats(self, num_running: int, num_waiting: int) -> dict[str, float]:
        """The figures Serve hands the policy, for the engine's current running/waiting counts."""
        now = time.monotonic()
        oldest = min(self._first_token_pending.values(), default=now)
        with self._steps_lock:
            tokens = sum(step_tokens for step_tokens, _, _ in self._steps)
            requests = sum(num_requests for _, num_requests, _ in self._steps)
            plain_steps = sum(not drafted for _, _, drafted in self._steps)
            num_steps = len(self._steps)
        return {
            RUNNING: float(num_running),
            WAITING: float(num_waiting),
            MAX_NUM_SEQS: float(self._max_num_seqs),
            QUEUE_WAIT_S: now - oldest,
            TOKENS_PER_STEP: tokens / requests if requests else 0.0,
            NO_DRAFT_SHARE: plain_steps / num_steps if num_steps else 0.0,
        }
