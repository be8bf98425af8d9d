"""The Coordinator deployment: one replica = one speculation group.

It declares its placement group (its own bundle, the drafter's device, the target's devices),
starts `DrafterWorker` / `TargetWorker` in bundles 1 and 2 of its replica's group, and runs the
engine's `AsyncLLM` over a `SpecEngine` whose `Drafter` / `Target` are the actor adapters. The
ingress calls `generate`; the per-step observer feeds Ray metrics and the phase spans of every
request in the step.
"""

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from opentelemetry.trace import Span
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ddtree_serve.engine.async_llm import AsyncLLM, EngineDeadError
from ddtree_serve.engine.interfaces import Drafter, Target
from ddtree_serve.engine.scheduler import QueueFullError
from ddtree_serve.models import load_tokenizer
from ddtree_serve.serve.config import ServeConfig, WorkerResources
from ddtree_serve.serve.errors import ErrorKind, RequestError, invalid
from ddtree_serve.serve.factories import LocalDrafterFactory, LocalTargetFactory, target_dir
from ddtree_serve.serve.metrics import GroupMetrics
from ddtree_serve.serve.observed_engine import ObservedEngine, StepRecord
from ddtree_serve.serve.protocol import GenerationChunk, GenerationRequest, Usage
from ddtree_serve.serve.tracing import Tracing
from ddtree_serve.serve.workers import (
    DrafterFactory,
    DrafterWorker,
    RayDrafter,
    RayTarget,
    TargetFactory,
    TargetWorker,
)

logger = logging.getLogger("ray.serve")

# Bundle 0 is the Coordinator replica itself (Serve places the replica there).
DRAFTER_BUNDLE, TARGET_BUNDLE = 1, 2
# Serve-level headroom above the engine's own limit, so the engine (not Serve's queue) refuses
# the request that overflows and the caller gets 503 / RESOURCE_EXHAUSTED at once.
_ONGOING_HEADROOM = 4
_GAUGE_INTERVAL_S = 1.0


