"""`AsyncLLM`: an asyncio streaming client over a `SpecEngine` stepped by a background thread.

The server's coordinator holds one of these. Callers on an event loop add requests and read
their outputs as async streams; one thread owns the engine (it is not thread-safe), applies
queued adds and aborts between steps, and hands each step's outputs back to the callers' loops.
The engine it drives may sit on in-process models or on Ray actor proxies: nothing here knows.
"""

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from ddtree_serve.engine.interfaces import TargetUnavailableError
from ddtree_serve.engine.outputs import CompletionOutput, Detokenizer
from ddtree_serve.engine.request import RequestOutput
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.scheduler import QueueFullError
from ddtree_serve.engine.spec_engine import SpecEngine

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or a step raised); no request can run.

    `cause` is what a step raised (None: shut down), so a server can tell a lost model
    (`TargetUnavailableError`: retriable elsewhere) from a bug."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams


@dataclass(frozen=True)
class _Abort:
    request_id: str


_SHUTDOWN = object()


class _Stream:
    """Where one request's outputs (or its error) go: a queue on the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self._not_before = 0.0  # the loop's clock: outputs pushed before it wait for its timer

    def put(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe: deliver on the caller's loop."""
        self.loop.call_soon_threadsafe(self.push, item)

    def push(self, item: RequestOutput | BaseException) -> None:
        """On the caller's loop only. A stream holding its outputs back is not woken for one that
        can wait (its timer wakes it): at c = 64 with a 50 ms interval every step had woken every
        stream only for it to go back to sleep, 64 wake-ups a step on the loop beside the engine."""
        self._items.append(item)
        if _is_final(item) or self.loop.time() >= self._not_before:
            self._ready.set()

    async def next(self, not_before: float = 0.0) -> RequestOutput | BaseException:
        """The next output or error. Outputs are cumulative: when the caller fell behind (a
        slow client, a busy loop), the newest of those queued stands for them all, one chunk
        instead of several; an error still comes after the outputs before it.

        `not_before` (the loop's clock): hold outputs back until then, so a stream sends at
        most one chunk per interval (Ray Serve LLM's `stream_batching_interval_ms`); a
        finished output or an error is not held back."""
        self._not_before = not_before
        while not self._items or (self.loop.time() < not_before and not _is_final(self._items[-1])):
            self._ready.clear()
            if not self._items and self.loop.time() >= not_before:
                await self._ready.wait()
                continue
            # A timer sets the event at `not_before` (no task per wait, as `wait_for` makes):
            # the loop's condition then lets the held outputs go.
            timer = self.loop.call_at(not_before, self._ready.set)
            try:
                await self._ready.wait()
            finally:
                timer.cancel()
        item = self._items.popleft()
        while isinstance(item, RequestOutput) and not item.finished and self._items:
            if isinstance(self._items[0], BaseException):
                break
            item = self._items.popleft()
        return item


def _is_final(item: RequestOutput | BaseException) -> bool:
    """An error or a finished output: never held back."""
    return isinstance(item, BaseException) or item.finished


