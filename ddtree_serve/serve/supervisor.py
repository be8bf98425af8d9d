"""`EngineSupervisor`: a group's current engine, rebuilt in place after Ray restarts its target.

A lost target ends its engine: `AsyncLLM` fails the requests in flight with `EngineDeadError`
and they end retriable (503 / UNAVAILABLE). The KV caches died with the target, so the engine's
requests cannot go on; but the replica, its placement group and the drafter are fine. Ray
restarts a lone target actor in its bundle (`placement.target_max_restarts`) in the time of one
worker start and model load, against a whole new group for Serve's replacement (a replica
process, a placement group, two worker processes, the Coordinator's imports). The supervisor
retires the lost engine, waits for the restarted target and starts a new engine over the same
actors (the Coordinator's `restart` callable), so the same replica serves again. Meanwhile:

- `check_serving` fails: the health endpoints answer 503 / NOT_SERVING and new requests get
  503 / UNAVAILABLE at once, so routers and clients retry elsewhere or later;
- `check_restart` (Serve's replica health check) passes, so Serve does not replace the replica
  while the restart is under way, unless the restart failed (the target is dead for good, past
  its restarts) or overran `restart_timeout_s`: then it fails from then on, and Serve's
  replacement of the whole group is the fallback.
"""

import logging
import threading
import time
from collections.abc import Callable

from ddtree_serve.engine.async_llm import AsyncLLM
from ddtree_serve.engine.interfaces import TargetUnavailableError

logger = logging.getLogger("ray.serve")

EngineRestart = Callable[[AsyncLLM], AsyncLLM]
"""Blocking: retire the lost engine, wait for the restarted target, return a new engine."""


class EngineSupervisor:
    """Owns which engine serves; restarts it, in place, after its target was lost.

    The restart runs on its own thread, outside any request: Ray cancels the calls a request
    made when Serve cancels the request, and the restart must outlive the request that found
    the loss. Its state changes under a lock; the replica's event loop reads it.
    """

    def __init__(self, llm: AsyncLLM, restart: EngineRestart | None, restart_timeout_s: float) -> None:
        """`restart` None: this group's target is not restarted alone (in process, or a
        tensor-parallel group), so a lost target fails health and Serve replaces the group."""
        self._llm = llm
        self._restart = restart
        self._restart_timeout_s = restart_timeout_s
        self._lost_at: float | None = None  # monotonic time of the loss being restarted from
        self._failure: str | None = None  # why the group cannot serve again in place
        self._lock = threading.Lock()
        self.num_target_restarts = 0  # in-place restarts completed

    @property
    def llm(self) -> AsyncLLM:
        """The engine that serves now (a lost one until its restart completes)."""
        return self._llm

    @property
    def restarting(self) -> bool:
        return self._lost_at is not None and self._failure is None

    def target_lost(self, llm: AsyncLLM, error: TargetUnavailableError) -> None:
        """`llm`'s target is lost: start restarting in place, once per engine (later reports of
        the same loss, or of an engine already replaced, change nothing)."""
        with self._lock:
            if llm is not self._llm or self._lost_at is not None or self._failure is not None:
                return
            self._lost_at = time.monotonic()
            if self._restart is None:
                self._failure = f"{error}; this group cannot restart its target in place"
                logger.error("target lost (%s): failing health, Serve replaces the group", error)
                return
        logger.warning("target lost (%s): waiting for Ray to restart it in place", error)
        threading.Thread(
            target=self._restart_engine, args=(llm,), name="ddtree-target-restart", daemon=True
        ).start()

    def is_retired(self, llm: AsyncLLM) -> bool:
        """Whether `llm` was given up for a target loss (its requests end retriable)."""
        return llm is not self._llm or self._lost_at is not None

    def check_serving(self) -> None:
        """Raises `TargetUnavailableError` while the group cannot take requests: its target is
        restarting, or lost for good."""
        if self._failure is not None:
            raise TargetUnavailableError(self._failure)
        if self._lost_at is not None:
            raise TargetUnavailableError("the target worker is restarting")

    def check_restart(self) -> None:
        """Serve's health check: raises once an in-place restart failed or overran its bound."""
        with self._lock:
            lost_at = self._lost_at
            overran = lost_at is not None and time.monotonic() - lost_at > self._restart_timeout_s
            if self._failure is None and overran:
                self._failure = f"the target did not come back within {self._restart_timeout_s:g} s"
                logger.error("%s: failing health, Serve replaces the group", self._failure)
            if self._failure is not None:
                raise RuntimeError(self._failure)

    def _restart_engine(self, lost: AsyncLLM) -> None:
        """The restart thread: a new engine in place, or the failure that hands over to Serve."""
        assert self._restart is not None and self._lost_at is not None
        try:
            llm = self._restart(lost)
        except Exception as error:  # dead for good (past its restarts), or its engine failed
            logger.exception("target restart failed: failing health, Serve replaces the group")
            with self._lock:
                reason = f"{type(error).__name__}: {_first_line(error)}"
                self._failure = self._failure or f"the target did not restart in place ({reason})"
            return
        with self._lock:
            given_up = self._failure is not None  # overran its bound: Serve replaces the group
            if not given_up:
                elapsed_s = time.monotonic() - self._lost_at
                self._llm, self._lost_at = llm, None
                self.num_target_restarts += 1
        if given_up:
            llm.shutdown()
            return
        logger.warning("target restarted in place: serving again %.1f s after its loss", elapsed_s)


def _first_line(error: Exception) -> str:
    """Ray's error text runs to many lines; a status message is one (the log keeps the rest)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
