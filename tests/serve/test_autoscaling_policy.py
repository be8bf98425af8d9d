"""The speculation autoscaling policy on synthetic group reports: Serve's real context, no Ray.

Each tick builds the `AutoscalingContext` Serve's controller builds (aggregated custom metrics
by replica, replica counts, the policy state the previous tick returned, the tick's clock), so
the band, the delays and the state round trip are what the controller runs.
"""

from typing import Any

import pytest
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig
from ray.serve.config import AutoscalingContext

from ddtree_serve.serve import load
from ddtree_serve.serve.autoscaling import GroupReports, SpeculationPolicy, propose, serve_autoscaling_config
from ddtree_serve.serve.config import AutoscalingConfig, SpeculationScalingConfig

SLOTS = 4
BAND = SpeculationScalingConfig()  # target 0.75, scale up above 1.0, down below 0.5
UP_DELAY_S, DOWN_DELAY_S = 5.0, 20.0


def group(
    running: float, waiting: float = 0.0, wait_s: float = 0.0, tau: float = 3.0, no_draft: float = 0.0
) -> dict[str, float]:
    return {
        load.RUNNING: running,
        load.WAITING: waiting,
        load.MAX_NUM_SEQS: SLOTS,
        load.QUEUE_WAIT_S: wait_s,
        load.TOKENS_PER_STEP: tau,
        load.NO_DRAFT_SHARE: no_draft,
    }


