"""The step graph over the group's own sockets (`placement.transport: sockets`).

The compiled graph (`compiled_graph.py`) moves each execution through Ray's shared-memory
channels, yet on the H200 host each of its hops still cost 0.5-1.3 ms (`bench/hop_breakdown.py`,
README): more than the bundled pair's whole verify. This module runs the same graph (the same
`TargetCall` / `DrafterCall`s of `graph_calls.py`, the same worker methods, the serial and the
overlapped shape, `StepGraph`'s fault handling) over three connections that the group opens
once: Coordinator -> target, Coordinator -> drafter, target -> drafter. A message is a
length-prefixed pickle (protocol 5, numpy buffers out of band, sent with one `sendmsg`). Ray
still places, starts, restarts and health-checks the actors; only the step calls bypass it, as
vLLM's multiprocessing executor and SGLang's ZMQ pipes bypass it for theirs.

Each worker serves its connections from a thread of its own (`TargetChannelServer`,
`DrafterChannelServer`), holding the worker's model lock while a call runs. The drafter runs
the Coordinator's messages one at a time in order; a message whose execution has a target call
also takes that call's delivery (the features, or the error the target call raised), read from
the target's connection as soon as it arrives so the target never blocks on a full socket. The
Coordinator likewise reads whichever connection has data while it waits for a reply.

With the target inside the Coordinator (`placement.workers: target_in_coordinator`) there are
two connections, both to the drafter: the Coordinator's, and one of the target's role over
which `LocalTargetEnd` sends each target call's delivery (from a thread of its own, or, small
and serial, from the engine thread).

A worker listens on its node's address (the Coordinator may run on another node) and, beside
it, on a Unix socket in Linux's abstract namespace; a peer on the same node connects there (on
the CI host a 100 KB round trip took 57 us against loopback TCP's 120), another node's over TCP,
and where the Unix connection fails (a peer in another network namespace), over TCP too.
`DDTREE_STEP_SOCKET_FAMILY=tcp` keeps every connection on TCP. A worker drops a connection
whose first bytes are not the token it handed out through Ray. `close` (a Ray call,
`close_step_channel`) waits for the call in progress and stops the thread; a message still in
the socket never runs, so `StepGraph`'s replay after a break never runs a target call twice.
"""

import collections
import contextlib
import hmac
import itertools
import logging
import os
import pickle
import queue
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from ddtree_serve.serve.graph_calls import ContextDelivery, DrafterCall, TargetCall

logger = logging.getLogger(__name__)

_TOKEN_BYTES = 32
_ROLE_COORDINATOR, _ROLE_TARGET = b"C", b"T"
# A message: the pickle's length and the number of out-of-band buffers, then each buffer's length.
_HEADER = struct.Struct("<QI")
_LENGTH = struct.Struct("<Q")
# A connecting peer has this long to send its token.
_HELLO_TIMEOUT_S = 5.0
# A closing target end lets its queued deliveries go for this long before cutting the connection.
_CLOSE_WAIT_S = 1.0
# A delivery waits this long for a drafter that stopped reading, as long as the step graph waits
# for a reply: then the drafter counts as gone.
_DELIVERY_TIMEOUT_S = 600.0
# Socket buffers large enough for a batch's tree buffers or drafts in one go.
_SOCKET_BUFFER_BYTES = 8 << 20


RunTargetCall = Callable[[TargetCall, bool], tuple[Any, ContextDelivery | None]]
"""`run_call(call, deliver)` -> (output, the drafter's delivery or None): a target's graph call."""


class StepChannelError(ConnectionError):
    """A worker's end of the step sockets is gone (the worker died or closed it), or a reply
    did not come in time: the graph is broken, as when a compiled graph's actor died."""


@dataclass(frozen=True)
class ChannelAddress:
    """Where a worker listens for its step connections, and the token each must open with."""

    host: str
    port: int
    token: bytes
    unix_name: str | None = None  # the abstract Unix socket's name on `host`; None: TCP only


# ------------------------------------------------------------------------------- messages


def send_message(sock: socket.socket, value: Any) -> None:
    """One message: header, buffer lengths, pickle, buffers (numpy arrays are not copied)."""
    send_parts(sock, encode_message(value))


def encode_message(value: Any) -> list[memoryview]:
    """`value` as the parts of one message, ready for `send_parts` (arrays still not copied)."""
    buffers: list[pickle.PickleBuffer] = []
    body = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    raws = [buffer.raw() for buffer in buffers]
    lengths = b"".join(_LENGTH.pack(raw.nbytes) for raw in raws)
    parts: list[memoryview] = [memoryview(_HEADER.pack(len(body), len(raws)) + lengths), memoryview(body)]
    parts.extend(raw.cast("B") for raw in raws)
    return parts


