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

from ddtree_serve.engine.budget.allocator import StepCost, TokenLayout, ceiling_rates, plain_decode_rate
from ddtree_serve.engine.budget.build_cost import BuildCost
from ddtree_serve.engine.budget.measure import powers_of_two_upto
from ddtree_serve.engine.budget.step_overhead import StepOverhead

FIRST_STEP_PLAIN_STEPS = 4.0
"""What the first drafted step may cost, in plain decode steps, before anything is known."""

RECHECK_SHIFT = 0.05
"""A plain streak decides again once its plain step's predicted price moved this much (a share)."""

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
        # (batch size, cap) of the plain streak under way (None while drafting) and the plain
        # step's price when it was decided: see `ceiling`.
        self._plain_streak: tuple[int, int] | None = None
        self._plain_streak_ms = 0.0

    def ceiling(
        self,
        caps: Sequence[int],
        cost: StepCost,
        build: BuildCost,
        layout: TokenLayout,
        overhead: StepOverhead | None = None,
    ) -> int:
        """Draft nodes per tree this step may build (0: decode plainly); counts toward a probe.

        `overhead`: each kind of step's host work besides its priced parts (default: none)."""
        overhead = overhead or StepOverhead()
        cap = max(caps)
        if cap <= 0:
            return 0
        plain_ms = float(cost.verify_ms(len(caps), len(caps))) + overhead.plain_ms
        streak = (len(caps), cap)
        if (
            streak == self._plain_streak
            and self.num_narrow_steps < self.plain_probe_interval
            and abs(plain_ms - self._plain_streak_ms) <= RECHECK_SHIFT * self._plain_streak_ms
        ):
            # A plain streak over the same batch decides again when its probe is due or its
            # step's price moved: without a draft the curve stands still, and on a fast target
            # the whole decision would cost a tenth of the plain step.
            self.num_narrow_steps += 1
            self.probing = False
            return 0
        clear_loss = False  # drafting predicted well below plain decoding
        if self.curve is None:
            best = drafted = self._first_ceiling(caps, cost, build, overhead)
        else:
            drafted, drafted_rate = self._best_drafted_ceiling(caps, cost, build, layout, overhead)
            plain_rate = plain_decode_rate(len(caps), cost, overhead.plain_ms)
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
        self._plain_streak = streak if chosen == 0 else None
        self._plain_streak_ms = plain_ms
        return chosen

    def _best_drafted_ceiling(
        self,
        caps: Sequence[int],
        cost: StepCost,
        build: BuildCost,
        layout: TokenLayout,
        overhead: StepOverhead,
    ) -> tuple[int, float]:
        """The drafting ceiling with the best predicted rate, and that rate."""
        assert self.curve is not None
        batch_size = len(caps)
        candidates = powers_of_two_upto(max(caps))
        nodes_built = _nodes_built(caps, candidates)
        draft_ms = cost.draft_ms(batch_size) + overhead.drafted_ms + build.ms(batch_size, nodes_built)
        rates = ceiling_rates(self.curve, caps, candidates, cost, draft_ms=draft_ms, layout=layout)
        best = int(np.argmax(rates))  # the first (narrowest) of equal rates
        return candidates[best], float(rates[best])

    @staticmethod
    def _first_ceiling(caps: Sequence[int], cost: StepCost, build: BuildCost, overhead: StepOverhead) -> int:
        """The first step knows no acceptance: the widest ceiling that costs at most
        `FIRST_STEP_PLAIN_STEPS` plain steps (at least 1), so learning the curve costs little
        where wide trees are dear (a CPU under load) and sees the whole cap where they are not."""
        batch_size = len(caps)
        plain_ms = float(cost.verify_ms(batch_size, batch_size)) + overhead.plain_ms
        draft_ms = cost.draft_ms(batch_size) + overhead.drafted_ms
        candidates = powers_of_two_upto(max(caps))
        nodes_built = _nodes_built(caps, candidates)
        affordable = 1
        for candidate, nodes in zip(candidates, nodes_built, strict=True):
            step_ms = (
                draft_ms
                + float(build.ms(batch_size, nodes))
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


def _nodes_built(caps: Sequence[int], ceilings: Sequence[int]) -> np.ndarray:
    """Draft nodes the build makes over the batch at each ceiling: each request up to its cap."""
    return np.minimum(np.asarray(caps)[None, :], np.asarray(ceilings)[:, None]).sum(axis=1)
