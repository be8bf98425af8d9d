"""The socket step graph's pieces without Ray actors: framing, the token, and the order in which
each worker's server runs what reaches it (`tests/serve/test_transport.py` runs the whole graph
on real actors)."""

import select
import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from ddtree_serve.serve.compiled_graph import GraphDrafter
from ddtree_serve.serve.graph_calls import ContextDelivery, DrafterCall, TargetCall
from ddtree_serve.serve.step_sockets import (
    ChannelAddress,
    DrafterChannelServer,
    LocalTargetEnd,
    SocketGraph,
    TargetChannelServer,
    connect,
    recv_message,
    send_message,
)
from ddtree_serve.serve.wire import from_wire, to_wire

COORDINATOR, TARGET = b"C", b"T"


def test_a_message_with_tensors_and_large_arrays_arrives_whole() -> None:
    """Arrays travel out of band in the same `sendmsg`; a payload larger than the socket's
    buffers arrives whole (a reader thread drains it meanwhile)."""
    sender, receiver = socket.socketpair()
    tensors = [torch.randn(3, 7, dtype=torch.bfloat16), torch.arange(12).reshape(3, 4)]
    big = np.random.default_rng(0).integers(0, 255, size=40 << 20, dtype=np.uint8)
    value = (to_wire(tensors), {"big": big, "empty": np.zeros(0, np.float32)}, "text", None)
    received: list[Any] = []
    reader = threading.Thread(target=lambda: received.append(recv_message(receiver)))
    reader.start()
    send_message(sender, value)
    reader.join(timeout=30)
    wired, arrays, text, nothing = received[0]
    assert all(torch.equal(a, b) for a, b in zip(tensors, from_wire(wired), strict=True))
    assert np.array_equal(arrays["big"], big) and arrays["empty"].shape == (0,)
    assert (text, nothing) == ("text", None)
    sender.close()
    with pytest.raises(EOFError):
        recv_message(receiver)


def _drafter_server(overlap: bool) -> tuple[DrafterChannelServer, list[Any]]:
    """A drafter server whose nodes record what they ran, in order."""
    ran: list[Any] = []
    lock = threading.Lock()

    def draft(call: DrafterCall | None) -> Any:
        ran.append(("draft", None if call is None else call.inputs))
        return None if call is None else f"drafted {call.inputs}"

    def take_context(delivery: ContextDelivery | None, call: DrafterCall | None) -> Any:
        ran.append(
            ("take", None if delivery is None else delivery.slots, None if call is None else call.releases)
        )
        if call is not None and call.inputs == "fail":
            raise ValueError("the drafter's own error")
        return None if call is None or call.inputs is None else f"drafted {call.inputs}"

    return DrafterChannelServer(draft, take_context, lock, overlap), ran


def test_the_serial_drafter_takes_each_delivery_with_its_own_executions_message() -> None:
    """A delivery that arrives before its execution's message waits for it: the message's
    releases run first, then the features are kept, then the draft (the compiled graph's order)."""
    server, ran = _drafter_server(overlap=False)
    target = connect(server.address, TARGET)
    coordinator = connect(server.address, COORDINATOR)
    send_message(target, (0, True, ContextDelivery((3,), "features")))
    time.sleep(0.05)
    assert ran == []  # no message of execution 0 yet
    release_then_draft = DrafterCall((3,), "block")
    send_message(coordinator, (0, 0, release_then_draft, True, True))
    assert recv_message(coordinator) == (0, True, "drafted block")
    assert ran == [("take", (3,), (3,))]
    # A target call that failed fails the drafter's node after it, with the target's error.
    send_message(coordinator, (1, 1, DrafterCall((), "next"), True, True))
    send_message(target, (1, False, KeyError("verify failed")))
    seq, ok, error = recv_message(coordinator)
    assert (seq, ok, type(error)) == (1, False, KeyError)
    # A call without a reply reports its own error unasked, with no sequence number.
    send_message(coordinator, (2, 2, DrafterCall((), "fail"), False, False))
    seq, ok, error = recv_message(coordinator)
    assert (seq, ok, str(error)) == (None, False, "the drafter's own error")
    server.close()


