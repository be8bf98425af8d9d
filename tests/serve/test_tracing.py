"""Span export by config: JSON lines to a file, or OTLP/HTTP to a collector (a local stub here)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from ddtree_serve.serve.config import TracingConfig
from ddtree_serve.serve.tracing import Tracing, carrier_from_pairs

CALLER = "00-5b8aa5a2d2c872e8321cf37308d69df2-051581bf3cb55c13-01"


def test_file_exporter_parents_spans_to_the_callers_traceparent(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    tracing = Tracing(TracingConfig(exporter="file", file_path=str(path)), component="test")
    carrier = carrier_from_pairs([("TraceParent", CALLER), ("x-other", "ignored")])
    assert carrier == {"traceparent": CALLER}
    with tracing.span("outer", carrier, {"request_id": "r"}) as outer:
        tracing.record_phases(outer, {"draft": (1_000, 2_000), "verify": (2_000, 5_000)}, step=3)
        inner_carrier = Tracing.carrier_of(outer)
    with tracing.span("inner", inner_carrier):
        pass
    tracing.shutdown()
    spans = {s["name"]: s for s in map(json.loads, path.read_text().splitlines())}
    assert spans["outer"]["parent_id"] == "0x051581bf3cb55c13"
    assert spans["outer"]["context"]["trace_id"] == "0x5b8aa5a2d2c872e8321cf37308d69df2"
    assert spans["inner"]["parent_id"] == spans["draft"]["parent_id"] == spans["outer"]["context"]["span_id"]
    assert spans["verify"]["attributes"] == {"ddtree.step": 3}


def test_disabled_tracing_yields_no_span_and_writes_nothing(tmp_path: Path) -> None:
    tracing = Tracing(
        TracingConfig(exporter="none", file_path=str(tmp_path / "never.jsonl")), component="test"
    )
    with tracing.span("x", {"traceparent": CALLER}) as span:
        assert span is None and Tracing.carrier_of(span) == {}
    assert not tracing.enabled and not (tmp_path / "never.jsonl").exists()


def test_otlp_exporter_posts_protobuf_spans_to_the_configured_endpoint() -> None:
    received: list[tuple[str, str, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, self.headers["Content-Type"], body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return None

    server = HTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_port}/v1/traces"
        tracing = Tracing(TracingConfig(exporter="otlp", otlp_endpoint=endpoint), component="test")
        with tracing.span("ddtree.request", {"traceparent": CALLER}):
            pass
        tracing.shutdown()  # flushes the batch processor
    finally:
        server.shutdown()
    assert received and received[0][0] == "/v1/traces"
    assert received[0][1] == "application/x-protobuf"
    assert b"ddtree.request" in received[0][2]