def send_parts(sock: socket.socket, parts: list[memoryview]) -> None:
    parts = list(parts)
    while parts:
        sent = sock.sendmsg(parts)
        while parts and sent >= parts[0].nbytes:
            sent -= parts[0].nbytes
            parts.pop(0)
        if parts and sent:
            parts[0] = parts[0][sent:]


def recv_message(sock: socket.socket) -> Any:
    """The next message, or raises `EOFError` when the peer closed the connection."""
    body_length, num_buffers = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    raw_lengths = _recv_exactly(sock, num_buffers * _LENGTH.size)
    lengths = [_LENGTH.unpack_from(raw_lengths, i * _LENGTH.size)[0] for i in range(num_buffers)]
    data = _recv_exactly(sock, body_length + sum(lengths))
    view = memoryview(data)
    buffers, offset = [], body_length
    for length in lengths:
        buffers.append(view[offset : offset + length])
        offset += length
    return pickle.loads(view[:body_length], buffers=buffers)


def _recv_exactly(sock: socket.socket, size: int) -> bytearray:
    data = bytearray(size)
    view = memoryview(data)
    received = 0
    while received < size:
        got = sock.recv_into(view[received:])
        if got == 0:
            raise EOFError("the peer closed the step connection")
        received += got
    return data


def _sendable(error: Exception) -> Exception:
    """`error` itself when it pickles (the caller re-raises its type), else its text."""
    try:
        pickle.dumps(error)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def _run_target_call(
    run_call: RunTargetCall, execution: int, call: TargetCall, deliver: bool
) -> tuple[tuple[bool, Any], tuple[int, bool, Any]]:
    """Run one target call -> ((ok, output or the error it raised), the drafter's message of its
    execution: the call's delivery, or the error, which fails the drafter's node after it)."""
    try:
        output, delivery = run_call(call, deliver)
    except Exception as error:
        return (False, error), (execution, False, _sendable(error))
    return (True, output), (execution, True, delivery)


# ---------------------------------------------------------------------------- connections


STEP_SOCKET_FAMILY_VARIABLE = "DDTREE_STEP_SOCKET_FAMILY"
"""`tcp`: every step connection over TCP; unset or `auto`: a Unix socket between the processes
of one node."""


def _tune(sock: socket.socket) -> None:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER_BYTES)


def connect(address: ChannelAddress, role: bytes) -> socket.socket:
    """A connection to a worker's step server, introduced by its token and our role: over its
    Unix socket from the same node, else (or where that fails) over TCP."""
    sock = _connect_unix(address)
    if sock is None:
        sock = socket.create_connection((address.host, address.port), timeout=_HELLO_TIMEOUT_S)
    sock.settimeout(None)
    _tune(sock)
    sock.sendall(address.token + role)
    return sock


def _connect_unix(address: ChannelAddress) -> socket.socket | None:
    if address.unix_name is None or os.environ.get(STEP_SOCKET_FAMILY_VARIABLE, "auto") == "tcp":
        return None
    if address.host != ray.util.get_node_ip_address():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(_HELLO_TIMEOUT_S)
    try:
        sock.connect(address.unix_name)
    except OSError as error:
        sock.close()
        logger.info("step channel: no Unix connection to %s (%s); using TCP", address.host, error)
        return None
    return sock


class _Listener:
    """A worker's listening sockets (its node's TCP address, and a Unix socket in the abstract
    namespace for peers on the node), with the token peers must send."""

    def __init__(self) -> None:
        host = ray.util.get_node_ip_address()
        tcp = socket.create_server((host, 0), backlog=4)
        unix_name: str | None = f"\0ddtree-step-{secrets.token_hex(12)}"
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            unix.bind(unix_name)
            unix.listen(4)
        except OSError:  # no abstract namespace here: TCP only
            unix.close()
            unix_name = None
        self.sockets: tuple[socket.socket, ...] = (tcp,) if unix_name is None else (tcp, unix)
        token = secrets.token_bytes(_TOKEN_BYTES)
        self.address = ChannelAddress(host, tcp.getsockname()[1], token, unix_name)

    def accept_any(self) -> tuple[socket.socket, bytes] | None:
        """Wait for the next peer on either socket: `accept`'s answer."""
        with selectors.DefaultSelector() as selector:
            for listening in self.sockets:
                selector.register(listening, selectors.EVENT_READ)
            ready = selector.select()
        return self.accept(ready[0][0].fileobj)  # type: ignore[arg-type]

    def accept(self, listening: socket.socket) -> tuple[socket.socket, bytes] | None:
        """The next peer on `listening` that sent the token, with its role; None for one that did not."""
        sock, _ = listening.accept()
        try:
            sock.settimeout(_HELLO_TIMEOUT_S)
            hello = _recv_exactly(sock, _TOKEN_BYTES + 1)
            sock.settimeout(None)
        except (OSError, EOFError):
            sock.close()
            return None
        if not hmac.compare_digest(bytes(hello[:_TOKEN_BYTES]), self.address.token):
            logger.warning("step channel: dropped a connection without the token")
            sock.close()
            return None
        _tune(sock)
        return sock, bytes(hello[_TOKEN_BYTES:])