def test_the_overlapped_drafter_drafts_before_its_executions_delivery_arrives() -> None:
    server, ran = _drafter_server(overlap=True)
    target = connect(server.address, TARGET)
    coordinator = connect(server.address, COORDINATOR)
    send_message(coordinator, (0, 0, DrafterCall((), "A"), True, True))
    assert recv_message(coordinator) == (0, True, "drafted A")  # the target has sent nothing yet
    send_message(coordinator, (1, 1, DrafterCall((), "B"), False, True))
    time.sleep(0.05)
    assert ran == [("draft", "A")]  # B waits behind execution 0's delivery
    send_message(target, (0, True, ContextDelivery((1,), "features")))
    assert recv_message(coordinator) == (1, True, "drafted B")
    assert ran == [("draft", "A"), ("take", (1,), None), ("draft", "B")]
    server.close()


def test_a_connection_without_the_token_is_dropped_and_the_real_peer_served() -> None:
    server, _ = _drafter_server(overlap=False)
    intruder = socket.create_connection((server.address.host, server.address.port))
    intruder.sendall(b"x" * 33)
    assert intruder.recv(1) == b""  # closed on us
    forged = ChannelAddress(server.address.host, server.address.port, b"\0" * 32)
    with pytest.raises(EOFError):
        recv_message(connect(forged, COORDINATOR))
    coordinator = connect(server.address, COORDINATOR)
    send_message(coordinator, (0, 0, DrafterCall((), "ok"), False, True))
    assert recv_message(coordinator) == (0, True, "drafted ok")
    server.close()


@pytest.mark.parametrize(
    ("family_variable", "unix_name", "family"),
    [
        (None, None, socket.AF_UNIX),  # the server's own name
        ("tcp", None, socket.AF_INET),
        (None, "\0ddtree-step-nobody-listens", socket.AF_INET),  # e.g. another network namespace
    ],
)
def test_a_peer_on_the_same_node_connects_over_the_unix_socket_else_over_tcp(
    monkeypatch: pytest.MonkeyPatch, family_variable: str | None, unix_name: str | None, family: int
) -> None:
    """Same node: the abstract Unix socket; `DDTREE_STEP_SOCKET_FAMILY=tcp`, or a Unix name
    that does not answer: TCP. Each connection is served alike."""
    if family_variable is not None:
        monkeypatch.setenv("DDTREE_STEP_SOCKET_FAMILY", family_variable)
    server, _ = _drafter_server(overlap=False)
    address = server.address
    assert address.unix_name is not None and address.unix_name.startswith("\0")
    if unix_name is not None:
        address = ChannelAddress(address.host, address.port, address.token, unix_name)
    coordinator = connect(address, COORDINATOR)
    assert coordinator.family == family
    send_message(coordinator, (0, 0, DrafterCall((), "block"), False, True))
    assert recv_message(coordinator) == (0, True, "drafted block")
    server.close()


def test_a_unix_connection_without_the_token_is_dropped() -> None:
    server, _ = _drafter_server(overlap=False)
    assert server.address.unix_name is not None
    intruder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    intruder.connect(server.address.unix_name)
    intruder.sendall(b"x" * 33)
    assert intruder.recv(1) == b""  # closed on us
    coordinator = connect(server.address, COORDINATOR)
    send_message(coordinator, (0, 0, DrafterCall((), "ok"), False, True))
    assert recv_message(coordinator) == (0, True, "drafted ok")
    server.close()


