"""`EngineSupervisor`: an in-place restart after a target loss, and the hand-over to Serve's
replacement when the restart fails or overruns its bound. Engines are stand-ins: the supervisor
only chooses which one serves."""

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from ddtree_serve.engine.interfaces import TargetUnavailableError
from ddtree_serve.serve.supervisor import EngineSupervisor

LOSS = TargetUnavailableError("the target worker died (ActorDiedError)")


class StandInEngine:
    """What the supervisor holds for an `AsyncLLM`: an identity that can be shut down."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True


class Restart:
    """A restart that waits for `release` (Ray restarting the target) and returns a new engine,
    or raises `error`; records which lost engines it was asked to restart."""

    def __init__(self, error: Exception | None = None) -> None:
        self.release = threading.Event()
        self.error = error
        self.lost: list[StandInEngine] = []
        self.started: list[StandInEngine] = []

    def __call__(self, lost: Any) -> Any:
        self.lost.append(lost)
        self.release.wait(timeout=30)
        if self.error is not None:
            raise self.error
        engine = StandInEngine(f"restarted {len(self.lost)}")
        self.started.append(engine)
        return engine


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def supervisor_over(restart: Restart | None, timeout_s: float = 60.0) -> tuple[EngineSupervisor, Any]:
    first: Any = StandInEngine("first")  # an `AsyncLLM` to the supervisor
    return EngineSupervisor(first, restart, timeout_s), first


def test_a_lost_target_restarts_in_place_while_serves_check_passes() -> None:
    restart = Restart()
    supervisor, first = supervisor_over(restart)
    supervisor.check_serving()
    supervisor.target_lost(first, LOSS)
    assert supervisor.restarting and supervisor.is_retired(first)
    with pytest.raises(TargetUnavailableError, match="restarting"):
        supervisor.check_serving()  # health endpoints and new requests: down at once
    supervisor.check_restart()  # Serve's own check: passes, the replica is not replaced
    restart.release.set()
    wait_for(lambda: not supervisor.restarting)
    assert restart.lost == [first] and supervisor.llm is restart.started[0]
    assert supervisor.num_target_restarts == 1 and not supervisor.is_retired(supervisor.llm)
    supervisor.check_serving()
    supervisor.check_restart()


def test_one_loss_is_one_restart_and_a_retired_engine_reports_nothing() -> None:
    restart = Restart()
    supervisor, first = supervisor_over(restart)
    supervisor.target_lost(first, LOSS)
    supervisor.target_lost(first, LOSS)  # every failed request reports it
    restart.release.set()
    wait_for(lambda: not supervisor.restarting)
    supervisor.target_lost(first, LOSS)  # a late report from the old engine
    assert not supervisor.restarting and restart.lost == [first]
    # A loss of the new engine's target is a second restart.
    supervisor.target_lost(supervisor.llm, LOSS)
    wait_for(lambda: not supervisor.restarting)
    assert supervisor.num_target_restarts == 2 and len(restart.lost) == 2


def test_a_target_that_stays_dead_fails_serves_check() -> None:
    restart = Restart(error=RuntimeError("The actor died unexpectedly\nbefore finishing this task."))
    restart.release.set()
    supervisor, first = supervisor_over(restart)
    supervisor.target_lost(first, LOSS)
    wait_for(lambda: not supervisor.restarting)
    with pytest.raises(RuntimeError, match="did not restart in place") as failure:
        supervisor.check_restart()  # Serve replaces the group from here
    assert "\n" not in str(failure.value)
    with pytest.raises(TargetUnavailableError, match="did not restart in place"):
        supervisor.check_serving()
    assert supervisor.llm is first and supervisor.num_target_restarts == 0


def test_a_restart_past_its_bound_hands_over_to_serve_and_its_late_engine_is_shut_down() -> None:
    restart = Restart()
    supervisor, first = supervisor_over(restart, timeout_s=0.01)
    supervisor.target_lost(first, LOSS)
    time.sleep(0.05)
    with pytest.raises(RuntimeError, match="did not come back within"):
        supervisor.check_restart()
    restart.release.set()
    wait_for(lambda: bool(restart.started) and restart.started[0].shut_down)
    assert supervisor.llm is first and supervisor.num_target_restarts == 0
    with pytest.raises(RuntimeError):
        supervisor.check_restart()


def test_a_group_that_cannot_restart_its_target_fails_serves_check_at_once() -> None:
    supervisor, first = supervisor_over(None)
    supervisor.target_lost(first, LOSS)
    with pytest.raises(RuntimeError, match="cannot restart its target in place"):
        supervisor.check_restart()
    with pytest.raises(TargetUnavailableError):
        supervisor.check_serving()
