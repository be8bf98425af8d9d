"""The speculation-aware autoscaling policy, and the Serve autoscaling options of either policy.

A speculation group's capacity is its KV slots (`max_num_seqs`), not a request count, and what
it does with them depends on how many tokens a step commits per request (tau). Every group
reports its slots, running and queued requests, the wait of its oldest request without a first
token, its tau and the share of recent steps its adaptive budget did not draft
(`serve/load.py`); Serve averages each over its look-back window and hands them to
`SpeculationPolicy` in the controller, every control-loop tick (Ray 2.60's custom policy API:
a class named by import path, built once with `policy_kwargs`).

The policy sizes the group count for `target_slot_demand`, adds groups when the mean slot
demand rises above `upscale_slot_demand`, when a request waits too long for its first token,
when tau collapses under load, or when the budget keeps choosing "no draft" under load (the
batch grew past where drafting pays; both off by default); it removes groups only when the
demand would fit fewer groups and sits below `downscale_slot_demand`. Inside the band it holds.
A wanted change happens only after it has been wanted for the whole delay (measured on the
context's clock, kept in the policy state), so the delays are part of the policy and testable
with synthetic contexts; Serve's own delays are set to 0 for it. Its inputs and decisions are
Ray gauges of the controller (`serve/metrics.py: PolicyMetrics`) and one log line per wanted
or made change.
"""

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import ray
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig
from ray.serve.config import AutoscalingContext

from ddtree_serve.serve import load
from ddtree_serve.serve.config import AutoscalingConfig, SpeculationScalingConfig
from ddtree_serve.serve.metrics import PolicyMetrics

logger = logging.getLogger("ray.serve")

POLICY_IMPORT_PATH = "ddtree_serve.serve.autoscaling:SpeculationPolicy"

# Keys of the policy's own entries in Serve's per-deployment policy state.
_PENDING_DIRECTION = "ddtree_pending_direction"
_PENDING_SINCE = "ddtree_pending_since"

Direction = Literal["up", "down", "hold"]


@dataclass(frozen=True)
class GroupReports:
    """The groups' reports summed over the groups that have reported (the policy's inputs)."""

    num_groups: int
    num_slots: float  # KV slots of those groups
    demand: float  # running + queued requests
    queue_wait_s: float  # the longest first-token wait of any group
    tokens_per_step: float  # tau, weighted by running requests; 0 = no step seen yet
    no_draft_share: float = 0.0  # share of steps without a draft, weighted by running requests

    @property
    def slot_demand(self) -> float:
        """Mean slot demand per group: 1.0 = every slot busy, nothing queued."""
        return self.demand / self.num_slots

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Mapping[Any, float]]) -> "GroupReports | None":
        """From `AutoscalingContext.aggregated_metrics`; None while no group has reported."""
        slots = metrics.get(load.MAX_NUM_SEQS, {})
        replicas = [replica for replica, num_slots in slots.items() if num_slots > 0]
        if not replicas:
            return None

        def figure(name: str, replica: Any) -> float:
            return float(metrics.get(name, {}).get(replica, 0.0))

        running = {replica: figure(load.RUNNING, replica) for replica in replicas}
        taus = {replica: figure(load.TOKENS_PER_STEP, replica) for replica in replicas}
        weights = {replica: running[replica] for replica in replicas if taus[replica] > 0}
        total_weight = sum(weights.values())
        tau = sum(taus[r] * w for r, w in weights.items()) / total_weight if total_weight > 0 else 0.0
        total_running = sum(running.values())
        no_draft_share = (
            sum(figure(load.NO_DRAFT_SHARE, r) * running[r] for r in replicas) / total_running
            if total_running > 0
            else 0.0
        )
        return cls(
            num_groups=len(replicas),
            num_slots=sum(slots[replica] for replica in replicas),
            demand=sum(running[replica] + figure(load.WAITING, replica) for replica in replicas),
            queue_wait_s=max(figure(load.QUEUE_WAIT_S, replica) for replica in replicas),
            tokens_per_step=tau,
            no_draft_share=no_draft_share,
        )


@dataclass(frozen=True)
class Proposal:
    """The group count the reports ask for, before delays."""

    num_groups: int
    direction: Direction
    reason: str


def propose(
    reports: GroupReports, band: SpeculationScalingConfig, num_groups: int, min_groups: int, max_groups: int
) -> Proposal:
    """The band's answer for `num_groups` running groups, within [min_groups, max_groups]."""
    slots_per_group = reports.num_slots / reports.num_groups
    sized = max(1, math.ceil(reports.demand / (band.target_slot_demand * slots_per_group)))
    slot_demand = reports.slot_demand
    tau = reports.tokens_per_step
    if slot_demand > band.upscale_slot_demand:
        wanted, direction = max(num_groups + 1, sized), "up"
        reason = f"slot demand {slot_demand:.2f} > {band.upscale_slot_demand}"
    elif reports.queue_wait_s > band.max_queue_wait_s:
        wanted, direction = max(num_groups + 1, sized), "up"
        reason = f"first-token wait {reports.queue_wait_s:.2f}s > {band.max_queue_wait_s}s"
    elif (
        band.min_tokens_per_step is not None
        and 0 < tau < band.min_tokens_per_step
        and slot_demand > band.downscale_slot_demand
    ):
        wanted, direction = max(num_groups + 1, sized), "up"
        reason = f"tokens per step {tau:.2f} < {band.min_tokens_per_step} under load"
    elif (
        band.max_no_draft_share is not None
        and reports.no_draft_share > band.max_no_draft_share
        and slot_demand > band.downscale_slot_demand
    ):
        wanted, direction = max(num_groups + 1, sized), "up"
        reason = f"no-draft share {reports.no_draft_share:.2f} > {band.max_no_draft_share} under load"
    elif slot_demand < band.downscale_slot_demand and sized < num_groups:
        wanted, direction = sized, "down"
        reason = f"slot demand {slot_demand:.2f} < {band.downscale_slot_demand}, fits {sized}"
    else:
        return Proposal(num_groups, "hold", f"slot demand {slot_demand:.2f} inside the band")
    bounded = min(max(wanted, min_groups), max_groups)
    if bounded == num_groups:
        return Proposal(num_groups, "hold", f"{reason}, at the limit")
    return Proposal(bounded, direction, reason)