def test_the_target_delivers_before_it_replies_and_close_waits_for_the_call_in_progress() -> None:
    """Nothing the Coordinator sent runs after `close` returned: a replay cannot run a call twice."""
    lock = threading.Lock()
    calls: list[int] = []
    started, finish = threading.Event(), threading.Event()

    def run_call(call: TargetCall, deliver: bool) -> tuple[Any, Any]:
        calls.append(call.call_id)
        if call.call_id == 1:
            started.set()
            finish.wait(timeout=10)
        if call.method is None:
            raise RuntimeError("no method")
        return f"output {call.call_id}", ContextDelivery(
            (0,), f"features {call.call_id}"
        ) if deliver else None

    drafter_listener = socket.create_server(("127.0.0.1", 0))
    token = b"t" * 32
    drafter_address = ChannelAddress("127.0.0.1", drafter_listener.getsockname()[1], token)
    accepted: list[socket.socket] = []
    acceptor = threading.Thread(target=lambda: accepted.append(drafter_listener.accept()[0]))
    acceptor.start()
    server = TargetChannelServer(run_call, lock, drafter_address)
    acceptor.join(timeout=10)
    drafter = accepted[0]
    assert drafter.recv(33) == token + TARGET
    coordinator = connect(server.address, COORDINATOR)

    send_message(coordinator, (0, 10, TargetCall(0, (), "verify_and_commit", None)))
    assert recv_message(drafter) == (10, True, ContextDelivery((0,), "features 0"))
    assert recv_message(coordinator) == (0, True, "output 0")
    send_message(coordinator, (1, 11, TargetCall(2, (), None, None)))
    seq, ok, error = recv_message(coordinator)
    assert (seq, ok, type(error)) == (1, False, RuntimeError)
    assert recv_message(drafter)[:2] == (11, False)

    send_message(coordinator, (2, 12, TargetCall(1, (), "verify_and_commit", None)))
    send_message(coordinator, (3, 13, TargetCall(3, (), "verify_and_commit", None)))
    assert started.wait(timeout=10)
    closer = threading.Thread(target=server.close)
    closer.start()
    time.sleep(0.1)
    assert closer.is_alive()  # waits for call 1
    finish.set()
    closer.join(timeout=10)
    assert not closer.is_alive()
    assert calls == [0, 2, 1]  # call 3 was in the socket: it never runs


class _GraphThatFailsToRebuild:
    """A `StepGraph` stand-in whose drafter died again while its graph was being rebuilt."""

    transport = "sockets"

    compiled = False

    def __init__(self) -> None:
        self.attempts = 0

    def recompile(self) -> None:
        self.attempts += 1
        raise ConnectionRefusedError("the drafter's step socket is gone")


def test_a_drafter_lost_again_while_its_graph_is_rebuilt_stays_lost() -> None:
    """`GraphDrafter.is_available` answers False (the engine decodes plainly and asks again next
    step) instead of raising out of the engine's step."""
    graph = _GraphThatFailsToRebuild()
    drafter = GraphDrafter(graph, SimpleNamespace(is_available=lambda: True))  # type: ignore[arg-type]
    assert drafter.is_available() is False
    assert drafter.is_available() is False
    assert graph.attempts == 2


class _InProcessDrafter:
    """A drafter "actor" whose step server runs in this process (`ray.get` patched to identity)."""

    def __init__(self, draft: Any) -> None:
        self.server: DrafterChannelServer | None = None
        self._draft = draft
        self.open_step_channel = SimpleNamespace(remote=self._open)
        self.close_step_channel = SimpleNamespace(remote=lambda: self.server.close() if self.server else None)

    def _open(self, overlap: bool) -> ChannelAddress:
        take = lambda delivery, call: None
        self.server = DrafterChannelServer(self._draft, take, threading.Lock(), overlap)
        return self.server.address