class _ChannelServer:
    """What both workers' servers share: the listener, the thread, the lock and `close`."""

    def __init__(self, lock: threading.Lock) -> None:
        self._listener = _Listener()
        self._lock = lock
        self._closed = False
        self._peers: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve_logged, name="step-channel", daemon=True)

    @property
    def address(self) -> ChannelAddress:
        return self._listener.address

    def _serve_logged(self) -> None:
        try:
            self._serve()
        except (OSError, EOFError):
            pass  # a peer left, or `close` shut the sockets: the channel is over
        except Exception:
            logger.exception("step channel server failed")
        finally:
            for sock in (*self._peers, *self._listener.sockets):
                sock.close()

    def _serve(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Wait for the call in progress, then end the channel: nothing queued runs after.

        The flag goes up before the lock is taken: the thread, checking it under the lock before
        each call, may win the lock again after its call (locks are not fair) but runs nothing."""
        self._closed = True
        with self._lock:
            pass
        for sock in (*self._peers, *self._listener.sockets):
            with contextlib.suppress(OSError):  # not connected, or already closed
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5.0)


class TargetChannelServer(_ChannelServer):
    """The target's end: runs each `TargetCall` from the Coordinator, sends the drafter the
    call's delivery and the Coordinator its output."""

    def __init__(
        self,
        run_call: RunTargetCall,
        lock: threading.Lock,
        drafter_address: ChannelAddress | None,
    ) -> None:
        """`run_call`: the target's graph call (its output wired)."""
        super().__init__(lock)
        self._run_call = run_call
        self._drafter = None if drafter_address is None else connect(drafter_address, _ROLE_TARGET)
        if self._drafter is not None:
            self._peers.append(self._drafter)
        self._thread.start()

    def _serve(self) -> None:
        coordinator = None
        while coordinator is None:
            accepted = self._listener.accept_any()
            if accepted is not None and accepted[1] == _ROLE_COORDINATOR:
                coordinator = accepted[0]
            elif accepted is not None:
                accepted[0].close()  # only the Coordinator calls a target
        self._peers.append(coordinator)
        while True:
            seq, execution, call = recv_message(coordinator)
            with self._lock:
                if self._closed:
                    return
                deliver = self._drafter is not None
                (ok, output), sent = _run_target_call(self._run_call, execution, call, deliver)
                self._deliver(sent)
                send_message(coordinator, (seq, ok, output if ok else sent[2]))  # an error, sendable

    def _deliver(self, sent: tuple[int, bool, Any]) -> None:
        """To the drafter; a drafter that left gets no more (the Coordinator sees it gone)."""
        if self._drafter is None:
            return
        try:
            send_message(self._drafter, sent)
        except OSError:
            self._drafter.close()
            self._drafter = None


class LocalTargetEnd:
    """The target's end inside the Coordinator's own process (`placement.workers:
    target_in_coordinator`): each `TargetCall` runs in the caller's thread, and its delivery goes
    to the drafter over a connection of the target's role, as a target actor's server sends it.

    Deliveries leave in order, from a thread of their own, except in the serial shape a small
    one (`INLINE_DELIVERY_BYTES`) with none queued before it, which the caller (the engine
    thread) sends itself: it is on the wire when the call returns, instead of waiting for the
    sender thread to be woken and to win the GIL from the engine thread, and copying it costs
    less than that hand-over. Serially the drafter sends nothing while a target call runs (every
    reply the Coordinator asked of the previous execution was read; a reply-less call's error is
    a few hundred bytes), so such a send cannot wait on it; it waits at most
    `_DELIVERY_TIMEOUT_S` for a drafter that stopped reading. Overlapped, every delivery takes
    the thread: the engine thread goes on to read the drafter's replies at once, so a drafter
    blocked sending a large draft never waits on a delivery stuck behind it in a full socket.
    The graph's results need no reply to wait for: `run` returns the call's outcome."""

    INLINE_DELIVERY_BYTES = 1 << 20
    """The largest serial delivery the engine thread sends itself: well inside the socket's
    buffer, and where `placement.features: auto` switches to CUDA IPC handles on one GPU (the
    bundled pair's verify at batch 64 is ~350 KiB; a long prompt's features, or a large model's
    batch through host memory, go by the thread)."""

    def __init__(self, run_call: RunTargetCall, overlap: bool) -> None:
        self._run_call = run_call
        self.overlap = overlap
        self._drafter: socket.socket | None = None
        self._outbox: queue.SimpleQueue[list[memoryview] | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._drafter_left = threading.Event()
        # Deliveries handed to the sender thread and not yet sent: none, and the caller may send.
        self._queued = 0
        self._queued_lock = threading.Lock()

    def connect(self, drafter_address: ChannelAddress) -> None:
        self.close()
        self._drafter = connect(drafter_address, _ROLE_TARGET)
        self._drafter.settimeout(_DELIVERY_TIMEOUT_S)  # a hung drafter never holds a sender
        self._outbox, self._drafter_left = queue.SimpleQueue(), threading.Event()
        self._queued = 0
        self._sender = threading.Thread(
            target=self._send_all, args=(self._drafter, self._outbox), name="step-deliveries", daemon=True
        )
        self._sender.start()

    @property
    def connected(self) -> bool:
        """The drafter connection is up: deliveries still go out."""
        return self._drafter is not None and not self._drafter_left.is_set()

    def run(self, execution: int, call: TargetCall) -> tuple[bool, Any]:
        """Run `call` and send or queue its features, or its error, for the drafter -> (ok, output
        or error). A drafter that left gets no more; the Coordinator's own connection to it says so."""
        connected = self.connected
        outcome, sent = _run_target_call(self._run_call, execution, call, connected)
        if connected and self._drafter is not None:
            self._deliver(self._drafter, encode_message(sent))
        return outcome

    def _deliver(self, sock: socket.socket, parts: list[memoryview]) -> None:
        with self._queued_lock:  # only this thread adds: none queued stays none until it does
            inline = (
                not self.overlap
                and self._queued == 0
                and sum(part.nbytes for part in parts) <= self.INLINE_DELIVERY_BYTES
            )
            if not inline:
                self._queued += 1
                self._outbox.put(parts)
        if inline:
            self._send_or_leave(sock, parts)

    def _send_all(self, sock: socket.socket, outbox: "queue.SimpleQueue[list[memoryview] | None]") -> None:
        while (parts := outbox.get()) is not None:
            if not self._send_or_leave(sock, parts):
                return
            with self._queued_lock:
                self._queued -= 1

    def _send_or_leave(self, sock: socket.socket, parts: list[memoryview]) -> bool:
        """Send one delivery; False when the drafter is gone or stopped reading: a part sent must
        not read as a message, so the connection is shut."""
        try:
            send_parts(sock, parts)
        except OSError:
            self._drafter_left.set()
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            return False
        return True

    def close(self) -> None:
        """Stop the sender (after what it has queued, or at once if the drafter stopped reading)
        and close the connection."""
        if self._drafter is None:
            return
        sender, sock = self._sender, self._drafter
        self._outbox.put(None)
        if sender is not None:
            sender.join(timeout=_CLOSE_WAIT_S)
        with contextlib.suppress(OSError):  # unblocks a sender stuck in a full socket
            sock.shutdown(socket.SHUT_RDWR)
        if sender is not None:
            sender.join()
        sock.close()
        self._drafter = self._sender = None


@dataclass
class _DrafterMessage:
    seq: int
    execution: int
    call: DrafterCall | None
    takes_delivery: bool  # the execution has a target call whose delivery this takes
    wants_reply: bool
    drafted: bool = False  # overlap shape: its draft ran, its delivery is still to take


class DrafterChannelServer(_ChannelServer):
    """The drafter's end: the Coordinator's messages in order, each with its execution's
    delivery from the target when it has one.

    Serial shape: `take_context(delivery, call)` (keep the features, then draft); overlapped
    shape: `draft(call)` at once, then `take_context(delivery, None)`, as the two graphs bind them."""

    def __init__(
        self,
        draft: Callable[[DrafterCall | None], Any],
        take_context: Callable[[ContextDelivery | None, DrafterCall | None], Any],
        lock: threading.Lock,
        overlap: bool,
    ) -> None:
        super().__init__(lock)
        self._draft = draft
        self._take_context = take_context
        self._overlap = overlap
        self._queue: collections.deque[_DrafterMessage] = collections.deque()
        self._deliveries: dict[int, tuple[bool, Any]] = {}
        self._coordinator: socket.socket | None = None
        self._thread.start()

    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        for listening in self._listener.sockets:
            selector.register(listening, selectors.EVENT_READ, None)
        while True:
            for key, _ in selector.select():
                if key.data is None:
                    accepted = self._listener.accept(key.fileobj)  # type: ignore[arg-type]
                    if accepted is not None:
                        self._peers.append(accepted[0])
                        selector.register(accepted[0], selectors.EVENT_READ, accepted[1])
                        if accepted[1] == _ROLE_COORDINATOR:
                            self._coordinator = accepted[0]
                elif key.data == _ROLE_COORDINATOR:
                    seq, execution, call, takes_delivery, wants_reply = recv_message(key.fileobj)  # type: ignore[arg-type]
                    self._queue.append(_DrafterMessage(seq, execution, call, takes_delivery, wants_reply))
                else:
                    try:
                        execution, ok, value = recv_message(key.fileobj)  # type: ignore[arg-type]
                    except (OSError, EOFError):  # the target left: the Coordinator sees it too
                        selector.unregister(key.fileobj)
                        continue
                    self._deliveries[execution] = (ok, value)
            while self._queue and self._run_head():
                self._queue.popleft()

    def _run_head(self) -> bool:
        """Run what the first message can run now; True once it is done."""
        message = self._queue[0]
        with self._lock:
            if self._closed:
                raise EOFError("closed")
            if self._overlap and not message.drafted:
                message.drafted = True
                self._reply(message, message.wants_reply, lambda: self._draft(message.call))
            if message.takes_delivery and message.execution not in self._deliveries:
                return False
            ok, delivery = self._deliveries.pop(message.execution) if message.takes_delivery else (True, None)
            if self._overlap:
                if ok and message.takes_delivery:
                    self._reply(message, False, lambda: self._take_context(delivery, None))
            elif not ok:  # the target call failed: so does the drafter's node after it
                if message.wants_reply:
                    send_message(self._require_coordinator(), (message.seq, False, delivery))
            else:
                self._reply(message, message.wants_reply, lambda: self._take_context(delivery, message.call))
        return True

    def _reply(self, message: _DrafterMessage, wants_reply: bool, run: Callable[[], Any]) -> None:
        """Run a node; send its result when the Coordinator waits for it, its error either way
        (a call without a reply reports its error with the Coordinator's next wait)."""
        try:
            result: tuple[bool, Any] = (True, run())
        except Exception as error:
            result = (False, _sendable(error))
        if wants_reply:
            send_message(self._require_coordinator(), (message.seq, *result))
        elif not result[0]:
            send_message(self._require_coordinator(), (None, *result))

    def _require_coordinator(self) -> socket.socket:
        if self._coordinator is None:
            raise EOFError("no Coordinator connection")
        return self._coordinator


# ---------------------------------------------------------------------------- Coordinator


class _Connection:
    """The Coordinator's connection to one worker: replies by sequence number, as they come."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.socket = sock
        self.name = name
        self.replies: dict[int, tuple[bool, Any]] = {}
        self.deferred_error: Exception | None = None  # a reply-less call's error, for the next wait
        self.lost: Exception | None = None
        self._seqs = itertools.count()

    def send(self, value: tuple[Any, ...]) -> int:
        """Send (seq, *value); the seq of its reply."""
        seq = next(self._seqs)
        if self.lost is not None:
            raise StepChannelError(f"the {self.name}'s step connection is gone") from self.lost
        try:
            send_message(self.socket, (seq, *value))
        except OSError as error:
            self.lost = error
            raise StepChannelError(f"the {self.name}'s step connection is gone ({error!r})") from error
        return seq


class _Reply:
    """One reply to come: `get` waits for it (the ObjectRef of a compiled graph's output)."""

    def __init__(self, graph: "SocketGraph", connection: _Connection, seq: int) -> None:
        self._graph = graph
        self._connection = connection
        self._seq = seq

    def get(self, timeout: float) -> Any:
        return self._graph.wait(self._connection, self._seq, timeout)


class _Done:
    """A node that already ran (the target in the Coordinator's process): its outcome."""

    def __init__(self, ok: bool, value: Any) -> None:
        self._ok = ok
        self._value = value

    def get(self, timeout: float) -> Any:
        if not self._ok:
            raise self._value
        return self._value


class _NoReply:
    """A node that gives nothing back (a call the Coordinator does not wait for)."""

    def get(self, timeout: float) -> Any:
        return None


_NONE = _NoReply()


class SocketGraph:
    """The Coordinator's side: `execute` and `teardown`, as a compiled graph offers them."""

    def __init__(self, target: Any, drafter_actor: Any, overlap: bool) -> None:
        """`target`: the target actor, or the `LocalTargetEnd` of a target in this process."""
        self._overlap = overlap
        drafter_address = ray.get(drafter_actor.open_step_channel.remote(overlap))
        self._drafter = _Connection(connect(drafter_address, _ROLE_COORDINATOR), "drafter")
        self._local_target: LocalTargetEnd | None = None
        self._target: _Connection | None = None
        if isinstance(target, LocalTargetEnd):
            if target.overlap != overlap:  # a serial end's inline sends would deadlock overlapped
                raise ValueError("the local target end's shape differs from the graph's")
            target.connect(drafter_address)
            self._local_target = target
            self._actors: tuple[Any, ...] = (drafter_actor,)
        else:
            target_address = ray.get(target.open_step_channel.remote(drafter_address))
            self._target = _Connection(connect(target_address, _ROLE_COORDINATOR), "target")
            self._actors = (target, drafter_actor)
        self._connections = tuple(c for c in (self._target, self._drafter) if c is not None)
        self._selector = selectors.DefaultSelector()
        for connection in self._connections:
            self._selector.register(connection.socket, selectors.EVENT_READ, connection)
        self._executions = itertools.count()

    def execute(self, drafter_call: DrafterCall | None, target_call: TargetCall | None) -> tuple[Any, ...]:
        """Send one execution; its outputs' replies as the compiled graph orders them: serial
        (target output, drafter node), overlapped (draft, target output, after-delivery node)."""
        execution = next(self._executions)
        target_reply: Any = _NONE
        if target_call is not None and self._target is not None:
            target_reply = _Reply(self, self._target, self._target.send((execution, target_call)))
        drafter_reply: Any = _NONE
        if drafter_call is not None or target_call is not None:
            wants_reply = drafter_call is not None and drafter_call.inputs is not None
            seq = self._drafter.send((execution, drafter_call, target_call is not None, wants_reply))
            if wants_reply:
                drafter_reply = _Reply(self, self._drafter, seq)
        if target_call is not None and self._local_target is not None:
            # After the drafter's message: an overlapped draft runs there while the target works here.
            target_reply = _Done(*self._local_target.run(execution, target_call))
        if self._overlap:
            return drafter_reply, target_reply, _NONE
        return target_reply, drafter_reply

    def wait(self, connection: _Connection, seq: int, timeout: float) -> Any:
        """Read both connections until `connection`'s reply `seq` is in; its value or error."""
        deadline = time.monotonic() + timeout
        while seq not in connection.replies:
            if connection.lost is not None:
                gone = f"the {connection.name}'s step connection is gone"
                raise StepChannelError(gone) from connection.lost
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StepChannelError(f"no reply from the {connection.name} within {timeout:g} s")
            for key, _ in self._selector.select(remaining):
                self._read(key.data)
        if connection.deferred_error is not None:
            error, connection.deferred_error = connection.deferred_error, None
            raise error
        ok, value = connection.replies.pop(seq)
        if not ok:
            raise value
        return value

    def _read(self, connection: _Connection) -> None:
        try:
            seq, ok, value = recv_message(connection.socket)
        except (OSError, EOFError) as error:
            connection.lost = error
            self._selector.unregister(connection.socket)
            return
        if seq is None:
            connection.deferred_error = value
        else:
            connection.replies[seq] = (ok, value)

    def teardown(self) -> None:
        """Close both workers' ends (each after its call in progress), then ours."""
        closing = [actor.close_step_channel.remote() for actor in self._actors]
        for ref in closing:
            try:
                ray.get(ref, timeout=30.0)
            except Exception:  # a dead worker's end closed with it
                logger.debug("close_step_channel failed", exc_info=True)
        self._selector.close()
        for connection in self._connections:
            connection.socket.close()
        if self._local_target is not None:
            self._local_target.close()
