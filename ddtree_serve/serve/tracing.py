"""OpenTelemetry spans: one per request, one per step phase, parented to the caller's trace.

Each replica owns a private `TracerProvider` built from `TracingConfig` (no global provider,
so Ray Serve's own tracing setup, when enabled, is left alone). The caller's W3C
`traceparent` arrives as an HTTP header or gRPC metadata; the ingress starts its span under it
and hands its own context to the Coordinator as a plain dict, which starts the request span and
the per-phase spans of every step the request took part in.
"""

import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ddtree_serve.serve.config import TracingConfig

TRACE_HEADERS: tuple[str, ...] = ("traceparent", "tracestate")
_PROPAGATOR = TraceContextTextMapPropagator()


class JsonLinesSpanExporter(SpanExporter):
    """Appends one compact JSON object per span; safe for several processes on one file.

    Each span is a single `os.write` on an `O_APPEND` descriptor, so lines from the ingress
    and the Coordinator interleave whole.
    """

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(
            json.dumps(json.loads(span.to_json()), separators=(",", ":")) + "\n" for span in spans
        )
        with self._lock:
            if self._fd >= 0:
                os.write(self._fd, lines.encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _build_provider(config: TracingConfig, component: str) -> TracerProvider | None:
    if config.exporter == "none":
        return None
    resource = Resource.create({"service.name": config.service_name, "ddtree.component": component})
    provider = TracerProvider(resource=resource)
    if config.exporter == "file":
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(config.file_path)))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_endpoint)))
    return provider


def carrier_from_pairs(pairs: Iterator[tuple[str, str]] | Sequence[tuple[str, str]]) -> dict[str, str]:
    """The W3C trace headers among HTTP headers or gRPC metadata (keys compared lower-case)."""
    return {key.lower(): value for key, value in pairs if key.lower() in TRACE_HEADERS}


class Tracing:
    """Spans of one replica; every method is a cheap no-op when the exporter is 'none'."""

    def __init__(self, config: TracingConfig, component: str) -> None:
        self.config = config
        self._provider = _build_provider(config, component)
        self._tracer = self._provider.get_tracer("ddtree_serve") if self._provider else None

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @contextmanager
    def span(
        self,
        name: str,
        parent_carrier: Mapping[str, str] | None = None,
        attributes: Mapping[str, str | int | float | bool] | None = None,
        kind: SpanKind = SpanKind.SERVER,
    ) -> Iterator[Span | None]:
        """A span under the carrier's trace context (a new trace when the carrier has none)."""
        if self._tracer is None:
            yield None
            return
        parent = _PROPAGATOR.extract(dict(parent_carrier or {}))
        with self._tracer.start_as_current_span(
            name, context=parent, kind=kind, attributes=dict(attributes or {}), record_exception=False
        ) as span:
            try:
                yield span
            except BaseException as error:
                span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
                raise

    @staticmethod
    def carrier_of(span: Span | None) -> dict[str, str]:
        """The trace headers that make `span` the parent of spans in another process."""
        if span is None:
            return {}
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def record_phases(
        self,
        parent: Span | None,
        phase_intervals_ns: Mapping[str, tuple[int, int]],
        step: int,
        step_attributes: Mapping[str, str | int | float | bool] | None = None,
    ) -> None:
        """Child spans of `parent` covering the phases of one engine step (shared by its batch),
        each carrying `ddtree.step` and the step's own `step_attributes`."""
        if self._tracer is None or parent is None or not self.config.phase_spans:
            return
        context = trace.set_span_in_context(parent)
        attributes = {"ddtree.step": step, **(step_attributes or {})}
        for phase, (start_ns, end_ns) in phase_intervals_ns.items():
            span = self._tracer.start_span(
                phase,
                context=context,
                kind=SpanKind.INTERNAL,
                start_time=start_ns,
                attributes=attributes,
            )
            span.end(end_time=end_ns)

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()
