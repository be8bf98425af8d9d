"""How far each ceiling's predicted step time is from what its steps took, learned live.

The gate prices a ceiling from models: the cost curve's forwards, the build's fit, the step
overhead. What they leave out differs by ceiling and by machine: on the H200 a ceiling-16 step
at batch 32 took 7.2 ms where its parts predicted about 5 (the drafter's host launch grows with
its top-K, the host build and the verify walk with the nodes), and the same code on a host a
third slower ranks the fixed budgets differently. So the gate keeps, per (batch bucket,
ceiling), the recent median of measured over predicted step time, and divides each candidate's predicted
rate by it: a ceiling is judged by what its steps cost here, the models only rank the ones not
yet taken (at the nearest taken ceiling's ratio, so model and measurement are compared alike).

Step times are noisy (a descheduled process, a shared 2-core CI machine), and bad steps must
not turn the engine away from a ceiling it then never measures again: a ratio is the median of
its last `WINDOW` samples (on the CI CPU two plain steps at four times their prediction in a
row, an EMA's 1.8x, held the gate on drafting steps three times slower for the rest of a run:
the plain ratio is only measured while the gate decodes plainly), shrunk toward its bucket's
level (below) by its sample count, `n / (n + SHRINK_SAMPLES)`. What a ratio says also fades with
the steps since its last sample (half-life `STALE_HALF_LIFE_STEPS`): a ceiling the engine has
turned away from is tried again some time later, when load or host may have changed.

Both shrink and fade go toward the batch bucket's level (the median of its last samples, any
ceiling), not toward 1: part of what the models miss is the machine's, shared by every kind of
step (on the CI CPU plain steps ran 1.05-1.15x their prediction at batch 8). A ratio fading to
1 while the ceilings still taken kept theirs above it made the ceilings turned away from look
cheaper than they are, and the gate went back to steps it had measured as a loss. A ceiling
never taken at a bucket reads its nearest taken drafting ceiling's ratio, or the level.

The gate keeps a second table of the same kind for the tokens a drafted step made over the
tokens it forecast (`DraftGate.token_residual`), with the window's trimmed mean (its highest and
lowest samples dropped once it holds five) in place of its median: a step's accepted tokens are
skewed (at batch 1 mostly 1-4, sometimes 10), so their median sits below their mean and would
price drafting low where it wins by little, while one lucky step would move a plain mean of
seven by a seventh of its excess.
"""

import statistics
from collections import deque
from dataclasses import dataclass, field

MAX_RATIO = 4.0
"""A step counts as at most this many times its prediction (or its inverse)."""

WINDOW = 7
"""Recent samples a ratio is the median of: up to three outliers in a row leave it alone (a
table with `window_trees` keeps more at small batch buckets: `StepResidual`)."""

SHRINK_SAMPLES = 2.0
"""Pseudo-samples at the bucket's level behind every ratio: one step is a third of what it says."""

STALE_HALF_LIFE_STEPS = 64.0
"""Steps (of any ceiling) after which an unrefreshed ratio says half what it did."""


def batch_bucket(batch_size: int) -> int:
    """The power of two at or above `batch_size`: the batches one ratio speaks for."""
    return 1 << max(batch_size - 1, 0).bit_length()


@dataclass
class _Ratio:
    recent: deque[float]  # the last `WINDOW` samples
    samples: int
    last_step: int  # the residual's step count at its last sample
    center: float = 1.0  # the recent samples' median (or mean)

    def value(self, step: int, toward: float = 1.0) -> float:
        """The recent median (or mean), shrunk and faded toward `toward`."""
        trust = self.samples / (self.samples + SHRINK_SAMPLES)
        trust *= 0.5 ** ((step - self.last_step) / STALE_HALF_LIFE_STEPS)
        return toward + trust * (self.center - toward)

    def add(self, sample: float, step: int, mean: bool) -> None:
        self.recent.append(sample)
        self.samples += 1
        self.last_step = step
        # A few samples: no array round trip.
        if not mean:
            self.center = statistics.median(self.recent)
        elif len(self.recent) >= 5:
            self.center = statistics.fmean(sorted(self.recent)[1:-1])
        else:
            self.center = statistics.fmean(self.recent)