class Coordinator:
    """Runs the speculative decoding loop of one group and streams each request's steps."""

    @classmethod
    def get_deployment_options(cls, config: ServeConfig) -> dict[str, Any]:
        """Serve deployment options: the group's placement bundles, replica count, limits.

        Bundle 0 holds the replica itself (Serve's rule), then the drafter, then the target
        group; mode "ar" has no drafter and therefore no drafter bundle.
        """
        placement = config.placement
        bundles = [placement.coordinator.bundle()]
        if config.engine.mode != "ar":
            bundles.append(placement.drafter.bundle())
        bundles.append(placement.target.bundle())
        scaling = config.autoscaling
        options: dict[str, Any] = {
            "ray_actor_options": {
                "num_cpus": placement.coordinator.num_cpus,
                "resources": dict(placement.coordinator.resources),
            },
            "placement_group_bundles": bundles,
            "placement_group_strategy": placement.strategy,
            "max_ongoing_requests": config.max_ongoing_per_group + _ONGOING_HEADROOM,
        }
        if scaling.min_replicas == scaling.max_replicas:
            options["num_replicas"] = scaling.min_replicas
        else:
            options["autoscaling_config"] = {
                "min_replicas": scaling.min_replicas,
                "max_replicas": scaling.max_replicas,
                "target_ongoing_requests": scaling.target_ongoing_requests,
            }
        return options

    def __init__(
        self,
        config: ServeConfig,
        target_factory: TargetFactory | None = None,
        drafter_factory: DrafterFactory | None = None,
    ) -> None:
        """`target_factory` / `drafter_factory` build the in-process models inside the workers;
        None = load `config.engine`'s model directories (tests inject fakes here)."""
        self._config = config
        engine_config = config.engine
        target_factory = target_factory or LocalTargetFactory(engine_config)
        drafter_factory = drafter_factory or LocalDrafterFactory(engine_config)
        uses_drafter = engine_config.mode != "ar"
        if config.placement.workers == "in_process":
            target: Target = target_factory()
            drafter: Drafter | None = drafter_factory() if uses_drafter else None
        else:
            target, drafter = self._start_workers(target_factory, drafter_factory if uses_drafter else None)
        self._metrics = (
            GroupMetrics(drafter.block_size if drafter else 1, engine_config.budget)
            if config.observability.metrics
            else None
        )
        self._tracing = Tracing(config.observability.tracing, component="coordinator")
        # Request spans by engine request id; written on the event loop, read by the engine thread.
        self._spans: dict[str, Span] = {}
        self._spans_lock = threading.Lock()
        self._ids = itertools.count()
        self._num_cancelled = 0  # requests whose caller went away before they finished
        # Tokens each running request's verify steps produced so far (engine thread only).
        self._step_tokens: dict[str, int] = {}
        tokenizer = load_tokenizer(target_dir(engine_config))
        engine = ObservedEngine(
            engine_config.to_settings(), target, drafter, tokenizer, observer=self._on_step
        )
        self._llm = AsyncLLM(engine)
        self._engine = engine
        if self._metrics is not None:
            threading.Thread(target=self._refresh_load_gauges, name="ddtree-gauges", daemon=True).start()

    def _start_workers(
        self, target_factory: TargetFactory, drafter_factory: DrafterFactory | None
    ) -> tuple[Target, Drafter | None]:
        """Starts the workers in this replica's placement group (anywhere when there is none)."""
        placement_group = get_current_placement_group()
        placement = self._config.placement

        def options(resources: WorkerResources, bundle_index: int) -> dict[str, Any]:
            worker_options: dict[str, Any] = {
                "num_cpus": resources.num_cpus,
                "num_gpus": resources.num_gpus,
                "resources": dict(resources.resources),
            }
            if placement_group is not None:
                worker_options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=bundle_index
                )
            return worker_options

        drafter = None
        target_bundle = DRAFTER_BUNDLE
        if drafter_factory is not None:
            drafter_actor = DrafterWorker.options(**options(placement.drafter, DRAFTER_BUNDLE)).remote(
                drafter_factory
            )
            drafter = RayDrafter(drafter_actor)
            target_bundle = TARGET_BUNDLE
        target_actor = TargetWorker.options(**options(placement.target, target_bundle)).remote(target_factory)
        return RayTarget(target_actor), drafter

    # --------------------------------------------------------------------------------- requests

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Streams one chunk per engine step that committed tokens; the last has usage."""
        prompt = request.prompt
        prompt_ids = self._engine.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
        if len(prompt_ids) > self._config.max_prompt_tokens:
            self._reject("prompt_too_long")
            raise invalid(
                f"prompt has {len(prompt_ids)} tokens, more than the limit of "
                f"{self._config.max_prompt_tokens}",
                "prompt",
            )
        # Positions a request may fill: the slot less the rows one padded tree takes past it.
        request.check_context_length(
            len(prompt_ids), self._engine.max_seq_len - self._engine.max_tree_tokens + 1
        )
        engine_id = f"{request.request_id}#{next(self._ids)}"
        with self._tracing.span(
            "ddtree.request", request.trace_carrier, {"request_id": request.request_id}
        ) as span:
            if span is not None:
                span.set_attribute("ddtree.prompt_tokens", len(prompt_ids))
                with self._spans_lock:
                    self._spans[engine_id] = span
            try:
                outputs = self._llm.generate_stream(prompt_ids, request.sampling, engine_id)
                async with aclosing(outputs):  # leaving early aborts the engine request now
                    async for output in outputs:
                        usage = None
                        if output.finished:
                            stats = output.stats
                            usage = Usage(
                                stats.num_prompt_tokens,
                                stats.num_generated_tokens,
                                stats.steps,
                                stats.acceptance_length,
                            )
                            if span is not None:
                                span.set_attribute("ddtree.acceptance_length", stats.acceptance_length)
                                span.set_attribute("ddtree.completion_tokens", stats.num_generated_tokens)
                                span.set_attribute("ddtree.finish_reason", output.finish_reason or "")
                            if self._metrics is not None:
                                self._metrics.record_finish(output.finish_reason or "stop")
                        yield GenerationChunk(
                            request.request_id,
                            output.delta_text,
                            tuple(output.delta_token_ids),
                            output.finish_reason if output.finished else None,
                            usage,
                        )
            except QueueFullError as error:
                self._reject("queue_full")
                raise RequestError(ErrorKind.OVERLOADED, str(error)) from error
            except ValueError as error:
                self._reject("invalid")
                raise invalid(str(error), "prompt") from error
            except EngineDeadError as error:
                raise RequestError(ErrorKind.INTERNAL, f"the engine stopped: {error}") from error
            except (asyncio.CancelledError, GeneratorExit):
                logger.info("request %s cancelled by the caller; aborting", request.request_id)
                self._num_cancelled += 1
                if self._metrics is not None:
                    self._metrics.record_finish("abort")
                raise
            finally:
                with self._spans_lock:
                    self._spans.pop(engine_id, None)

    def _reject(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.record_rejection(reason)

    def _on_step(self, record: StepRecord) -> None:
        """Engine thread, after every step: metrics, and phase spans under each request's span."""
        if self._metrics is not None:
            phases = {name: (end - start) / 1e9 for name, (start, end) in record.intervals_ns.items()}
            self._metrics.record_step(phases, self._tokens_this_step(record))
        if self._tracing.enabled:
            phases_ns = {
                name: interval for name, interval in record.intervals_ns.items() if name != "schedule"
            }
            with self._spans_lock:
                spans = [self._spans.get(output.request_id) for output in record.outputs]
            for span in spans:
                self._tracing.record_phases(span, phases_ns, record.index)

    def _refresh_load_gauges(self) -> None:
        """Gauge thread: running/queued counts every second (read across threads; a stale
        count is fine for a gauge) for as long as the engine runs."""
        assert self._metrics is not None
        while self._llm.is_running:
            self._metrics.record_load(self._engine.num_running, self._engine.num_waiting)
            time.sleep(_GAUGE_INTERVAL_S)

    def _tokens_this_step(self, record: StepRecord) -> list[int]:
        """Tokens each request's verify produced this step, before stop truncation (1..block)."""
        emitted = []
        for output in record.outputs:
            stats = output.stats
            total = round(stats.acceptance_length * stats.steps)
            previous = self._step_tokens.get(output.request_id, 0)
            if total > previous:
                emitted.append(total - previous)
            if output.finished:
                self._step_tokens.pop(output.request_id, None)
            else:
                self._step_tokens[output.request_id] = total
        return emitted

    # ------------------------------------------------------------------------------ inspection

    async def stats(self) -> dict[str, int]:
        """Load figures; raises once the engine thread stopped, so health probes (HTTP /health,
        gRPC Check) report the group down before Serve's own check replaces the replica."""
        self.check_health()
        return {
            "running": self._engine.num_running,
            "waiting": self._engine.num_waiting,
            "open_streams": self._llm.num_active_requests,
            "cancelled": self._num_cancelled,
            "max_num_seqs": self._config.engine.max_num_seqs,
        }

    async def model_info(self) -> dict[str, Any]:
        engine_config = self._config.engine
        return {
            "draft_mode": engine_config.mode,
            "block_size": self._engine.block_size,
            "tree_budget": engine_config.budget,
            "max_model_len": self._engine.max_seq_len,
            "vocab_size": self._engine.vocab_size,
        }

    def check_health(self) -> None:
        """Serve's replica health check: a dead engine thread restarts the replica."""
        if not self._llm.is_running:
            raise RuntimeError("the engine thread stopped")
