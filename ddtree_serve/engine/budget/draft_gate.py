"""How wide a step builds its trees, decided before drafting from recent acceptance.

The ceiling is paid before the allocator sees a tree: the drafter's top-K and the host build
both scale with it (`build_cost.py`). The gate predicts each candidate ceiling's rate from the
recent acceptance curve (an EMA, per best-first position, of the calibrated acceptance
probabilities of the latest drafted trees, averaged over their requests) as if every running
request had that curve, with the drafter's call, that ceiling's build and the verify forward as
the step's cost; ceiling 0 is a plain decode step (no drafter call, root-only trees). The best
one wins. The first step, with no curve yet, takes the widest ceiling that costs at most a few
plain steps. After `probe_interval` steps in a row below the cap, one step builds wider (twice
the choice) so the curve past the chosen width stays current and the engine can widen again
when acceptance or load changes; after plain steps the probe drafts at the best drafting
ceiling (a probe at the cap could cost more than the plain steps before it saved), and while
probes keep finding drafting a clear loss they come at doubling intervals: each one also pays
the drafter's catch-up on all the context it skipped (on a CPU at batch 64, ten plain steps').
"""

from collections.abc import Sequence

import numpy as np

from ddtree_serve.engine.budget.allocator import StepCost, TokenLayout, plain_decode_rate, shared_curve_rate
from ddtree_serve.engine.budget.build_cost import BuildCost
from ddtree_serve.engine.budget.measure import powers_of_two_upto

FIRST_STEP_PLAIN_STEPS = 4.0
"""What the first drafted step may cost, in plain decode steps, before anything is known."""


CLEAR_LOSS = 0.8
"""Probes back off only while the best drafting rate is predicted below this share of plain
decoding's: near the boundary the curve's noise decides, and a probe is cheap to be wrong on."""


class DraftGate:
    """The step's tree ceiling; `ceiling` is called once per step, `record_curve` after each draft."""

    def __init__(self, probe_interval: int = 16, curve_weight: float = 0.3) -> None:
        if probe_interval < 1 or not 0.0 < curve_weight <= 1.0:
            raise ValueError("need probe_interval >= 1 and curve_weight in (0, 1]")
        self.probe_interval = probe_interval
        self.curve_weight = curve_weight
        self.curve: np.ndarray | None = None  # [positions] recent calibrated acceptance
        self.num_narrow_steps = 0  # consecutive steps whose ceiling was below the cap
        # Plain steps before the next probe: doubled after each probe that found drafting still
        # a loss (a probe pays the drafter's catch-up on every context it skipped), up to 16x.
        self.plain_probe_interval = probe_interval
        self.probing = False  # the last ceiling is a probe after plain steps

    def ceiling(self, caps: Sequence[int], cost: StepCost, build: BuildCost, layout: TokenLayout) -> int:
        """Draft nodes per tree this step may build (0: decode plainly); counts toward a probe."""
        cap = max(caps)
        if cap <= 0:
            return 0
        clear_loss = False  # drafting predicted well below plain decoding
        if self.curve is None:
            best = drafted = self._first_ceiling(caps, cost, build)
        else:
            drafted, drafted_rate = self._best_drafted_ceiling(caps, cost, build, layout)
            plain_rate = plain_decode_rate(len(caps), cost)
            best = drafted if drafted_rate > plain_rate else 0
            clear_loss = drafted_rate < CLEAR_LOSS * plain_rate
        chosen = best
        interval = self.plain_probe_interval if best == 0 else self.probe_interval
        if best < cap and self.num_narrow_steps >= interval:
            chosen = drafted if best == 0 else min(cap, 2 * best)
        self.probing = best == 0 and chosen > 0
        if best > 0 or not clear_loss:
            self.plain_probe_interval = self.probe_interval
        elif chosen > 0:
            self.plain_probe_interval = min(2 * self.plain_probe_interval, 16 * self.probe_interval)
        self.num_narrow_steps = 0 if chosen != best or chosen == cap else self.num_narrow_steps + 1
        return chosen

    def _best_drafted_ceiling(
        self, caps: Sequence[int], cost: StepCost, build: BuildCost, layout: TokenLayout
    ) -> tuple[int, float]:
        """The drafting ceiling with the best predicted rate, and that rate."""
        assert self.curve is not None
        batch_size, cap = len(caps), max(caps)
        draft_ms = cost.draft_ms(batch_size)
        best, best_rate = cap, 0.0
        for candidate in powers_of_two_upto(cap):
            capped = [min(c, candidate) for c in caps]
            step_draft_ms = draft_ms + float(build.ms(batch_size, sum(capped)))
            rate = shared_curve_rate(self.curve, capped, cost, draft_ms=step_draft_ms, layout=layout)
            if rate > best_rate:
                best, best_rate = candidate, rate
        return best, best_rate

    @staticmethod
    def _first_ceiling(caps: Sequence[int], cost: StepCost, build: BuildCost) -> int:
        """The first step knows no acceptance: the widest ceiling that costs at most
        `FIRST_STEP_PLAIN_STEPS` plain steps (at least 1), so learning the curve costs little
        where wide trees are dear (a CPU under load) and sees the whole cap where they are not."""
        batch_size = len(caps)
        plain_ms = float(cost.verify_ms(batch_size, batch_size))
        draft_ms = cost.draft_ms(batch_size)
        affordable = 1
        for candidate in powers_of_two_upto(max(caps)):
            capped = [min(c, candidate) for c in caps]
            step_ms = (
                draft_ms
                + float(build.ms(batch_size, sum(capped)))
                + float(cost.verify_ms(batch_size, batch_size * (candidate + 1)))
            )
            if step_ms <= FIRST_STEP_PLAIN_STEPS * plain_ms:
                affordable = candidate
        return affordable

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
