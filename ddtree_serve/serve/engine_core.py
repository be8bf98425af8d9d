"""The engine loop in a process of its own (`placement.workers: engine_core`), vLLM's engine core.

With the target inside the Coordinator replica the engine thread shares its process, and so its
GIL, with Serve's work for every stream: on one H200 at concurrency 64 the served engine's step
took twice the in-process one (32 against 15 ms) where the split itself costs 3 ms a step, and
the replica's event loop and Ray's chunk serializer held half of the GIL's time (README,
Benchmarks). Here an `EngineCore` actor in the target's bundle holds the target model, the
`ObservedEngine` and its loop, and reaches the drafter actor over the socket step graph as the
Coordinator would; the Coordinator keeps Serve's side and an `EngineCoreClient`, an `AsyncLLM`
whose engine is across one socket. With `placement.workers: engine_core_colocated` the drafter
model loads in the core as well (vLLM's layout) and a step has no hop at all. The socket:

    Coordinator -> core: ("add", request id, prompt token ids, params), ("abort", request id),
                         ("shutdown",)
    core -> Coordinator: ("added", request id, the add's error or None, requests waiting), and
                         per step (and per prefill's first tokens) ("step", output deltas,
                         step record, stats)

An output delta is a request's new tokens since its last one; the client keeps each request's
token list and rebuilds the `RequestOutput`s, then hands the step record (phases, tokens per
request, the budget's choice) to the group's telemetry and load as an engine in this process
would, so metrics, request spans and their phase spans are the Coordinator's as before.

A lost drafter actor is handled inside the core as in the other placements (a colocated drafter
dies with its core). A core that dies (its
target) ends the engine: the requests in flight end retriable and the replica fails its health
check, so Serve replaces the group (no restart in place).
"""

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from tokenizers import Tokenizer

from ddtree_serve.engine.async_llm import AsyncLLM, EngineDeadError, _Abort, _Add, _dead
from ddtree_serve.engine.interfaces import TargetUnavailableError
from ddtree_serve.engine.request import RequestOutput, RequestStats
from ddtree_serve.engine.scheduler import QueueFullError
from ddtree_serve.engine.settings import EngineSettings
from ddtree_serve.serve.observed_engine import StepObserver, StepRecord, group_engine
from ddtree_serve.serve.step_sockets import (
    _ROLE_COORDINATOR,
    ChannelAddress,
    _Listener,
    connect,
    recv_message,
    send_message,
)

logger = logging.getLogger(__name__)

OutputDelta = tuple[str, list[int], int, bool, str | None, int | None, RequestStats]
"""(request id, new token ids, tokens so far, finished, finish reason, stop text offset, stats)."""


@dataclass(frozen=True)
class CoreInfo:
    """What the client reads of the core's engine once, at connection."""

    block_size: int
    vocab_size: int
    max_seq_len: int
    max_tree_tokens: int
    max_prompt_tokens: int


