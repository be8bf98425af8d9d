"""Ray metrics of one speculation group, exported on Ray's Prometheus endpoint.

`GroupMetrics` is created inside the Coordinator replica (`ray.serve.metrics` adds the
deployment, replica and application tags); `PolicyMetrics` inside Serve's controller, where the
autoscaling policy runs (plain `ray.util.metrics`, tagged with the deployment it decides for).
Names are prefixed `ddtree_`; Ray's exporter adds `ray_`.
"""

from collections.abc import Mapping, Sequence

from ray.serve import metrics
from ray.util import metrics as ray_metrics

from ddtree_serve.engine.budget import BudgetStep
from ddtree_serve.engine.timing import STEP_STAGES

_LATENCY_BOUNDARIES_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
_CALIBRATION_ABS_ERROR_BOUNDARIES = [0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0]


def _budget_node_boundaries(tree_budget: int) -> list[float]:
    """0 (no draft) alone, then powers of two up to the budget, the budget itself last."""
    powers = [float(2**exponent) for exponent in range(tree_budget.bit_length()) if 2**exponent < tree_budget]
    return [0.5, *powers, float(tree_budget)]


class GroupMetrics:
    """Per-step and per-request figures of one Coordinator's engine."""

    def __init__(self, block_size: int, tree_budget: int) -> None:
        # Tokens emitted per request per step lie in 1..block_size (accepted drafts + the bonus).
        tokens_per_step_boundaries = [float(n) + 0.5 for n in range(1, max(block_size, 2) + 1)]
        self.acceptance_length = metrics.Histogram(
            "ddtree_acceptance_length",
            description="Tokens one request committed in one step (accepted drafts + bonus); mean = tau.",
            boundaries=tokens_per_step_boundaries,
        )
        self.accepted_tokens_per_step = metrics.Histogram(
            "ddtree_accepted_tokens_per_step",
            description="Draft tokens the target accepted in one engine step, summed over its batch.",
            boundaries=[0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256],
        )
        self.tokens_per_step = metrics.Histogram(
            "ddtree_tokens_per_step",
            description="Tokens one engine step committed across its whole batch.",
            boundaries=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
        )
        self.step_latency = metrics.Histogram(
            "ddtree_step_phase_seconds",
            description=f"Wall time of one engine step phase ({', '.join(STEP_STAGES)}).",
            boundaries=_LATENCY_BOUNDARIES_S,
            tag_keys=("phase",),
        )
        self.active_requests = metrics.Gauge(
            "ddtree_active_requests", description="Requests holding a KV slot (running)."
        )
        self.queued_requests = metrics.Gauge(
            "ddtree_queued_requests", description="Requests admitted and waiting for a KV slot."
        )
        self.tree_budget = metrics.Gauge(
            "ddtree_tree_budget", description="Default DDTree node budget per step."
        )
        self.finished_requests = metrics.Counter(
            "ddtree_finished_requests",
            description="Finished requests by finish reason.",
            tag_keys=("finish_reason",),
        )
        self.rejected_requests = metrics.Counter(
            "ddtree_rejected_requests",
            description="Requests refused by the coordinator, by reason.",
            tag_keys=("reason",),
        )
        # The adaptive budget's choice and forecast (fed only under budget_policy "adaptive").
        self.budget_nodes = metrics.Histogram(
            "ddtree_budget_nodes",
            description="Draft nodes the budget policy gave one request in one step (0 = no draft).",
            boundaries=_budget_node_boundaries(tree_budget),
        )
        self.budget_no_draft_steps = metrics.Counter(
            "ddtree_budget_no_draft_steps",
            description="Steps the adaptive budget decoded plainly (no draft: drafting would not pay).",
        )
        draft_tokens_boundaries = [0.5 * n for n in range(1, 2 * max(block_size - 1, 1) + 1)]
        self.predicted_acceptance = metrics.Histogram(
            "ddtree_predicted_acceptance",
            description="Draft tokens the calibrated forecast expected one request to accept in a "
            "drafted step (the sum of its verified nodes' calibrated probabilities).",
            boundaries=draft_tokens_boundaries,
        )
        self.actual_acceptance = metrics.Histogram(
            "ddtree_actual_acceptance",
            description="Draft tokens verification accepted for one request in a drafted step "
            "(the forecast's outcome; compare with ddtree_predicted_acceptance).",
            boundaries=draft_tokens_boundaries,
        )
        # Ray histograms take positive boundaries only: the signed bias is the difference of the
        # two means above, the spread is this histogram.
        self.calibration_abs_error = metrics.Histogram(
            "ddtree_calibration_abs_error",
            description="|predicted - accepted| draft tokens of one request in a drafted step "
            "(the calibration error; its bias is mean predicted minus mean actual acceptance).",
            boundaries=_CALIBRATION_ABS_ERROR_BOUNDARIES,
        )
        self._tree_budget = tree_budget
        self.record_load(0, 0)

    def record_step(self, phase_seconds: Mapping[str, float], emitted_per_request: Sequence[int]) -> None:
        """One engine step: phase wall times and the token count each running request committed."""
        for phase, seconds in phase_seconds.items():
            self.step_latency.observe(seconds, tags={"phase": phase})
        for emitted in emitted_per_request:
            self.acceptance_length.observe(emitted)
        if emitted_per_request:
            self.accepted_tokens_per_step.observe(sum(emitted - 1 for emitted in emitted_per_request))
            self.tokens_per_step.observe(sum(emitted_per_request))

    def record_budget(self, step: BudgetStep) -> None:
        """One step of the adaptive budget: nodes per request, and the forecast against the outcome."""
        for num_nodes in step.num_nodes:
            self.budget_nodes.observe(num_nodes)
        if not step.drafted:
            self.budget_no_draft_steps.inc()
            return
        for predicted, accepted in zip(step.predicted_per_request, step.accepted_per_request, strict=True):
            self.predicted_acceptance.observe(predicted)
            self.actual_acceptance.observe(accepted)
            self.calibration_abs_error.observe(abs(predicted - accepted))

    def record_load(self, num_running: int, num_waiting: int) -> None:
        """Refreshes the gauges; call periodically, since Ray drops gauges that stop being set."""
        self.active_requests.set(num_running)
        self.queued_requests.set(num_waiting)
        self.tree_budget.set(self._tree_budget)

    def record_finish(self, finish_reason: str) -> None:
        self.finished_requests.inc(tags={"finish_reason": finish_reason})

    def record_rejection(self, reason: str) -> None:
        self.rejected_requests.inc(tags={"reason": reason})