class AsyncLLM:
    """Streams speculative decoding outputs to asyncio callers; one engine thread per instance."""

    def __init__(self, engine: SpecEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_queue_len = engine.settings.max_queue_len
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._num_pending_adds = 0  # adds sent to the thread and not yet applied (under the lock)
        self._error: BaseException | None = None
        # Steps the thread ran and their wall time (the first tokens' hand-over, made within the
        # step, included; the others' not), written by the thread only: a server's engine step
        # against the same engine's in process.
        self.num_steps = 0
        self.step_seconds = 0.0
        # A stream's first token goes out when its prefill is done, not after the step's
        # draft and verify: time to first token is the prefill's.
        engine.on_first_tokens = self._dispatch
        self._thread = threading.Thread(target=self._run, name="ddtree-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------- caller side

    async def generate_stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        interval_s: float = 0.0,
    ) -> AsyncIterator[CompletionOutput]:
        """Yield the request's output after every step that changed it; the last is finished.

        `interval_s` > 0: at most one output per interval after the first (each holds every
        token since the previous one); the finished output comes as soon as it is ready.

        On first iteration it raises `QueueFullError` when `max_queue_len` requests already wait
        and ValueError for an invalid request; `EngineDeadError` whenever the engine stops.
        Leaving the iteration early (break, cancellation, disconnect) aborts the request.
        """
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        stream = self._open_stream(request_id)
        self._submit(_Add(request_id, prompt, params))
        detokenizer = Detokenizer(self.tokenizer, params.stop)
        finished = False
        try:
            not_before = 0.0
            while not finished:
                item = await stream.next(not_before)
                if interval_s > 0:
                    not_before = stream.loop.time() + interval_s
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield detokenizer.update(item)
        finally:
            self._close_stream(request_id)
            if not finished:
                self.abort(request_id)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> CompletionOutput:
        """The final output of one request."""
        final: CompletionOutput | None = None
        async for output in self.generate_stream(prompt, params, request_id):
            final = output
        assert final is not None, "a stream ends with a finished output"
        return final

    def abort(self, request_id: str) -> None:
        """Stop a request between steps; harmless if it already finished."""
        self._submit(_Abort(request_id))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread after the current step; open streams get `EngineDeadError`."""
        self._submit(_SHUTDOWN)
        self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def stopped(self) -> bool:
        """The engine thread has ended: nothing of this engine calls the workers any more."""
        return not self._thread.is_alive()

    @property
    def num_active_requests(self) -> int:
        """Requests with an open stream (waiting or running)."""
        return len(self._streams)

    def _open_stream(self, request_id: str) -> _Stream:
        with self._streams_lock:
            # Checked under the lock the dying thread takes to fail open streams: a stream
            # registered after that would wait forever.
            if self._error is not None or not self._thread.is_alive():
                raise EngineDeadError(f"the engine is not running: {self._error!r}", _cause(self._error))
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            # engine.num_waiting is read across threads: a slightly stale count is fine for a limit.
            if self._num_pending_adds + self.engine.num_waiting >= self.max_queue_len:
                raise QueueFullError(f"request queue is full ({self.max_queue_len} waiting); retry later")
            stream = _Stream(asyncio.get_running_loop())
            self._streams[request_id] = stream
            self._num_pending_adds += 1
        return stream

    def _close_stream(self, request_id: str) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)

    # ----------------------------------------------------------------------------- engine thread

    def _submit(self, command: object) -> None:
        """An add, an abort or the shutdown, for the engine thread to apply between steps."""
        self._commands.put(command)

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                commands = self._drain_commands(block=idle)
                if any(c is _SHUTDOWN for c in commands):
                    raise EngineDeadError("the engine was shut down")
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    started = time.perf_counter()
                    outputs = self.engine.step()
                    self.step_seconds += time.perf_counter() - started
                    self.num_steps += 1
                    self._dispatch(outputs)
        except BaseException as error:  # every open stream must learn why it ends
            if isinstance(error, TargetUnavailableError):
                logger.error("engine stopped: %s; failing every open request", error)
            elif not isinstance(error, EngineDeadError):
                logger.exception("engine step failed; failing every open request")
            self._fail_streams(_dead(error))

    def _fail_streams(self, error: EngineDeadError) -> None:
        """The engine has stopped: no stream opens again, and every open one ends with `error`."""
        with self._streams_lock:
            self._error = error
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(error)

    def _drain_commands(self, block: bool) -> list[object]:
        commands: list[object] = []
        if block:
            commands.append(self._commands.get())
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: object) -> None:
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            return
        assert isinstance(command, _Add)
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params)
        except (ValueError, QueueFullError) as error:
            self._deliver(command.request_id, error)
        finally:
            # After the add, so the queue limit never sees the request in neither count.
            with self._streams_lock:
                self._num_pending_adds -= 1

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, one hand-over per event loop (not one per request): at batch 64 the
        per-output `call_soon_threadsafe` (a lock and a wake-up write each) was the engine
        thread's time, and each wake-up the loop's."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._streams_lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, deliveries in by_loop.items():
            loop.call_soon_threadsafe(_push_all, deliveries)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(item)


def _push_all(deliveries: list[tuple["_Stream", RequestOutput]]) -> None:
    """On the streams' loop: each output onto its stream, in the step's order."""
    for stream, output in deliveries:
        stream.push(output)


def _dead(error: BaseException) -> "EngineDeadError":
    """`error` as what the streams get: itself when it says the engine is dead, else wrapped."""
    return error if isinstance(error, EngineDeadError) else EngineDeadError(repr(error), error)


def _cause(error: BaseException | None) -> BaseException | None:
    """What stopped the engine: a step's exception; None when it was shut down."""
    return error.cause if isinstance(error, EngineDeadError) else error
