"""`AdaptiveBudget`: the engine's per-step budget choice, from calibration, cost and the gate.

One step calls, in pipeline order (the policy holds the step's figures in between):
    plan(caps)                    before drafting: the step's tree ceiling, 0 = a plain decode
                                  step (root-only trees); the drafter's top-K and the build use it
    record_draft_ms(ms)           after the drafter call, when there was one
    choose(trees, caps)           trees built at the ceiling -> draft nodes per request
    record_build_ms(ms)           after the build stage (trees, choice, verify buffers)
    record_verify_ms(ms)          after the verify call
    observe(trees, accepted)      the verified trees and their accepted nodes: calibration,
                                  cost refresh and the step's `BudgetStep` record
    record_step_ms(ms)            the whole step's wall time: what its priced parts left out
                                  (`step_overhead.py`)
The trees verified are `tree_prefix(tree, n)` of the ones built, so the choice reads drafter
outputs only and verification stays lossless.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddtree_serve.engine.budget.allocator import Allocation, TokenLayout, allocate, allocate_padded_rows
from ddtree_serve.engine.budget.build_cost import BuildCost
from ddtree_serve.engine.budget.calibration import AcceptanceCalibrator
from ddtree_serve.engine.budget.cost_curve import CostCurve
from ddtree_serve.engine.budget.draft_gate import DraftGate
from ddtree_serve.engine.budget.step_overhead import StepOverhead
from ddtree_serve.tree import DraftTree


@dataclass(frozen=True)
class BudgetStep:
    """What one step chose and how its forecast fared (for metrics, spans and benchmarks)."""

    drafted: bool
    num_nodes: tuple[int, ...]  # draft nodes verified per request
    predicted_per_request: tuple[float, ...]  # calibrated expected accepted draft tokens (0: no draft)
    accepted_per_request: tuple[int, ...]  # draft tokens verification accepted
    ceiling: int = 0  # draft nodes per tree the step built at most (0: a plain step)

    @property
    def predicted_accepted(self) -> float:
        """Calibrated expected accepted draft tokens, whole batch."""
        return sum(self.predicted_per_request)

    @property
    def accepted(self) -> int:
        """Accepted draft tokens, whole batch."""
        return sum(self.accepted_per_request)

    @property
    def calibration_error(self) -> float:
        """Predicted minus accepted draft tokens per request (> 0: the forecast was too hopeful)."""
        return (self.predicted_accepted - self.accepted) / len(self.num_nodes)


class AdaptiveBudget:
    """Owns the calibrator, the cost curve and the draft gate of one engine."""

    def __init__(
        self,
        cost: CostCurve,
        build: BuildCost | None = None,
        calibrator: AcceptanceCalibrator | None = None,
        gate: DraftGate | None = None,
        layout: TokenLayout = "padded",
        token_buckets: Sequence[int] | None = None,
    ) -> None:
        """`build`: the host build's cost (default: free, so only the forwards are priced).
        `token_buckets`: the tree tokens a graphed target pads each verify to (None: eager)."""
        self.cost = cost
        self.build = build or BuildCost(0.0, 0.0, 0.0)
        self.calibrator = calibrator or AcceptanceCalibrator()
        self.gate = gate or DraftGate()
        self.layout = layout  # the engine pads every tree of a batch to the widest
        self.token_buckets = None if token_buckets is None else tuple(token_buckets)
        self.overhead = StepOverhead()
        self._priced_ms: float | None = None  # the last observed step's priced parts, measured
        self._raw_probs = np.zeros(0)  # the last chosen step's drafter probabilities, all built nodes
        self._built_lengths = np.zeros(0, dtype=np.int64)  # its draft nodes built per request
        self.last_step: BudgetStep | None = None
        self._ceiling = 0
        self._draft_ms: float | None = None
        self._build_ms: float | None = None
        self._verify_ms: float | None = None
        self._allocation: Allocation | None = None

    def plan(self, caps: Sequence[int]) -> int:
        """Starts a step: its tree ceiling (0: decode plainly), from recent acceptance and costs."""
        self._draft_ms = self._build_ms = self._verify_ms = self._allocation = None
        self._ceiling = self.gate.ceiling(caps, self.cost, self.build, self.layout, self.overhead)
        return self._ceiling

    @property
    def ceiling(self) -> int:
        """The tree ceiling `plan` chose for the step under way."""
        return self._ceiling

    @property
    def probing(self) -> bool:
        """This step drafts only to refresh the acceptance curve, after plain steps: the engine
        may draft a few of its requests (the others verify root-only trees)."""
        return self.gate.probing

    def record_draft_ms(self, draft_ms: float) -> None:
        self._draft_ms = draft_ms

    def record_build_ms(self, build_ms: float) -> None:
        self._build_ms = build_ms

    def record_verify_ms(self, verify_ms: float) -> None:
        self._verify_ms = verify_ms

    def choose(self, trees: Sequence[DraftTree], caps: Sequence[int]) -> Allocation:
        """Draft nodes per request for trees built at their ceiling (`caps[i]` at most)."""
        lengths = np.array([tree.num_nodes - 1 for tree in trees])
        raw = np.exp(np.concatenate([tree.logws[1:] for tree in trees]))
        calibrated = self.calibrator.calibrate(raw)  # one call for the batch
        self._raw_probs, self._built_lengths = raw, lengths  # what `observe` teaches the calibrator
        accept_probs = np.split(calibrated, np.cumsum(lengths)[:-1])
        self.gate.record_curve(accept_probs)
        draft_ms = self.cost.draft_ms(len(trees)) if self._draft_ms is None else self._draft_ms
        draft_ms += self.overhead.drafted_ms  # paid whatever the widths: it moves the best one
        if self.layout == "padded":
            rows = np.zeros((len(trees), int(lengths.max(initial=0))))
            rows[np.arange(rows.shape[1])[None, :] < lengths[:, None]] = calibrated  # row-major
            usable = np.minimum(lengths, np.maximum(np.asarray(caps), 0))
            self._allocation = allocate_padded_rows(
                rows, usable, self.cost, draft_ms=draft_ms, token_buckets=self.token_buckets
            )
        else:
            self._allocation = allocate(accept_probs, caps, self.cost, draft_ms=draft_ms, layout=self.layout)
        return self._allocation

    def observe(self, trees: Sequence[DraftTree], accepted_nodes: Sequence[Sequence[int]]) -> BudgetStep:
        """Ends a step: the verified trees and each one's accepted draft nodes (root excluded).

        Only drafted steps teach the calibrator; every timed call refreshes the cost curve.
        """
        batch_size = len(trees)
        drafted = self._allocation is not None
        verified = [tree.num_nodes - 1 for tree in trees]  # draft nodes each tree verified
        if self._verify_ms is not None:
            target_tokens = batch_size * max(tree.num_nodes for tree in trees)  # padded verify batch
            self.cost.observe_verify(batch_size, target_tokens, self._verify_ms)
        if self._draft_ms is not None:
            self.cost.observe_draft(batch_size, self._draft_ms)
        if self._build_ms is not None and drafted:
            self.build.observe(batch_size, int(self._built_lengths.sum()), self._build_ms)
        if drafted:
            # The verified trees are prefixes of the built ones: their nodes' drafter
            # probabilities are the first `num_nodes - 1` of each built tree's.
            built = np.cumsum([0, *self._built_lengths])
            assert len(verified) == len(self._built_lengths) and all(
                v <= b for v, b in zip(verified, self._built_lengths, strict=True)
            ), "observe takes prefixes of the trees `choose` saw, in its order"
            offsets = np.cumsum([0, *verified])
            probs = np.concatenate(
                [self._raw_probs[b : b + n] for b, n in zip(built[:-1], verified, strict=True)]
            )
            hits = np.zeros(int(offsets[-1]), dtype=bool)
            for offset, nodes in zip(offsets[:-1], accepted_nodes, strict=True):
                hits[[offset + node - 1 for node in nodes]] = True  # node indices count from the root
            self.calibrator.observe(probs, hits)
        self.last_step = BudgetStep(
            drafted=drafted,
            num_nodes=tuple(verified),
            predicted_per_request=(
                self._allocation.expected_accepted if self._allocation is not None else (0.0,) * batch_size
            ),
            accepted_per_request=tuple(len(nodes) for nodes in accepted_nodes),
            ceiling=self._ceiling if drafted else 0,
        )
        self._priced_ms = None
        if not self.probing:  # a probe's drafter call is not timed (it catches up on context)
            self._priced_ms = sum(ms for ms in (self._draft_ms, self._build_ms, self._verify_ms) if ms)
        self._draft_ms = self._build_ms = self._verify_ms = self._allocation = None
        return self.last_step

    def record_step_ms(self, step_ms: float) -> None:
        """The observed step's wall time (after its prefills): teaches the step overhead."""
        if self.last_step is not None and self._priced_ms is not None:
            self.overhead.observe(self.last_step.drafted, step_ms - self._priced_ms)
        self._priced_ms = None


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