class EngineCore:
    """The actor: the target, the engine and its loop, served to one client over a socket."""

    def __init__(self, config: Any, drafter_actor: Any, target_factory: Any, drafter_factory: Any) -> None:
        """The factories build the models here (`group.model_factories`); `drafter_actor` None:
        the drafter model loads here too (`engine_core_colocated`; none in mode "ar")."""
        from ddtree_serve.engine.builder import target_dir
        from ddtree_serve.models import load_tokenizer
        from ddtree_serve.serve.group import local_models, local_target_workers

        if drafter_actor is not None:
            target, drafter = local_target_workers(config, target_factory, drafter_actor)
        else:
            target, drafter = local_models(target_factory, drafter_factory)
        self._record: StepRecord | None = None  # the step's, as the engine reported it
        tokenizer = load_tokenizer(target_dir(config.engine))
        self.engine = group_engine(config, target, drafter, tokenizer, self._keep_record)
        self._listener = _Listener()
        self._sent_tokens: dict[str, int] = {}
        self._error: BaseException | None = None
        self._num_steps = 0
        self._step_seconds = 0.0
        self._thread = threading.Thread(target=self._serve, name="ddtree-engine-core", daemon=True)
        self._thread.start()

    def _keep_record(self, record: StepRecord) -> None:
        self._record = record

    def address(self) -> ChannelAddress:
        return self._listener.address

    def info(self) -> CoreInfo:
        engine = self.engine
        return CoreInfo(
            engine.block_size,
            engine.vocab_size,
            engine.max_seq_len,
            engine.max_tree_tokens,
            engine.max_prompt_tokens,
        )

    def check_alive(self) -> None:
        """Raises when the loop has stopped (a step failed)."""
        if self._error is not None or not self._thread.is_alive():
            raise RuntimeError(f"the engine core stopped: {self._error!r}")

    # ------------------------------------------------------------------------- the loop

    def _serve(self) -> None:
        client = None
        while client is None:
            accepted = self._listener.accept_any()
            if accepted is not None and accepted[1] == _ROLE_COORDINATOR:
                client = accepted[0]
        self.engine.on_first_tokens = lambda outputs: self._send_step(client, outputs, None)
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                for command in self._commands(client, block=idle):
                    if command[0] == "shutdown":
                        return
                    self._apply(client, command)
                if self.engine.has_unfinished_requests() and not self._step(client):
                    return
        except (OSError, EOFError):
            logger.warning("the engine core's client left; the loop ends")
        finally:
            client.close()

    def _step(self, client: socket.socket) -> bool:
        """One engine step and its message; False when the step failed (the core is dead: the
        client is told why, its requests end retriable and the replica is replaced)."""
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except BaseException as error:
            logger.exception("engine core step failed")
            self._error = error
            with contextlib.suppress(OSError):
                send_message(client, ("dead", f"{type(error).__name__}: {error}"))
            return False
        self._step_seconds += time.perf_counter() - started
        self._num_steps += 1
        record, self._record = self._record, None
        self._send_step(client, outputs, record)
        return True

    @staticmethod
    def _commands(client: socket.socket, block: bool) -> list[tuple[Any, ...]]:
        commands = []
        while select.select([client], [], [], None if block and not commands else 0.0)[0]:
            commands.append(recv_message(client))
        return commands

    def _apply(self, client: socket.socket, command: tuple[Any, ...]) -> None:
        if command[0] == "abort":
            self.engine.abort_request(command[1])
            return
        _, request_id, prompt, params = command
        error: Exception | None = None
        try:
            self.engine.add_request(request_id, prompt, params)
            self._sent_tokens[request_id] = 0
        except (ValueError, QueueFullError) as refused:
            error = refused
        # The queue as it stands now: the client's queue limit counts this request from here on.
        send_message(client, ("added", request_id, error, self.engine.num_waiting))

    def _send_step(
        self, client: socket.socket, outputs: Sequence[RequestOutput], record: StepRecord | None
    ) -> None:
        deltas: list[OutputDelta] = []
        for output in outputs:
            sent = self._sent_tokens.get(output.request_id, 0)
            deltas.append(
                (
                    output.request_id,
                    output.token_ids_from(sent),
                    output.num_tokens,
                    output.finished,
                    output.finish_reason,
                    output.stop_text_offset,
                    output.stats,
                )
            )
            if output.finished:
                self._sent_tokens.pop(output.request_id, None)
            else:
                self._sent_tokens[output.request_id] = output.num_tokens
        lite = None
        if record is not None:
            lite = (record.index, record.intervals_ns, dict(record.num_step_tokens), record.budget)
        engine = self.engine
        stats = (
            engine.num_running,
            engine.num_waiting,
            engine.speculating,
            engine.num_drafter_losses,
            self._num_steps,
            self._step_seconds,
        )
        send_message(client, ("step", deltas, lite, stats))


