"""The step observer's spans: each step's phases land under the span of every request in it."""

import json
from pathlib import Path

from ddtree_serve.engine.request import RequestOutput, RequestStats
from ddtree_serve.serve.config import ObservabilityConfig, TracingConfig
from ddtree_serve.serve.observed_engine import StepRecord
from ddtree_serve.serve.telemetry import GroupTelemetry


def _output(request_id: str) -> RequestOutput:
    stats = RequestStats(num_prompt_tokens=3, num_generated_tokens=2, steps=1, acceptance_length=2.0)
    return RequestOutput(request_id, [5, 6], 2, 2, False, None, None, stats)


def test_phase_spans_go_under_the_running_requests_only(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    tracing = TracingConfig(exporter="file", file_path=str(path))
    telemetry = GroupTelemetry(
        ObservabilityConfig(metrics=False, tracing=tracing), block_size=8, tree_budget=16
    )
    intervals = {"schedule": (0, 1_000), "draft": (1_000, 2_000), "verify": (2_000, 4_000)}
    with telemetry.request_span("a", "a#0", {}, num_prompt_tokens=3):
        with telemetry.request_span("b", "b#1", {}, num_prompt_tokens=3):
            telemetry.on_step(StepRecord(7, intervals, [_output("a#0")], {"a#0": 2}))
        telemetry.on_step(StepRecord(8, intervals, [_output("b#1")], {"b#1": 1}))  # b has ended
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    request_ids = {
        s["context"]["span_id"]: s["attributes"]["request_id"] for s in spans if s["name"] == "ddtree.request"
    }
    phases = [
        (request_ids[s["parent_id"]], s["name"], s["attributes"]["ddtree.step"])
        for s in spans
        if s["parent_id"] in request_ids
    ]
    assert sorted(phases) == [("a", "draft", 7), ("a", "verify", 7)]  # no schedule span, none for b
    assert {s["attributes"]["ddtree.prompt_tokens"] for s in spans if s["name"] == "ddtree.request"} == {3}