def test_a_target_in_the_coordinator_never_waits_on_a_drafter_sending_a_large_draft(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Overlapped shape, target in the Coordinator's process: the drafter drafts first and sends
    a draft larger than the socket buffers while the local target's delivery (as large) is on its
    way; the delivery leaves from its own thread, so the engine thread reads the draft and
    neither side blocks for good."""
    import ddtree_serve.serve.step_sockets as step_sockets

    monkeypatch.setattr(step_sockets.ray, "get", lambda value, timeout=None: value)
    size = 48 << 20
    drafter = _InProcessDrafter(lambda call: np.ones(size, np.uint8))
    end = LocalTargetEnd(
        lambda call, deliver: ("verified", np.ones(size, np.uint8) if deliver else None), overlap=True
    )
    graph = SocketGraph(end, drafter, overlap=True)
    results: list[Any] = []

    def step() -> None:
        verify = TargetCall(0, (), "verify_and_commit", None)
        draft, target, _ = graph.execute(DrafterCall((), "block"), verify)
        results.extend([target.get(30.0), len(draft.get(30.0))])

    runner = threading.Thread(target=step, daemon=True)
    runner.start()
    runner.join(timeout=60.0)
    assert results == ["verified", size], "the step hung"
    graph.teardown()


def _serial_end(run_call: Any) -> tuple[LocalTargetEnd, socket.socket, socket.socket]:
    """A serial local target end connected to a drafter's socket here -> (end, the drafter's
    side of the connection, past the hello, its listener)."""
    listener = socket.create_server(("127.0.0.1", 0))
    address = ChannelAddress("127.0.0.1", listener.getsockname()[1], b"t" * 32)
    end = LocalTargetEnd(run_call, overlap=False)
    end.connect(address)
    drafter, _ = listener.accept()
    assert drafter.recv(33) == b"t" * 32 + TARGET
    return end, drafter, listener


def _run_calls(end: LocalTargetEnd, count: int) -> list[Any]:
    """`count` target calls from an engine thread of their own: their outcomes, as many as came
    back within 30 s (fewer: a call is held)."""
    outcomes: list[Any] = []

    def steps() -> None:
        for call_id in range(count):
            outcomes.append(end.run(call_id, TargetCall(call_id, (), "verify_and_commit", None)))

    runner = threading.Thread(target=steps, daemon=True)
    runner.start()
    runner.join(timeout=30.0)
    return outcomes


def test_a_serial_target_in_the_coordinator_has_sent_its_delivery_when_its_call_returns() -> None:
    """Serial shape: the engine thread sends a small delivery itself when none is queued, so the
    drafter has it before the next draft is asked for (no hand-over to the sender thread)."""
    features = ContextDelivery((0,), "features")
    end, drafter, listener = _serial_end(lambda call, deliver: ("verified", features))
    assert end.run(7, TargetCall(0, (), "verify_and_commit", None)) == (True, "verified")
    readable, _, _ = select.select([drafter], [], [], 0.0)
    assert readable, "the delivery is still to be sent"
    assert recv_message(drafter) == (7, True, ContextDelivery((0,), "features"))
    end.close()
    listener.close()


@pytest.mark.parametrize("inline", [True, False], ids=["engine-thread", "sender-thread"])
def test_a_serial_delivery_to_a_drafter_that_stopped_reading_gives_up_after_its_timeout(
    monkeypatch: pytest.MonkeyPatch, inline: bool
) -> None:
    """A drafter alive but not reading holds a delivery only for the delivery timeout (the graph's
    reply timeout; its reply wait breaks the graph, as before), then counts as gone and sees the
    connection end (never a half message); the engine thread's calls still return their outcome."""
    import ddtree_serve.serve.step_sockets as step_sockets

    monkeypatch.setattr(step_sockets, "_DELIVERY_TIMEOUT_S", 0.3)
    if inline:  # the engine thread sends even this one itself
        monkeypatch.setattr(LocalTargetEnd, "INLINE_DELIVERY_BYTES", 1 << 40)
    big = np.ones(64 << 20, np.uint8)  # more than both sockets' buffers
    end, drafter, listener = _serial_end(lambda call, deliver: ("verified", big if deliver else None))
    # The drafter reads nothing until the end gave up.
    assert _run_calls(end, 2) == [(True, "verified")] * 2, "the engine thread is held by the drafter"
    for _ in range(300):  # the sender thread's send times out on its own
        if not end.connected:
            break
        time.sleep(0.1)
    assert not end.connected
    drafter.settimeout(30.0)
    with pytest.raises(EOFError):  # the half-sent delivery ends the connection, never a message
        recv_message(drafter)
    end.close()
    drafter.close()
    listener.close()


def test_a_small_serial_delivery_waits_behind_a_large_one_the_sender_thread_holds() -> None:
    """A delivery above `INLINE_DELIVERY_BYTES` goes by the sender thread; a small one after it
    queues behind it rather than overtake it, and neither call waits for the drafter to read."""
    sizes = iter([64 << 20, 16])
    end, drafter, listener = _serial_end(lambda call, deliver: ("verified", np.ones(next(sizes), np.uint8)))
    # The drafter reads nothing yet: the first fills both buffers.
    assert _run_calls(end, 2) == [(True, "verified")] * 2, "a call waited for the drafter to read"
    received = [recv_message(drafter) for _ in range(2)]
    assert [(execution, ok, len(value)) for execution, ok, value in received] == [
        (0, True, 64 << 20),
        (1, True, 16),
    ]
    end.close()
    drafter.close()
    listener.close()