@dataclass
class StepResidual:
    """Measured / predicted step time per (batch bucket, ceiling); 1.0 where nothing is known.
    The same table serves made / forecast tokens (`mean`, module docstring): `observe`'s
    `predicted_ms` and `measured_ms` are then the step's forecast and made tokens.

    `frozen` keeps it at 1.0 (the models alone decide); `mean`: each ratio is its window's
    trimmed mean, not its median; `window_trees`: a batch bucket b below it keeps
    `window_trees // b` windows of samples, its ratios and its level alike (a step at batch 1
    is one request's tree)."""

    frozen: bool = False
    mean: bool = False
    window_trees: int = 1
    _ratios: dict[tuple[int, int], _Ratio] = field(default_factory=dict)
    _levels: dict[int, _Ratio] = field(default_factory=dict)  # per bucket, every ceiling's samples
    _steps: int = 0  # steps observed, any ceiling: the clock ratios go stale by

    def ratio(self, batch_size: int, ceiling: int) -> float:
        """The ratio of this ceiling at this batch, toward its bucket's level; a drafting
        ceiling not yet taken reads the nearest taken one's (in doublings) at the same batch
        bucket, or the level when there is none; a plain step only its own (1.0 without)."""
        bucket = batch_bucket(batch_size)
        level_samples = self._levels.get(bucket)
        level = 1.0 if level_samples is None else level_samples.value(self._steps)
        known = self._ratios.get((bucket, ceiling))
        if known is None and ceiling > 0:
            taken = [c for b, c in self._ratios if b == bucket and c > 0]
            if taken:
                nearest = min(taken, key=lambda c: (abs(c.bit_length() - ceiling.bit_length()), c))
                known = self._ratios[(bucket, nearest)]
        if known is None:  # a plain step never taken is not priced by the drafting steps' misses
            return level if ceiling > 0 else 1.0
        return known.value(self._steps, toward=level)

    def measured(self, batch_size: int, ceiling: int) -> bool:
        """Whether this ceiling's own steps at this batch bucket have taught its ratio (else
        `ratio` reads another ceiling's, or the bucket's level); a frozen table takes the models
        as measured everywhere."""
        return self.frozen or (batch_bucket(batch_size), ceiling) in self._ratios

    def age(self) -> None:
        """A step that teaches this table nothing: its ratios grow one step staler."""
        if not self.frozen:
            self._steps += 1

    def observe(
        self,
        batch_size: int,
        ceiling: int,
        predicted_ms: float,
        measured_ms: float,
        counterfactual: bool = False,
    ) -> None:
        """One step at `ceiling` (0: plain) over `batch_size` requests, predicted and measured.
        `counterfactual`: what a step at a wider ceiling says of this one (its trees' prefixes):
        it teaches this ceiling's ratio only, neither the bucket's level nor the clock (the step
        counts once, at the ceiling it ran)."""
        if predicted_ms <= 0.0 or measured_ms <= 0.0 or self.frozen:
            return  # nothing to learn from, or frozen
        if not counterfactual:
            self._steps += 1
        sample = min(max(measured_ms / predicted_ms, 1.0 / MAX_RATIO), MAX_RATIO)
        bucket = batch_bucket(batch_size)
        keys: list[tuple[dict, object]] = [(self._ratios, (bucket, ceiling))]
        if not counterfactual:
            keys.append((self._levels, bucket))
        for table, key in keys:
            ratio = table.get(key)
            if ratio is None:  # built only when missing: this runs every step
                window = WINDOW * max(1, self.window_trees // bucket)
                ratio = table[key] = _Ratio(deque(maxlen=window), 0, self._steps)
            ratio.add(sample, self._steps, self.mean)