class SpeculationPolicy:
    """Ray Serve custom autoscaling policy (deployment scope): called with each tick's context."""

    def __init__(self, band: dict[str, Any], upscale_delay_s: float, downscale_delay_s: float) -> None:
        self._band = SpeculationScalingConfig.model_validate(band)
        self._delays_s = {"up": upscale_delay_s, "down": downscale_delay_s}
        self._metrics: PolicyMetrics | None = None  # made on the first call inside Ray

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        state = dict(ctx.policy_state)
        reports = GroupReports.from_metrics(ctx.aggregated_metrics or {})
        if reports is None:  # groups starting: nothing to decide on yet
            return ctx.target_num_replicas, state
        proposal = propose(
            reports,
            self._band,
            ctx.current_num_replicas,
            ctx.capacity_adjusted_min_replicas,
            ctx.capacity_adjusted_max_replicas,
        )
        now = ctx.current_time if ctx.current_time is not None else time.time()
        decision = self._after_delay(proposal, ctx, state, now)
        self._publish(ctx, reports, proposal, decision)
        return decision, state

    def _after_delay(
        self, proposal: Proposal, ctx: AutoscalingContext, state: dict[str, Any], now: float
    ) -> int:
        """The target count: `proposal` once wanted for its whole delay, else unchanged."""
        target = ctx.target_num_replicas
        direction = proposal.direction
        # Groups still starting count as added: an "up" the target already covers holds.
        if (
            direction == "hold"
            or (direction == "up" and proposal.num_groups <= target)
            or (direction == "down" and proposal.num_groups >= target)
        ):
            state.pop(_PENDING_DIRECTION, None)
            state.pop(_PENDING_SINCE, None)
            return target
        if state.get(_PENDING_DIRECTION) != direction:
            state[_PENDING_DIRECTION], state[_PENDING_SINCE] = direction, now
            logger.info(
                "ddtree autoscaling %s: scale %s wanted, %d -> %d groups (%s); after %.1fs",
                ctx.deployment_name,
                direction,
                target,
                proposal.num_groups,
                proposal.reason,
                self._delays_s[direction],
            )
        if now - state[_PENDING_SINCE] < self._delays_s[direction]:
            return target
        del state[_PENDING_DIRECTION], state[_PENDING_SINCE]
        logger.info(
            "ddtree autoscaling %s: scaling %s, %d -> %d groups (%s)",
            ctx.deployment_name,
            direction,
            target,
            proposal.num_groups,
            proposal.reason,
        )
        return proposal.num_groups

    def _publish(
        self, ctx: AutoscalingContext, reports: GroupReports, proposal: Proposal, decision: int
    ) -> None:
        if self._metrics is None:
            if not ray.is_initialized():  # unit tests call the policy outside Ray
                return
            self._metrics = PolicyMetrics()
        self._metrics.record(
            deployment=ctx.deployment_name,
            application=ctx.app_name or "",
            slot_demand=reports.slot_demand,
            queue_wait_s=reports.queue_wait_s,
            tokens_per_step=reports.tokens_per_step,
            no_draft_share=reports.no_draft_share,
            num_reporting=reports.num_groups,
            num_proposed=proposal.num_groups,
            num_decided=decision,
            direction=None if decision == ctx.target_num_replicas else proposal.direction,
        )


def serve_autoscaling_config(config: AutoscalingConfig) -> dict[str, Any]:
    """Serve's `autoscaling_config` for either policy (fields left None keep Serve's defaults)."""
    options: dict[str, Any] = {"min_replicas": config.min_replicas, "max_replicas": config.max_replicas}
    for name in ("look_back_period_s", "metrics_interval_s"):
        if getattr(config, name) is not None:
            options[name] = getattr(config, name)
    if config.policy == "generic":
        options["target_ongoing_requests"] = config.target_ongoing_requests
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(config, name) is not None:
                options[name] = getattr(config, name)
        return options
    serve_defaults = ServeAutoscalingConfig.model_fields
    options["policy"] = {
        "policy_function": POLICY_IMPORT_PATH,
        "policy_kwargs": {
            "band": config.speculation.model_dump(),
            "upscale_delay_s": _or_default(config.upscale_delay_s, serve_defaults["upscale_delay_s"].default),
            "downscale_delay_s": _or_default(
                config.downscale_delay_s, serve_defaults["downscale_delay_s"].default
            ),
        },
    }
    # The policy applies its delays itself (see the module docstring); Serve must not add its own.
    options["upscale_delay_s"] = 0.0
    options["downscale_delay_s"] = 0.0
    return options


def _or_default(value: float | None, default: float) -> float:
    return default if value is None else value
