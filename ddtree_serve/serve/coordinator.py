"""The Coordinator deployment: one replica = one speculation group, a thin server over its engine.

As Ray Serve LLM's `LLMServer` is over its engine, the Coordinator is over an `AsyncLLM` (the
engine thread and its request streams): it checks the prompt against the engine's own limit,
streams each request's steps as chunks and turns engine errors into request errors. Serve
constructs it through `__init__`, which starts the group's workers (`group.py`), the step
observer's telemetry (`telemetry.py`) and the engine; tests hand `sync_init` an engine they built.

Faults: a lost drafter is the engine's business (it decodes plainly until Ray restarted the
drafter). A lost target ends the engine: requests in flight and new ones get UNAVAILABLE
(503 + Retry-After) and the health endpoints (`stats`) fail at once. Ray restarts a lone
target actor in its bundle; the `EngineSupervisor` (`supervisor.py`) waits for it and starts a
new engine over the same actors, while Serve's own check (`check_health`) passes, so the same
replica serves again. A target that stays dead (past its restarts, or not back within the
bound), or a tensor-parallel group, fails `check_health` and Serve replaces the whole group.
"""

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import ray

from ddtree_serve.engine.async_llm import AsyncLLM, EngineDeadError
from ddtree_serve.engine.budget import AdaptiveBudget
from ddtree_serve.engine.builder import target_dir
from ddtree_serve.engine.interfaces import Drafter, Target, TargetUnavailableError
from ddtree_serve.engine.request import RequestStats
from ddtree_serve.engine.scheduler import QueueFullError
from ddtree_serve.models import load_tokenizer
from ddtree_serve.serve.autoscaling import serve_autoscaling_config
from ddtree_serve.serve.chat import target_has_vision_tower
from ddtree_serve.serve.compiled_graph import GraphDrafter, GraphTarget
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.engine_core import EngineCoreClient, EngineCoreTarget, EngineView
from ddtree_serve.serve.errors import ErrorKind, RequestError, invalid
from ddtree_serve.serve.group import (
    placement_bundles,
    reconnect_workers,
    restarts_target_in_place,
    start_engine_core,
    start_workers,
)
from ddtree_serve.serve.load import GroupLoad
from ddtree_serve.serve.observed_engine import StepObserver, StepRecord, group_engine
from ddtree_serve.serve.protocol import GenerationChunk, GenerationRequest, Usage
from ddtree_serve.serve.refusal_log import install_refusal_log_filter
from ddtree_serve.serve.supervisor import EngineSupervisor
from ddtree_serve.serve.target_group import RayTargetGroup
from ddtree_serve.serve.telemetry import GroupTelemetry
from ddtree_serve.serve.workers import DrafterFactory, RayDrafter, RayTarget, TargetFactory

logger = logging.getLogger("ray.serve")

# Serve-level headroom above the engine's own limit, so the engine (not Serve's queue) refuses
# the request that overflows and the caller gets 503 / RESOURCE_EXHAUSTED at once.
_ONGOING_HEADROOM = 4

# What the engine raises for a request it refuses or can no longer run; see `_request_error`.
_ENGINE_ERRORS = (QueueFullError, ValueError, EngineDeadError)

# Serve's health check of each replica: twice a second, so a group whose target died (its check
# fails from then on) is replaced after Serve's three failures in a row, within 1.5 s; the
# timeout is generous because the check waits behind the target's step in progress.
_HEALTH_CHECK_PERIOD_S = 0.5
_HEALTH_CHECK_TIMEOUT_S = 10.0
# A stopping replica checks for open requests this often (Serve's default, 2 s, would hold a
# dead group's bundles that long after its requests ended); the timeout stays Serve's default.
_GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.2


