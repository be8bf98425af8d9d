"""The telemetry of one speculation group: Ray metrics and spans, fed by requests and by steps.

Two sources feed it. The Coordinator, on the event loop, opens one request span per `generate`
(under the caller's trace context) and reports finishes, cancellations and refusals. The engine
thread reports every step through `on_step` (the `ObservedEngine`'s observer), which records
the step's phase times and per-request tokens as metrics and adds the step's phase spans under
the span of every request in it; under the adaptive budget policy the step's choice (nodes per
request, or no draft) and its forecast against what verification accepted go to both. A gauge
thread refreshes the load gauges while the engine runs.
"""

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry.trace import Span

from ddtree_serve.engine.async_llm import AsyncLLM
from ddtree_serve.engine.budget import BudgetStep
from ddtree_serve.engine.outputs import CompletionOutput
from ddtree_serve.serve.config import ObservabilityConfig
from ddtree_serve.serve.metrics import GroupMetrics
from ddtree_serve.serve.observed_engine import StepRecord
from ddtree_serve.serve.tracing import Tracing

_GAUGE_INTERVAL_S = 1.0


class GroupTelemetry:
    """Metrics (None when observability.metrics is off) and tracing of one Coordinator."""

    def __init__(self, observability: ObservabilityConfig, block_size: int, tree_budget: int) -> None:
        self._metrics = GroupMetrics(block_size, tree_budget) if observability.metrics else None
        self._tracing = Tracing(observability.tracing, component="coordinator")
        # Request spans by engine request id; written on the event loop, read by the engine thread.
        self._spans: dict[str, Span] = {}
        self._spans_lock = threading.Lock()

    @classmethod
    def disabled(cls) -> "GroupTelemetry":
        """No metrics, no spans: every method is a no-op."""
        return cls(ObservabilityConfig(metrics=False), block_size=1, tree_budget=1)

    # ----------------------------------------------------------------- requests (event loop)

    @contextmanager
    def request_span(
        self, request_id: str, engine_id: str, trace_carrier: Mapping[str, str], num_prompt_tokens: int
    ) -> Iterator[Span | None]:
        """The request's span, known to `on_step` under `engine_id` while the request runs."""
        with self._tracing.span("ddtree.request", trace_carrier, {"request_id": request_id}) as span:
            if span is None:
                yield None
                return
            span.set_attribute("ddtree.prompt_tokens", num_prompt_tokens)
            with self._spans_lock:
                self._spans[engine_id] = span
            try:
                yield span
            finally:
                with self._spans_lock:
                    self._spans.pop(engine_id, None)

    def record_finished(self, span: Span | None, output: CompletionOutput) -> None:
        if span is not None:
            span.set_attribute("ddtree.acceptance_length", output.stats.acceptance_length)
            span.set_attribute("ddtree.completion_tokens", output.stats.num_generated_tokens)
            span.set_attribute("ddtree.finish_reason", output.finish_reason or "")
        if self._metrics is not None:
            self._metrics.record_finish(output.finish_reason or "stop")

    def record_cancelled(self) -> None:
        if self._metrics is not None:
            self._metrics.record_finish("abort")

    def record_rejection(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.record_rejection(reason)

    # ------------------------------------------------------------------------- engine thread

    def on_step(self, record: StepRecord) -> None:
        """After every step: metrics, and phase spans under each request's span."""
        if self._metrics is not None:
            phases = {name: (end - start) / 1e9 for name, (start, end) in record.intervals_ns.items()}
            self._metrics.record_step(phases, list(record.num_step_tokens.values()))
            if record.budget is not None:
                self._metrics.record_budget(record.budget)
        if self._tracing.enabled:
            phases_ns = {
                name: interval for name, interval in record.intervals_ns.items() if name != "schedule"
            }
            attributes = budget_span_attributes(record.budget) if record.budget is not None else None
            with self._spans_lock:
                spans = [self._spans.get(output.request_id) for output in record.outputs]
            for span in spans:
                self._tracing.record_phases(span, phases_ns, record.index, attributes)

    # --------------------------------------------------------------------------- load gauges

    def start_load_gauges(self, llm: AsyncLLM) -> None:
        """Refreshes the running/queued gauges every second while `llm`'s engine runs."""
        if self._metrics is not None:
            threading.Thread(
                target=self._refresh_load_gauges, args=(self._metrics, llm), name="ddtree-gauges", daemon=True
            ).start()

    @staticmethod
    def _refresh_load_gauges(metrics: GroupMetrics, llm: AsyncLLM) -> None:
        """Gauge thread: the counts are read across threads; a stale count is fine for a gauge."""
        while llm.is_running:
            metrics.record_load(llm.engine.num_running, llm.engine.num_waiting)
            time.sleep(_GAUGE_INTERVAL_S)


def budget_span_attributes(step: BudgetStep) -> dict[str, bool | int | float]:
    """What the adaptive budget chose for a step and how its forecast fared, for the phase spans.

    Batch figures: the choice is made across the whole batch (the spans are shared by it too).
    """
    return {
        "ddtree.budget.drafted": step.drafted,
        "ddtree.budget.batch_size": len(step.num_nodes),
        "ddtree.budget.nodes": sum(step.num_nodes),
        "ddtree.budget.max_nodes": max(step.num_nodes, default=0),
        "ddtree.budget.predicted_accepted": step.predicted_accepted,
        "ddtree.budget.accepted": step.accepted,
        "ddtree.budget.calibration_error": step.calibration_error,
    }