class EngineCoreTarget:
    """What the Coordinator's health check asks of the engine's target: the core's liveness."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def check_alive(self) -> None:
        try:
            await self.actor.check_alive.remote()
        except Exception as error:
            raise TargetUnavailableError(f"the engine core is gone: {error!r}") from error


class EngineView:
    """The client's stand-in for the engine the Coordinator reads: fixed figures from the core,
    load figures as of its last step message."""

    def __init__(self, info: CoreInfo, settings: EngineSettings, tokenizer: Tokenizer, target: Any) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.target = target
        self.block_size = info.block_size
        self.vocab_size = info.vocab_size
        self.max_seq_len = info.max_seq_len
        self.max_tree_tokens = info.max_tree_tokens
        self.max_prompt_tokens = info.max_prompt_tokens
        self.budget_policy = None
        self.on_first_tokens: Callable[[list[RequestOutput]], None] | None = None
        self.num_running = 0
        self.num_waiting = 0
        self.speculating = True
        self.num_drafter_losses = 0


class EngineCoreClient(AsyncLLM):
    """`AsyncLLM` over an `EngineCore`: commands go over its socket, each step's outputs come back
    on a receiver thread, which hands them to the streams and the step to `observer`."""

    def __init__(self, actor: Any, address: ChannelAddress, view: EngineView, observer: StepObserver) -> None:
        self.actor = actor
        self._observer = observer
        self._socket = connect(address, _ROLE_COORDINATOR)
        self._send_lock = threading.Lock()
        self._tokens: dict[str, list[int]] = {}
        self._closing = False  # a shutdown asked for: the core's end is no loss
        super().__init__(view)  # type: ignore[arg-type]

    def _submit(self, command: object) -> None:
        if isinstance(command, _Add):
            prompt = command.prompt
            if isinstance(prompt, str):
                prompt = self.tokenizer.encode(prompt).ids
            message: tuple[Any, ...] = ("add", command.request_id, list(prompt), command.params)
        elif isinstance(command, _Abort):
            message = ("abort", command.request_id)
        else:
            message = ("shutdown",)
        try:
            with self._send_lock:
                send_message(self._socket, message)
        except OSError:
            if isinstance(command, _Add):  # the receiver fails the stream with the core's end
                with self._streams_lock:
                    self._num_pending_adds -= 1

    def _run(self) -> None:
        view: EngineView = self.engine  # type: ignore[assignment]
        try:
            while True:
                message = recv_message(self._socket)
                kind = message[0]
                if kind == "added":
                    _, request_id, error, num_waiting = message
                    if error is not None:
                        self._deliver(request_id, error)
                    else:
                        self._tokens[request_id] = []
                    with self._streams_lock:
                        view.num_waiting = num_waiting  # before the pending add leaves the count
                        self._num_pending_adds -= 1
                elif kind == "step":
                    _, deltas, lite, stats = message
                    outputs = [self._output(delta) for delta in deltas]
                    (
                        view.num_running,
                        view.num_waiting,
                        view.speculating,
                        view.num_drafter_losses,
                        self.num_steps,
                        self.step_seconds,
                    ) = stats
                    if lite is not None:  # before the outputs, as in process: a finished
                        # request's span is still open for its last step's phases
                        index, intervals_ns, num_step_tokens, budget = lite
                        self._observer(StepRecord(index, intervals_ns, outputs, num_step_tokens, budget))
                    self._dispatch(outputs)
                else:
                    lost = TargetUnavailableError(f"the engine core stopped: {message[1]}")
                    raise EngineDeadError(repr(lost), lost)
        except (OSError, EOFError) as error:
            if self._closing:
                self._fail_streams(EngineDeadError("the engine was shut down"))
                return
            lost = TargetUnavailableError(f"the engine core is gone ({error!r})")
            logger.error("%s; failing every open request", lost)
            self._fail_streams(EngineDeadError(repr(lost), lost))
        except BaseException as error:
            self._fail_streams(_dead(error))

    def _output(self, delta: OutputDelta) -> RequestOutput:
        request_id, new_tokens, num_tokens, finished, reason, stop_offset, stats = delta
        tokens = self._tokens.setdefault(request_id, [])
        tokens.extend(new_tokens)
        if finished:
            self._tokens.pop(request_id, None)
        return RequestOutput(
            request_id, tokens, num_tokens, len(new_tokens), finished, reason, stop_offset, stats
        )

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        super().shutdown(timeout_s)
        with contextlib.suppress(OSError):  # wakes a receiver still waiting on a core that hangs
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        ray.kill(self.actor)