def metrics_of(groups: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Reports by replica, as `AutoscalingContext.aggregated_metrics` lays them out."""
    metrics: dict[str, dict[str, float]] = {}
    for index, report in enumerate(groups):
        for name, value in report.items():
            metrics.setdefault(name, {})[f"replica-{index}"] = value
    return metrics


class Controller:
    """Ticks the policy as Serve's controller does: the returned count becomes the target, the
    returned state comes back on the next tick; replicas start at once (current = target)."""

    def __init__(self, policy: SpeculationPolicy, num_replicas: int, max_replicas: int = 4) -> None:
        self.policy = policy
        self.target = num_replicas
        self.max_replicas = max_replicas
        self.state: dict[str, Any] = {}

    def tick(self, now: float, groups: list[dict[str, float]], current: int | None = None) -> int:
        current = self.target if current is None else current
        ctx = AutoscalingContext(
            deployment_id=None,  # type: ignore[arg-type]
            deployment_name="Coordinator",
            app_name="ddtree",
            current_num_replicas=current,
            target_num_replicas=self.target,
            running_replicas=[],
            total_num_requests=0.0,
            total_queued_requests=0.0,
            aggregated_metrics=metrics_of(groups),
            raw_metrics={},
            capacity_adjusted_min_replicas=1,
            capacity_adjusted_max_replicas=self.max_replicas,
            policy_state=dict(self.state),
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=now,
            config=None,
        )
        self.target, self.state = self.policy(ctx)
        return self.target


def new_policy(**band: Any) -> SpeculationPolicy:
    return SpeculationPolicy(
        SpeculationScalingConfig(**band).model_dump(),
        upscale_delay_s=UP_DELAY_S,
        downscale_delay_s=DOWN_DELAY_S,
    )


def test_saturated_slots_scale_up_only_after_the_upscale_delay_and_to_the_sized_count() -> None:
    controller = Controller(new_policy(), num_replicas=1)
    saturated = [group(running=SLOTS, waiting=5)]  # demand 9 slots: 9 / (0.75 * 4) = 3 groups
    assert controller.tick(0.0, saturated) == 1  # wanted, not yet for the whole delay
    assert controller.tick(UP_DELAY_S - 0.5, saturated) == 1
    assert controller.tick(UP_DELAY_S, saturated) == 3


def test_a_dip_inside_the_band_restarts_the_delay() -> None:
    controller = Controller(new_policy(), num_replicas=1)
    saturated, in_band = [group(running=SLOTS, waiting=2)], [group(running=3)]
    controller.tick(0.0, saturated)
    controller.tick(UP_DELAY_S - 1.0, in_band)  # slot demand 0.75: hold, pending dropped
    assert controller.tick(UP_DELAY_S, saturated) == 1
    assert controller.tick(2 * UP_DELAY_S - 0.5, saturated) == 1
    assert controller.tick(2 * UP_DELAY_S, saturated) == 2


@pytest.mark.parametrize("running_per_group", [2, 3, 4])
def test_demand_inside_the_band_holds_for_ever(running_per_group: int) -> None:
    controller = Controller(new_policy(), num_replicas=2)
    groups = [group(running=running_per_group), group(running=running_per_group)]  # 0.5 .. 1.0
    for second in range(0, 200, 10):
        assert controller.tick(float(second), groups) == 2


def test_idle_groups_scale_down_after_the_downscale_delay_to_what_the_demand_needs() -> None:
    controller = Controller(new_policy(), num_replicas=3)
    quiet = [group(running=1), group(running=1), group(running=0)]  # demand 2: one group suffices
    assert controller.tick(0.0, quiet) == 3
    assert controller.tick(DOWN_DELAY_S - 0.5, quiet) == 3
    assert controller.tick(DOWN_DELAY_S, quiet) == 1
    assert controller.tick(DOWN_DELAY_S + 100.0, [group(running=1)]) == 1  # min_replicas holds


def test_after_a_scale_down_the_remaining_groups_sit_inside_the_band() -> None:
    """No flapping: the count a scale-down picks puts slot demand at or below the target."""
    for demand in range(0, 4 * SLOTS):
        reports = GroupReports(4, 4 * SLOTS, float(demand), 0.0, 3.0)
        proposal = propose(reports, BAND, num_groups=4, min_groups=1, max_groups=4)
        if proposal.direction == "down":
            after = GroupReports(proposal.num_groups, proposal.num_groups * SLOTS, float(demand), 0.0, 3.0)
            assert propose(after, BAND, proposal.num_groups, 1, 4).direction == "hold"


def test_the_count_stays_within_max_replicas_and_the_limit_is_a_hold() -> None:
    controller = Controller(new_policy(), num_replicas=2, max_replicas=2)
    saturated = [group(running=SLOTS, waiting=8), group(running=SLOTS, waiting=8)]
    for second in range(0, 60, 5):
        assert controller.tick(float(second), saturated) == 2
    assert "ddtree_pending_direction" not in controller.state


def test_a_long_first_token_wait_adds_a_group_even_with_free_slots() -> None:
    controller = Controller(new_policy(max_queue_wait_s=1.0), num_replicas=1)
    slow_prefill = [group(running=3, wait_s=1.5)]  # slot demand 0.75: inside the band
    controller.tick(0.0, slow_prefill)
    assert controller.tick(UP_DELAY_S, slow_prefill) == 2


def test_tau_collapsing_under_load_adds_a_group_only_when_enabled() -> None:
    busy_plain = [group(running=3, tau=1.1)]  # the budget fell towards no draft
    enabled = Controller(new_policy(min_tokens_per_step=1.5), num_replicas=1)
    enabled.tick(0.0, busy_plain)
    assert enabled.tick(UP_DELAY_S, busy_plain) == 2
    disabled = Controller(new_policy(), num_replicas=1)
    disabled.tick(0.0, busy_plain)
    assert disabled.tick(UP_DELAY_S, busy_plain) == 1
    idle_plain = [group(running=1, tau=1.1)]  # low tau but little load: not a capacity problem
    idle = Controller(new_policy(min_tokens_per_step=1.5), num_replicas=1)
    idle.tick(0.0, idle_plain)
    assert idle.tick(UP_DELAY_S, idle_plain) == 1


def test_the_budget_falling_to_no_draft_under_load_adds_a_group_only_when_enabled() -> None:
    busy_plain = [group(running=3, tau=1.4, no_draft=0.8)]  # slot demand 0.75: inside the band
    enabled = Controller(new_policy(max_no_draft_share=0.5), num_replicas=1)
    assert enabled.tick(0.0, busy_plain) == 1  # wanted, not yet for the whole delay
    assert enabled.tick(UP_DELAY_S, busy_plain) == 2
    disabled = Controller(new_policy(), num_replicas=1)  # the default: today's behaviour
    disabled.tick(0.0, busy_plain)
    assert disabled.tick(UP_DELAY_S, busy_plain) == 1
    for groups in (
        [group(running=1, no_draft=0.8)],  # little load: plain steps are cheap, not a capacity problem
        [group(running=3, no_draft=0.4)],  # under load but the budget mostly drafts
    ):
        held = Controller(new_policy(max_no_draft_share=0.5), num_replicas=1)
        held.tick(0.0, groups)
        assert held.tick(UP_DELAY_S, groups) == 1


def test_reports_weight_the_no_draft_share_by_running_requests() -> None:
    reports = GroupReports.from_metrics(
        metrics_of(
            [group(running=3, no_draft=1.0), group(running=1, no_draft=0.0), group(running=0, no_draft=1.0)]
        )
    )
    assert reports is not None and reports.no_draft_share == pytest.approx(0.75)
    idle = GroupReports.from_metrics(metrics_of([group(running=0, no_draft=1.0)]))
    assert idle is not None and idle.no_draft_share == 0.0


def test_groups_still_starting_are_not_asked_for_twice() -> None:
    controller = Controller(new_policy(), num_replicas=1)
    saturated = [group(running=SLOTS, waiting=2)]  # demand 6: two groups
    controller.tick(0.0, saturated)
    assert controller.tick(UP_DELAY_S, saturated) == 2
    # The second group is starting (one reports): the same load must not ask for a third.
    for second in range(10, 60, 5):
        assert controller.tick(float(second), saturated, current=1) == 2


def test_no_report_yet_keeps_the_target() -> None:
    controller = Controller(new_policy(), num_replicas=2)
    assert controller.tick(0.0, []) == 2


def test_reports_weight_tau_by_running_requests_and_take_the_longest_wait() -> None:
    reports = GroupReports.from_metrics(
        metrics_of([group(running=3, wait_s=0.2, tau=4.0), group(running=1, waiting=2, wait_s=0.9, tau=2.0)])
    )
    assert reports == GroupReports(
        num_groups=2, num_slots=2 * SLOTS, demand=6.0, queue_wait_s=0.9, tokens_per_step=3.5
    )
    assert reports.slot_demand == pytest.approx(0.75)


def test_generic_policy_passes_serve_its_target_and_speculation_names_the_policy_class() -> None:
    generic = serve_autoscaling_config(
        AutoscalingConfig(min_replicas=1, max_replicas=3, target_ongoing_requests=6, upscale_delay_s=2)
    )
    assert generic == {
        "min_replicas": 1,
        "max_replicas": 3,
        "target_ongoing_requests": 6,
        "upscale_delay_s": 2,
    }
    speculation = serve_autoscaling_config(
        AutoscalingConfig(
            min_replicas=1,
            max_replicas=3,
            policy="speculation",
            downscale_delay_s=7,
            look_back_period_s=4,
            metrics_interval_s=1,
        )
    )
    serve_config = ServeAutoscalingConfig(**speculation)  # Serve validates and pickles the policy
    assert (serve_config.upscale_delay_s, serve_config.downscale_delay_s) == (0.0, 0.0)
    assert serve_config.look_back_period_s == 4
    kwargs = serve_config.policy.policy_kwargs
    assert kwargs["downscale_delay_s"] == 7
    assert kwargs["upscale_delay_s"] == ServeAutoscalingConfig.model_fields["upscale_delay_s"].default
    policy = serve_config.policy.get_policy()(**kwargs)  # what the controller builds
    controller = Controller(policy, num_replicas=1, max_replicas=3)
    assert controller.tick(0.0, [group(running=SLOTS, waiting=SLOTS)]) == 1


def test_the_band_must_contain_its_target_and_the_window_more_than_one_report() -> None:
    with pytest.raises(ValueError, match="downscale_slot_demand <= target_slot_demand"):
        SpeculationScalingConfig(target_slot_demand=1.2, upscale_slot_demand=1.0)
    with pytest.raises(ValueError, match="must exceed the push interval"):
        AutoscalingConfig(look_back_period_s=4)  # Serve pushes every 10 s by default