class Coordinator:
    """Runs the speculative decoding loop of one group and streams each request's steps."""

    @classmethod
    def get_deployment_options(cls, config: ServeConfig) -> dict[str, Any]:
        """Serve deployment options: the group's placement bundles, replica count, limits."""
        placement = config.placement
        scaling = config.autoscaling
        resources = placement.coordinator_resources()  # with the target's, when it runs here
        options: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": resources.num_cpus, "resources": dict(resources.resources)},
            "placement_group_bundles": placement_bundles(config),
            "placement_group_strategy": placement.strategy,
            "max_ongoing_requests": config.max_ongoing_per_group + _ONGOING_HEADROOM,
            "health_check_period_s": _HEALTH_CHECK_PERIOD_S,
            "health_check_timeout_s": _HEALTH_CHECK_TIMEOUT_S,
            "graceful_shutdown_wait_loop_s": _GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
        }
        if resources.num_gpus > 0:
            options["ray_actor_options"]["num_gpus"] = resources.num_gpus
        if scaling.min_replicas == scaling.max_replicas:
            options["num_replicas"] = scaling.min_replicas
        else:
            options["autoscaling_config"] = serve_autoscaling_config(scaling)
        return options

    def __init__(
        self,
        config: ServeConfig,
        target_factory: TargetFactory | None = None,
        drafter_factory: DrafterFactory | None = None,
    ) -> None:
        """Serve's constructor: starts the group's workers and the engine thread over them.

        `target_factory` / `drafter_factory` build the in-process models inside the workers;
        None = load `config.engine`'s model directories (tests inject fakes here).
        """
        start_s = time.monotonic()
        load = GroupLoad(config.engine.max_num_seqs)
        self._tokenizer = load_tokenizer(target_dir(config.engine))
        if config.placement.workers in ("engine_core", "engine_core_colocated"):
            llm, telemetry, actors = self._start_engine_core(config, load, target_factory, drafter_factory)
            self._init_shared(config, llm, telemetry, load, restart=None)
            self._actors = actors
            logger.info("speculation group up: engine core started in %.1f s", time.monotonic() - start_s)
            return
        target, drafter = start_workers(config, target_factory, drafter_factory)
        telemetry = GroupTelemetry(
            config.observability, drafter.block_size if drafter else 1, config.engine.budget
        )
        llm = self._start_engine(config, target, drafter, telemetry, load)
        restart = self._restart_engine if restarts_target_in_place(config) else None
        self._init_shared(config, llm, telemetry, load, restart)
        self._actors = {
            role: worker.actor
            for role, worker in (("target", target), ("drafter", drafter))
            if isinstance(worker, RayTarget | RayDrafter | GraphTarget | GraphDrafter)
            and worker.actor is not None  # a target inside this replica has none
        }
        # What a replacement after a fault costs, besides Serve's detection and process start.
        logger.info("speculation group up: workers and engine started in %.1f s", time.monotonic() - start_s)

    def _start_engine(
        self,
        config: ServeConfig,
        target: Target,
        drafter: Drafter | None,
        telemetry: GroupTelemetry,
        load: GroupLoad,
        budget_policy: AdaptiveBudget | None = None,
    ) -> AsyncLLM:
        """The engine thread over the group's workers, observed by its telemetry and load.

        `budget_policy`: the lost engine's adaptive policy, kept over a restart (no recalibration)."""
        observer = _step_observer(telemetry, load)
        llm = AsyncLLM(group_engine(config, target, drafter, self._tokenizer, observer, budget_policy))
        telemetry.start_load_gauges(llm)
        return llm

    def _start_engine_core(
        self,
        config: ServeConfig,
        load: GroupLoad,
        target_factory: TargetFactory | None,
        drafter_factory: DrafterFactory | None,
    ) -> tuple[AsyncLLM, GroupTelemetry, dict[str, Any]]:
        """The engine core's group and this replica's client of it, observed by telemetry and load
        as an engine in this process would be -> (client, telemetry, actors by role)."""
        core, drafter_actor = start_engine_core(config, target_factory, drafter_factory)
        info = ray.get(core.info.remote())
        telemetry = GroupTelemetry(config.observability, info.block_size, config.engine.budget)
        view = EngineView(info, config.engine.to_settings(), self._tokenizer, EngineCoreTarget(core))
        observer = _step_observer(telemetry, load)
        llm = EngineCoreClient(core, ray.get(core.address.remote()), view, observer)
        telemetry.start_load_gauges(llm)
        actors = {"target": core} if drafter_actor is None else {"target": core, "drafter": drafter_actor}
        return llm, telemetry, actors

    def _restart_engine(self, lost: AsyncLLM) -> AsyncLLM:
        """The supervisor's restart (blocking, on a worker thread): stop the engine that lost its
        target, wait for Ray's restart of the target actor, start a new engine over the actors."""
        lost.shutdown()
        if not lost.stopped:  # its thread could still call the workers the new engine takes over
            raise RuntimeError("the engine that lost its target did not stop")
        if isinstance(lost.engine.target, GraphTarget):
            lost.engine.target.discard()  # a new graph is compiled over the restarted target
        target, drafter = reconnect_workers(self._config, self._actors["target"], self._actors.get("drafter"))
        return self._start_engine(
            self._config, target, drafter, self._telemetry, self._load, lost.engine.budget_policy
        )

    @classmethod
    def sync_init(
        cls, config: ServeConfig, llm: AsyncLLM, telemetry: GroupTelemetry | None = None
    ) -> "Coordinator":
        """A Coordinator over an engine built elsewhere (tests, custom engines); no workers start.

        `telemetry` should be the observer of `llm`'s engine, if any; None = no metrics or spans.
        """
        coordinator = cls.__new__(cls)
        load = GroupLoad(config.engine.max_num_seqs)  # not fed by steps: tokens per step read 0
        coordinator._init_shared(config, llm, telemetry or GroupTelemetry.disabled(), load, restart=None)
        return coordinator

    def _init_shared(
        self,
        config: ServeConfig,
        llm: AsyncLLM,
        telemetry: GroupTelemetry,
        load: GroupLoad,
        restart: Callable[[AsyncLLM], AsyncLLM] | None,
    ) -> None:
        install_refusal_log_filter()
        self._config = config
        self._supervisor = EngineSupervisor(llm, restart, config.placement.target_restart_timeout_s)
        self._telemetry = telemetry
        self._load = load
        engine_limit = llm.engine.max_prompt_tokens  # the engine knows its tree: one source of truth
        self._max_prompt_tokens = min(config.limits.max_prompt_tokens or engine_limit, engine_limit)
        self._ids = itertools.count()
        self._num_cancelled = 0  # requests whose caller went away before they finished
        self._actors: dict[str, Any] = {}  # worker actor handles by role (none in process)

    # --------------------------------------------------------------------------------- requests

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Streams one chunk per engine step that committed tokens (or per
        `stream_batching_interval_ms`, each with every token since the last); the last has usage."""
        llm = self._supervisor.llm
        prompt = request.prompt
        prompt_ids = llm.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
        if len(prompt_ids) > self._max_prompt_tokens:
            self._telemetry.record_rejection("prompt_too_long")
            raise invalid(
                f"prompt has {len(prompt_ids)} tokens, more than the limit of {self._max_prompt_tokens}",
                "prompt",
            )
        # Positions a request may fill: the slot less the rows one padded tree takes past it.
        request.check_context_length(len(prompt_ids), llm.engine.max_seq_len - llm.engine.max_tree_tokens + 1)
        try:
            self._supervisor.check_serving()
        except TargetUnavailableError as error:
            raise _unavailable(error) from error
        llm = self._supervisor.llm  # again: a restart may have completed since the first read
        engine_id = f"{request.request_id}#{next(self._ids)}"
        with self._telemetry.request_span(
            request.request_id, engine_id, request.trace_carrier, len(prompt_ids)
        ) as span:
            try:
                interval_s = self._config.stream_batching_interval_ms / 1e3
                outputs = self._load.watch(
                    engine_id, llm.generate_stream(prompt_ids, request.sampling, engine_id, interval_s)
                )
                async with aclosing(outputs):  # leaving early aborts the engine request now
                    async for output in outputs:
                        usage = None
                        if output.finished:
                            usage = _usage(output.stats)
                            self._telemetry.record_finished(span, output)
                        yield GenerationChunk(
                            request.request_id,
                            output.delta_text,
                            tuple(output.delta_token_ids),
                            output.finish_reason if output.finished else None,
                            usage,
                        )
            except _ENGINE_ERRORS as error:
                if isinstance(error, EngineDeadError) and isinstance(error.cause, TargetUnavailableError):
                    self._supervisor.target_lost(llm, error.cause)
                request_error, rejection_reason = _request_error(error, self._supervisor.is_retired(llm))
                if rejection_reason is not None:
                    self._telemetry.record_rejection(rejection_reason)
                raise request_error from error
            except (asyncio.CancelledError, GeneratorExit):
                logger.info("request %s cancelled by the caller; aborting", request.request_id)
                self._num_cancelled += 1
                self._telemetry.record_cancelled()
                raise

    # ------------------------------------------------------------------------------ inspection

    async def stats(self) -> dict[str, int | float]:
        """Load figures; raises while the group cannot serve (its target restarting or lost, or
        `check_health` failing), so health probes (HTTP /health, gRPC Check) report it at once.

        `speculating` is 0 while the group decodes without its drafter (lost, or mode "ar");
        `target_restarts` counts the target losses this replica came back from in place;
        `engine_steps` and `engine_step_seconds` are the current engine's steps and their wall time
        (a served step against the same engine's in process: `bench/serve_load.py`)."""
        self._supervisor.check_serving()
        await self.check_health()
        self._supervisor.check_serving()  # a loss the target probe just found
        llm = self._supervisor.llm
        engine = llm.engine
        return {
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            "open_streams": llm.num_active_requests,
            "cancelled": self._num_cancelled,
            "max_num_seqs": self._config.engine.max_num_seqs,
            "speculating": int(engine.speculating),
            "drafter_losses": engine.num_drafter_losses,
            "target_restarts": self._supervisor.num_target_restarts,
            "engine_steps": llm.num_steps,
            "engine_step_seconds": llm.step_seconds,
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook: this group's load, read by the speculation
        policy (`serve/autoscaling.py`) after Serve averages it over its look-back window."""
        engine = self._supervisor.llm.engine
        return self._load.stats(engine.num_running, engine.num_waiting)

    async def model_info(self) -> dict[str, Any]:
        engine = self._supervisor.llm.engine
        return {
            "draft_mode": self._config.engine.mode,
            "block_size": engine.block_size,
            "tree_budget": self._config.engine.budget,
            "max_model_len": engine.max_seq_len,
            "vocab_size": engine.vocab_size,
            "has_vision_tower": target_has_vision_tower(target_dir(self._config.engine)),
        }

    async def check_health(self) -> None:
        """Serve's replica health check: failing it makes Serve replace the replica.

        It passes while the supervisor restarts a lost target in place, and fails once that
        restart failed or overran its bound, or the engine stopped for another reason. The target
        is asked too, so a target that died while the group was idle is found now, not at the
        next request. A lost drafter does not fail it: the group still serves.
        """
        supervisor = self._supervisor
        supervisor.check_restart()
        if supervisor.restarting:
            return
        llm = supervisor.llm
        target = llm.engine.target
        if isinstance(target, RayTarget | RayTargetGroup | GraphTarget | EngineCoreTarget):
            try:
                await target.check_alive()
            except TargetUnavailableError as error:
                supervisor.target_lost(llm, error)
                supervisor.check_restart()  # raises when the group cannot restart it in place
                return
        if not llm.is_running:
            raise RuntimeError("the engine thread stopped")

    async def worker_actors(self) -> dict[str, Any]:
        """The group's worker actor handles by role ("target", "drafter"; none in process), for
        operators' fault drills and the fault tests."""
        return dict(self._actors)


def _step_observer(telemetry: GroupTelemetry, load: GroupLoad) -> StepObserver:
    """Each step of the group's engine, for its telemetry and its load."""

    def observe(record: StepRecord) -> None:
        telemetry.on_step(record)
        load.on_step(record)

    return observe


def _request_error(error: Exception, retired: bool) -> tuple[RequestError, str | None]:
    """What the caller gets for an engine error, and the rejection reason to count (None: the
    request was not refused, the engine failed). `retired`: the engine was given up for a
    target loss (its shutdown is a retriable end too)."""
    if isinstance(error, QueueFullError):
        return RequestError(ErrorKind.OVERLOADED, str(error)), "queue_full"
    if isinstance(error, EngineDeadError) and isinstance(error.cause, TargetUnavailableError):
        return _unavailable(error.cause), None
    if isinstance(error, EngineDeadError) and retired:
        return _unavailable(TargetUnavailableError("the target worker is restarting")), None
    if isinstance(error, EngineDeadError):
        return RequestError(ErrorKind.INTERNAL, f"the engine stopped: {error}"), None
    return invalid(str(error), "prompt"), "invalid"


def _unavailable(error: TargetUnavailableError) -> RequestError:
    message = f"{error}: this server is restarting its models; retry in a few seconds"
    return RequestError(ErrorKind.UNAVAILABLE, message)


def _usage(stats: RequestStats) -> Usage:
    return Usage(stats.num_prompt_tokens, stats.num_generated_tokens, stats.steps, stats.acceptance_length)
