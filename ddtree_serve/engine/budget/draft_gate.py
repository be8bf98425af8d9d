"""Whether a step drafts at all, decided before drafting from recent acceptance.

Skipping the drafter saves its call; the step is then a plain decode (root-only trees). The
gate predicts the drafted step's rate from the recent acceptance curve (an EMA, per best-first
position, of the calibrated acceptance probabilities of the latest drafted trees, averaged over
their requests) as if every running request had that curve, and drafts only when that beats
plain decoding. After `probe_interval` plain steps in a row it drafts once regardless, so the
curve stays current and the engine can switch back when acceptance or load changes.
"""

from collections.abc import Sequence

import numpy as np

from ddtree_serve.engine.budget.allocator import StepCost, TokenLayout, allocate, plain_decode_rate


class DraftGate:
    """Draft-or-not per step; `decide` is called once per step, `record_curve` after each draft."""

    def __init__(self, probe_interval: int = 16, curve_weight: float = 0.3) -> None:
        if probe_interval < 1 or not 0.0 < curve_weight <= 1.0:
            raise ValueError("need probe_interval >= 1 and curve_weight in (0, 1]")
        self.probe_interval = probe_interval
        self.curve_weight = curve_weight
        self.curve: np.ndarray | None = None  # [positions] recent calibrated acceptance
        self.num_plain_steps = 0  # consecutive steps without a draft

    def decide(self, caps: Sequence[int], cost: StepCost, layout: TokenLayout) -> bool:
        """True: draft this step. Counts plain steps toward the next probe."""
        draft = self.curve is None or self.num_plain_steps >= self.probe_interval
        if not draft:
            batch_size = len(caps)
            drafted = allocate(
                [self.curve] * batch_size, caps, cost, draft_ms=cost.draft_ms(batch_size), layout=layout
            )
            draft = drafted.tokens_per_s > plain_decode_rate(batch_size, cost)
        self.num_plain_steps = 0 if draft else self.num_plain_steps + 1
        return draft

    def record_curve(self, accept_probs: Sequence[np.ndarray]) -> None:
        """A drafted step's candidates: per request, calibrated probabilities in best-first order."""
        width = max((len(p) for p in accept_probs), default=0)
        if width == 0:
            return
        sums, counts = np.zeros(width), np.zeros(width)
        for probs in accept_probs:
            sums[: len(probs)] += probs
            counts[: len(probs)] += 1
        step_curve = sums / np.maximum(counts, 1)
        if self.curve is None:
            self.curve = step_curve
            return
        merged = np.zeros(max(width, len(self.curve)))
        merged[: len(self.curve)] = self.curve
        merged[:width] += self.curve_weight * (step_curve - merged[:width])
        self.curve = merged
