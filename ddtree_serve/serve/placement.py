"""Can a speculation group be placed? Names the resources no alive node offers, instead of a
placement group left pending in silence.

A group is one placement group (`group.py`: coordinator + node type, drafter, target). Under
STRICT_PACK all of its bundles must fit one node together, so a cluster whose every node lacks
something the group needs (GPUs, `accelerator_type:B300`, ...) never places it, and Serve keeps
the replica pending. `build_app` calls `report_unplaceable_group` when Ray is up and logs what
is missing; a cluster autoscaler may still add such a node later, which the message says.
"""

import logging
from collections.abc import Mapping, Sequence

import ray

from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.group import placement_bundles

logger = logging.getLogger("ray.serve")

Resources = Mapping[str, float]

_EPS = 1e-9


def group_demand(bundles: Sequence[Resources]) -> dict[str, float]:
    """What a STRICT_PACK group takes from its one node: the sum of its bundles."""
    demand: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            demand[name] = demand.get(name, 0.0) + amount
    return demand


def shortfall(demand: Resources, node: Resources) -> dict[str, float]:
    """How much of each resource `node` (its totals) lacks to hold `demand`; empty = it fits."""
    return {
        name: amount - node.get(name, 0.0)
        for name, amount in demand.items()
        if amount > node.get(name, 0.0) + _EPS
    }


def unplaceable_reason(config: ServeConfig, nodes: Sequence[Resources]) -> str | None:
    """Why no node of `nodes` (alive nodes' total resources) can ever hold one group; None if one can.

    STRICT_PACK asks one node for the whole group; the other strategies ask each bundle to fit
    some node (a necessary condition: Ray may still fail to combine them).
    """
    bundles = placement_bundles(config)
    strategy = config.placement.strategy
    if not nodes:
        return "the cluster has no alive node"
    needs = [group_demand(bundles)] if strategy == "STRICT_PACK" else [dict(b) for b in bundles]
    for need in needs:
        gaps = [shortfall(need, node) for node in nodes]
        if all(gaps):
            closest = min(gaps, key=lambda gap: (len(gap), sum(gap.values())))
            missing_everywhere = sorted(set.intersection(*(set(gap) for gap in gaps)))
            return (
                f"a speculation group ({strategy}) needs {_format(need)} on one node, and none of the "
                f"{len(nodes)} alive nodes has it: the closest lacks {_format(closest)}"
                + (f"; no node offers enough {', '.join(missing_everywhere)}" if missing_everywhere else "")
            )
    return None


def report_unplaceable_group(config: ServeConfig) -> str | None:
    """Logs (warning level: an autoscaler may add the node) and returns why this cluster cannot
    place a group now; None if it can."""
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    reason = unplaceable_reason(config, nodes)
    if reason is not None:
        logger.warning(
            "ddtree placement: %s. Coordinator replicas stay pending until a node with these "
            "resources joins (a cluster autoscaler worker group that offers them).",
            reason,
        )
    return reason


def _format(resources: Resources) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in sorted(resources.items())) + "}"
