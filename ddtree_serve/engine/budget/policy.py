"""`AdaptiveBudget`: the engine's per-step budget choice, from calibration, cost and the gate.

Per step the engine asks, in pipeline order:
    should_draft(caps)                  before drafting (False: a plain decode step)
    choose(trees, caps, draft_ms)       after building each tree at its ceiling: nodes per request
    observe(trees, accepted, ...)       after verification: calibration and cost refresh
The trees verified are `tree_prefix(tree, n)` of the ones built, so the choice reads drafter
outputs only and verification stays lossless.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddtree_serve.engine.budget.allocator import Allocation, TokenLayout, allocate
from ddtree_serve.engine.budget.calibration import AcceptanceCalibrator
from ddtree_serve.engine.budget.cost_curve import CostCurve
from ddtree_serve.engine.budget.draft_gate import DraftGate
from ddtree_serve.tree import DraftTree


@dataclass(frozen=True)
class BudgetStep:
    """What one step chose and how its forecast fared (for metrics, spans and benchmarks)."""

    drafted: bool
    num_nodes: tuple[int, ...]  # draft nodes verified per request
    predicted_accepted: float  # calibrated expected accepted draft tokens, whole batch
    accepted: int  # accepted draft tokens, whole batch


class AdaptiveBudget:
    """Owns the calibrator, the cost curve and the draft gate of one engine."""

    def __init__(
        self,
        cost: CostCurve,
        calibrator: AcceptanceCalibrator | None = None,
        gate: DraftGate | None = None,
        layout: TokenLayout = "padded",
    ) -> None:
        self.cost = cost
        self.calibrator = calibrator or AcceptanceCalibrator()
        self.gate = gate or DraftGate()
        self.layout = layout
        self.last_step: BudgetStep | None = None
        self._pending: Allocation | None = None

    def should_draft(self, caps: Sequence[int]) -> bool:
        drafted = self.gate.decide(caps, self.cost, self.layout)
        if not drafted:
            self._pending = None
        return drafted

    def choose(self, trees: Sequence[DraftTree], caps: Sequence[int], draft_ms: float) -> Allocation:
        """Nodes per request for trees built at their ceiling (`caps[i]` draft nodes at most)."""
        accept_probs = [self.calibrator.calibrate(np.exp(tree.logws[1:])) for tree in trees]
        self.gate.record_curve(accept_probs)
        allocation = allocate(accept_probs, caps, self.cost, draft_ms=draft_ms, layout=self.layout)
        self._pending = allocation
        return allocation

    def observe(
        self,
        trees: Sequence[DraftTree],
        accepted_nodes: Sequence[Sequence[int]],
        verify_ms: float,
        draft_ms: float | None,
    ) -> None:
        """The verified (truncated) trees, each one's accepted draft nodes (root excluded), the times.

        `draft_ms` is None for a step that did not draft: only the cost curve learns from it.
        """
        batch_size = len(trees)
        target_tokens = batch_size * max(tree.num_nodes for tree in trees)  # padded verify batch
        self.cost.observe_verify(batch_size, target_tokens, verify_ms)
        if draft_ms is not None:
            self.cost.observe_draft(batch_size, draft_ms)
        probs, hits = [], []
        for tree, nodes in zip(trees, accepted_nodes, strict=True):
            hit = np.zeros(tree.num_nodes, dtype=bool)
            hit[list(nodes)] = True  # node indices count from the root (0)
            probs.append(np.exp(tree.logws[1:]))
            hits.append(hit[1:])
        if draft_ms is not None:
            self.calibrator.observe(np.concatenate(probs), np.concatenate(hits))
        allocation = self._pending
        self.last_step = BudgetStep(
            drafted=draft_ms is not None,
            num_nodes=tuple(tree.num_nodes - 1 for tree in trees),
            predicted_accepted=0.0 if allocation is None else sum(allocation.expected_accepted),
            accepted=sum(len(nodes) for nodes in accepted_nodes),
        )
        self._pending = None


def tree_prefix(tree: DraftTree, num_draft_nodes: int) -> DraftTree:
    """The first `num_draft_nodes` nodes of a best-first tree (and the root): itself a valid tree.

    Best-first numbering puts parents before children and siblings in descending logw order, so
    a prefix is ancestor-closed and keeps both orders.
    """
    end = min(num_draft_nodes, tree.num_nodes - 1) + 1
    return DraftTree(
        token_ids=tree.token_ids[:end],
        depths=tree.depths[:end],
        parents=tree.parents[:end],
        logws=tree.logws[:end],
    )