class PolicyMetrics:
    """The speculation autoscaling policy's inputs and decisions, set on every control tick."""

    _TAGS = ("deployment", "application")

    def __init__(self) -> None:
        self.slot_demand = ray_metrics.Gauge(
            "ddtree_autoscaling_slot_demand",
            description="Mean slot demand per group the policy saw: (running + queued) / max_num_seqs.",
            tag_keys=self._TAGS,
        )
        self.queue_wait = ray_metrics.Gauge(
            "ddtree_autoscaling_queue_wait_seconds",
            description="Longest first-token wait of any group the policy saw (window mean).",
            tag_keys=self._TAGS,
        )
        self.tokens_per_step = ray_metrics.Gauge(
            "ddtree_autoscaling_tokens_per_step",
            description="Tokens one request commits per step (tau) across groups, as the policy saw it.",
            tag_keys=self._TAGS,
        )
        self.no_draft_share = ray_metrics.Gauge(
            "ddtree_autoscaling_no_draft_share",
            description="Share of recent steps the groups' adaptive budget decoded without a draft "
            "(weighted by running requests; 0 under the fixed policy), as the policy saw it.",
            tag_keys=self._TAGS,
        )
        self.groups = ray_metrics.Gauge(
            "ddtree_autoscaling_groups",
            description="Speculation groups: reporting, proposed by the band, decided after delays.",
            tag_keys=(*self._TAGS, "kind"),
        )
        self.decisions = ray_metrics.Counter(
            "ddtree_autoscaling_decisions",
            description="Changes of the group count the policy made, by direction.",
            tag_keys=(*self._TAGS, "direction"),
        )

    def record(
        self,
        *,
        deployment: str,
        application: str,
        slot_demand: float,
        queue_wait_s: float,
        tokens_per_step: float,
        no_draft_share: float,
        num_reporting: int,
        num_proposed: int,
        num_decided: int,
        direction: str | None,
    ) -> None:
        """One control tick; `direction` is "up" / "down" when the decision changed the count."""
        tags = {"deployment": deployment, "application": application}
        self.slot_demand.set(slot_demand, tags=tags)
        self.queue_wait.set(queue_wait_s, tags=tags)
        self.tokens_per_step.set(tokens_per_step, tags=tags)
        self.no_draft_share.set(no_draft_share, tags=tags)
        counts = {"reporting": num_reporting, "proposed": num_proposed, "decided": num_decided}
        for kind, count in counts.items():
            self.groups.set(count, tags={**tags, "kind": kind})
        if direction is not None:
            self.decisions.inc(tags={**tags, "direction": direction})
