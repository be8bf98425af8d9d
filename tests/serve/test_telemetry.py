"""The step observer's spans and metrics: each step's phases land under the span of every request
in it, and the adaptive budget's choice and forecast reach both."""

import json
from pathlib import Path

from ddtree_serve.engine.budget import BudgetStep
from ddtree_serve.engine.request import RequestOutput, RequestStats
from ddtree_serve.serve.config import ObservabilityConfig, TracingConfig
from ddtree_serve.serve.metrics import GroupMetrics
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


def _spans_by_name(path: Path) -> dict[str, list[dict]]:
    spans: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        span = json.loads(line)
        spans.setdefault(span["name"], []).append(span)
    return spans


def test_phase_spans_carry_the_budget_the_step_chose_and_its_forecast(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    tracing = TracingConfig(exporter="file", file_path=str(path))
    telemetry = GroupTelemetry(
        ObservabilityConfig(metrics=False, tracing=tracing), block_size=8, tree_budget=16
    )
    budget = BudgetStep(drafted=True, num_nodes=(12, 3), forecast=(2.5, 0.75), accepted_per_request=(1, 1))
    intervals = {"draft": (1_000, 2_000), "verify": (2_000, 4_000)}
    with telemetry.request_span("a", "a#0", {}, num_prompt_tokens=3):
        telemetry.on_step(StepRecord(1, intervals, [_output("a#0")], {"a#0": 2}, budget=budget))
        telemetry.on_step(StepRecord(2, intervals, [_output("a#0")], {"a#0": 1}))  # fixed policy
    phases = _spans_by_name(path)["verify"]
    chosen = {span["attributes"]["ddtree.step"]: span["attributes"] for span in phases}
    assert chosen[1]["ddtree.budget.drafted"] is True
    assert chosen[1]["ddtree.budget.batch_size"] == 2
    assert chosen[1]["ddtree.budget.nodes"] == 15 and chosen[1]["ddtree.budget.max_nodes"] == 12
    assert chosen[1]["ddtree.budget.predicted_accepted"] == 3.25 and chosen[1]["ddtree.budget.accepted"] == 2
    assert chosen[1]["ddtree.budget.calibration_error"] == 0.625  # (3.25 - 2) per request
    assert not any(key.startswith("ddtree.budget.") for key in chosen[2])


class _Recorded:
    """Stands in for one Ray metric: keeps what was observed or counted."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float) -> None:
        self.values.append(value)

    def inc(self) -> None:
        self.values.append(1)


def test_budget_metrics_record_nodes_per_request_and_the_forecast_of_drafted_steps() -> None:
    group_metrics = GroupMetrics(block_size=8, tree_budget=16)
    names = ("budget_nodes", "budget_no_draft_steps", "predicted_acceptance", "actual_acceptance")
    recorded = {name: _Recorded() for name in (*names, "calibration_abs_error")}
    for name, recorder in recorded.items():
        setattr(group_metrics, name, recorder)
    group_metrics.record_budget(
        BudgetStep(drafted=True, num_nodes=(16, 4), forecast=(3.0, 0.5), accepted_per_request=(2, 1))
    )
    group_metrics.record_budget(
        BudgetStep(drafted=False, num_nodes=(0, 0), forecast=(0.0, 0.0), accepted_per_request=(0, 0))
    )
    assert recorded["budget_nodes"].values == [16, 4, 0, 0]
    assert recorded["budget_no_draft_steps"].values == [1]  # the plain step only
    assert recorded["predicted_acceptance"].values == [3.0, 0.5]  # drafted steps only
    assert recorded["actual_acceptance"].values == [2, 1]
    assert recorded["calibration_abs_error"].values == [1.0, 0.5]
