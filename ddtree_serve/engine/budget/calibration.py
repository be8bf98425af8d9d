"""The drafter's acceptance forecast, calibrated online against what verification accepts.

A best-first tree lists its nodes in non-increasing drafter probability `exp(logw)`, the chance
under the drafter's factorised distribution that the node's whole prefix is what the target
continues with; the sum over the first n nodes is the drafter's forecast of the accepted length
of an n-node tree. Drafters are rarely calibrated (and tree rejection sampling accepts a node
with a probability that also depends on its siblings), so the engine keeps, per probability
bin, how many verified nodes fell in the bin and how many of them were on the accepted path.

Bins are equal steps in logit(p) over [-8, 8], fine near 0 and near 1 where a confident
drafter's nodes crowd (0.99 and 0.9 are different forecasts). Each bin starts with
`prior_weight` pseudo-nodes (more in bins of rare acceptance: `PRIOR_ACCEPTS`) that accept at
the bin's centre probability scaled, in odds, by the
ratio of all accepted nodes to the drafter's forecast for them: before any data the calibrated
value is the drafter's, an empty bin never reads as "never accepted", and a drafter that is off
by a factor everywhere is corrected in a step or two instead of bin by bin (the bundled
drafter's raw forecast is about half what it accepts: bins left at its own word kept the
forecast at 0.7-0.8x of the truth for its first twenty steps, the window in which a gate decides
whether drafting pays).
Statistics decay by `decay` per observed step so the map follows a drifting workload. The bin
rates are made non-decreasing in probability (pool-adjacent-violators), and a node's calibrated
value interpolates them linearly: a monotone map keeps each tree's best-first order, so any
prefix stays ancestor-closed.
"""

import functools
from collections.abc import Callable

import numpy as np

from ddtree_serve.engine.budget.isotonic import isotonic_increasing

PRIOR_ACCEPTS = 1.0
"""A bin's prior is worth at least this many accepted nodes, not only `prior_weight` nodes:
where acceptance is rare, tens of verified nodes without a hit say little (at a 1% rate, 40
nodes miss every time two runs in three). With two pseudo-nodes the bundled drafter's nodes
below p = 0.01, verified 30-80 times without a hit in a cold sweep's first steps, read as never
accepted (0.0005), where a long fixed-64 run accepts 1.4% of the nodes at best-first positions
33-64 (drafter: 0.9%): the gate then priced every tree past 32 nodes at nothing, and the
adaptive engine kept ceiling 32 (c = 1) and 16 (c = 16) on the H200 where the wider fixed
budget made 3-15% more tokens a step."""

GLOBAL_PRIOR_NODES = 1.0
"""Pseudo-nodes behind the accepted-to-forecast ratio that scales the bins' prior (1 before data)."""

_LOGIT_LIMIT = 8.0  # bins span logit(p) in [-8, 8]: p from 3e-4 to 1 - 3e-4


