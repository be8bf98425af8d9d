"""What a ceiling's nodes past the next narrower one make, over what the forecast said.

The gate prices a ceiling wider than the one it takes from the taken one's measured tokens plus
the forecast of the further nodes (`DraftGate._drafted_ceilings`). The forecast of those deep,
unlikely nodes is where it errs most: on an H100 at batch 1 the forecast put ceiling 64 at
+6% tokens over 32, where fixed-64's steps made +13-14%, so the gate took 16 and 32 in turn and
never 64, the best fixed budget there (0.86-0.94 of it). Every step at a ceiling measures the
gain of each doubling below it on the same text (its trees' prefixes are the narrower trees:
`AdaptiveBudget._tokens_within`), so the gate keeps, per (batch bucket, ceiling), the gain its
steps made over the gain forecast, and scales the further nodes' forecast by it. On the virtual
H100 run in bfloat16 (`bench/virtual_device.py`; its steps make the H100's tokens at c = 4 to
the hundredth) c = 4 rose from 0.91-0.94 of the best fixed budget to 0.93-0.96 in three paired
sweeps, the other levels and the CI CPU level within their noise. No GPU has measured it yet.

A doubling's gain is mostly zero in a step (at batch 1 a quarter of a token forecast, zero or
one made), so the ratio is one of sums over a window of steps, not a mean of per-step ratios,
and it starts at 1 (the forecast as it is) behind `PRIOR_TOKENS` of forecast gain.

The ratio is read as at least 1: it prices ceilings wider than the one taken, which are measured
again only at their probes, so a low ratio, once learned, would hold the gate away from the steps
that would correct it, while a high one leads to them. Read both ways, on held-out text on the
virtual H100 (`bench/virtual_device.py`) c = 4 fell from 0.95-0.98 of the best fixed budget to
0.92-0.93 (the gate held 8-16 where 64 wins); read as at least 1, 0.96.
"""

import itertools
from collections import deque
from dataclasses import dataclass, field

from ddtree_serve.engine.budget.step_residual import MAX_RATIO, batch_bucket

WINDOW_STEPS = 32
"""Steps a doubling's ratio is summed over."""

PRIOR_TOKENS = 2.0
"""Forecast gain, at ratio 1, behind every doubling's measured sums: a few lucky steps at batch 1
move it a little, a window at batch 16 mostly by what it measured."""


@dataclass
class MarginalGain:
    """Per (batch bucket, ceiling): made over forecast tokens of its nodes past the next narrower
    ceiling's."""

    _windows: dict[tuple[int, int], deque[tuple[float, float]]] = field(default_factory=dict)

    def observe(self, batch_size: int, made: dict[int, float], forecast: dict[int, float]) -> None:
        """One step's tokens made and forecast at the ceiling it ran and each power of two below
        (the keys both have): each ceiling learns its gain over the next narrower one's."""
        bucket = batch_bucket(batch_size)
        ceilings = sorted(c for c in made if c in forecast)
        for narrower, ceiling in itertools.pairwise(ceilings):
            window = self._windows.get((bucket, ceiling))
            if window is None:
                window = self._windows[(bucket, ceiling)] = deque(maxlen=WINDOW_STEPS)
            gain = max(forecast[ceiling] - forecast[narrower], 0.0)
            window.append((gain, made[ceiling] - made[narrower]))

    def ratio(self, batch_size: int, ceiling: int) -> float:
        """Made over forecast gain of `ceiling` over the next narrower candidate at this batch, at
        least 1 (module docstring; 1.0: unknown)."""
        window = self._windows.get((batch_bucket(batch_size), ceiling))
        if not window:
            return 1.0
        forecast = PRIOR_TOKENS + sum(gain for gain, _ in window)
        made = PRIOR_TOKENS + sum(gain for _, gain in window)
        return min(max(made / forecast, 1.0), MAX_RATIO)