class AcceptanceCalibrator:
    """Maps drafter node probabilities to the observed probability that verification accepts them."""

    def __init__(self, num_bins: int = 24, prior_weight: float = 2.0, decay: float = 0.995) -> None:
        if num_bins < 1 or prior_weight <= 0.0 or not 0.0 < decay <= 1.0:
            raise ValueError("need num_bins >= 1, prior_weight > 0 and decay in (0, 1]")
        self.num_bins = num_bins
        self.prior_weight = prior_weight
        self.decay = decay
        # Bin j holds logit(p) in [-8 + j w, -8 + (j + 1) w), w = 16 / num_bins; the end bins also
        # hold everything beyond.
        self._bin_width = 2 * _LOGIT_LIMIT / num_bins
        self._centres = _sigmoid(-_LOGIT_LIMIT + (np.arange(num_bins) + 0.5) * self._bin_width)  # [num_bins]
        # Per bin, decayed: verified nodes, those of them on the accepted path, and the sum of
        # their drafter probabilities (rows of one array: one decay, one update per step).
        self._stats = np.zeros((3, num_bins))
        self._table: tuple[np.ndarray, np.ndarray] | None = None  # (probs, rates), ascending

    def bin_index(self, drafter_probs: np.ndarray) -> np.ndarray:
        """Bin of each probability (0 and 1 included), ascending in p."""
        probs = np.clip(np.asarray(drafter_probs, dtype=np.float64), 1e-12, 1.0 - 1e-12)
        logits = np.log(probs) - np.log1p(-probs)
        bins = np.floor((logits + _LOGIT_LIMIT) / self._bin_width)
        return np.clip(bins, 0, self.num_bins - 1).astype(np.int64)

    def observe(self, drafter_probs: np.ndarray, accepted: np.ndarray, steps: int = 1) -> None:
        """The nodes of `steps` verify steps (any requests, root excluded) and whether each was
        accepted. The statistics decay by `decay ** steps` first; the nodes themselves count alike
        (within a few steps the decay between them is below a percent)."""
        probs = np.asarray(drafter_probs, dtype=np.float64).reshape(-1)
        hits = np.asarray(accepted, dtype=np.float64).reshape(-1)
        if probs.shape != hits.shape:
            raise ValueError(f"{probs.shape[0]} probabilities for {hits.shape[0]} outcomes")
        bins = self.bin_index(probs)
        self._stats *= self.decay**steps
        self._stats[0] += np.bincount(bins, minlength=self.num_bins)
        self._stats[1] += np.bincount(bins, weights=hits, minlength=self.num_bins)
        self._stats[2] += np.bincount(bins, weights=probs, minlength=self.num_bins)
        self._table = None

    def calibrate(self, drafter_probs: np.ndarray) -> np.ndarray:
        """Calibrated acceptance probability of each node: same shape, non-decreasing in p."""
        probs = np.asarray(drafter_probs, dtype=np.float64)
        table_probs, table_rates = self._interpolation_table()
        return np.interp(probs, table_probs, table_rates)

    def frozen(self) -> Callable[[np.ndarray], np.ndarray]:
        """`calibrate` as the map stands now, kept through later refits: a forecast worked out
        after more lessons still reads the map its step was chosen with."""
        table_probs, table_rates = self._interpolation_table()
        return functools.partial(np.interp, xp=table_probs, fp=table_rates)

    def expected_accepted(self, drafter_probs: np.ndarray) -> float:
        """Expected accepted draft tokens of a tree holding nodes of these probabilities."""
        return float(self.calibrate(drafter_probs).sum())

    def refresh(self) -> None:
        """Rebuild the calibrated map now (else the next `calibrate` does, on its own time)."""
        self._interpolation_table()

    def _interpolation_table(self) -> tuple[np.ndarray, np.ndarray]:
        if self._table is None:
            num_nodes, num_accepted, prob_sum = self._stats
            prior_rates = self._prior_rates()
            prior_nodes = np.maximum(self.prior_weight, PRIOR_ACCEPTS / prior_rates)
            weights = num_nodes + prior_nodes
            mean_probs = (prob_sum + prior_nodes * self._centres) / weights
            rates = (num_accepted + prior_nodes * prior_rates) / weights
            monotone = np.clip(isotonic_increasing(rates, weights), 0.0, 1.0)  # bins ascend in p already
            # Anchored at (0, 0): a node the drafter gives no chance is never counted on.
            self._table = (np.concatenate(([0.0], mean_probs)), np.concatenate(([0.0], monotone)))
        return self._table

    def _prior_rates(self) -> np.ndarray:
        """Each bin's prior acceptance: its centre probability, its odds scaled by the drafter's
        accepted nodes over its forecast for them so far."""
        scale = (self._stats[1].sum() + GLOBAL_PRIOR_NODES) / (self._stats[2].sum() + GLOBAL_PRIOR_NODES)
        odds = self._centres / (1.0 - self._centres) * scale
        return odds / (1.0 + odds)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))
