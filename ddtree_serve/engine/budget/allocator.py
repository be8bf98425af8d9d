"""The per-step choice of tree sizes across the batch: nodes where they are most likely accepted.

Each running request offers candidate nodes in its best-first order, each with a calibrated
acceptance probability (non-increasing along the order, so any prefix is an ancestor-closed
tree). A step emits, per request, its accepted nodes plus one bonus token, and costs the
drafter's call plus one verify forward. The allocator maximises predicted tokens per second:

- `layout="packed"` (the target processes sum of tree sizes): pool every request's candidates,
  add them in descending probability and keep the prefix of that order with the highest
  predicted rate. Where the rate rises and then falls this is "add while it keeps rising"; on a
  stepped cost curve (kernel or graph buckets) it does not stop at the first dip.
- `layout="padded"` (the engine pads every tree to the widest, so the forward costs
  `batch * widest`): nodes below the widest tree are free, so the best allocation gives every
  request min(width, its cap) nodes; the allocator tries each width and keeps the best.

Either way the allocator keeps the widest option whose predicted rate is within `TRIM_MIN_GAIN`
of the best (`widest_near_best`): it cuts nodes only for a clear predicted gain.

Losslessness does not depend on the choice: it is made from drafter outputs only, before the
target draws any coin, and every tree verified is a prefix of a valid best-first tree.
"""

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

TokenLayout = Literal["packed", "padded"]

TRIM_MIN_GAIN = 0.03
"""The allocator keeps fewer nodes than the widest option only where that is predicted to raise
the step's rate by more than this share. Near its best the predicted rate is flat (on the CI CPU
at batch 4, widths 7 and 8 of ceiling 8 within 0.3%), so the choice there rests on the cost
curve's shape between its grid points, a few start-up timings: it priced 12 more target tokens
at 1.45 ms where fixed-8's steps took 0.3 ms more than the adaptive ones it had cut to width 5,
which made 9% fewer tokens (10.8 against 11.9 a step). The tokens a cut gives up are the
calibrated forecast's (within 2% of what verification accepted there); the time it saves is the
curve's interpolation, and the gate's measured ratios price a ceiling by the trees it built."""


class StepCost(Protocol):
    """What `allocate` needs from a cost model (`CostCurve` is one)."""

    def verify_ms(self, batch_size: int, target_tokens: np.ndarray | float) -> np.ndarray: ...

    def draft_ms(self, batch_size: int) -> float: ...


Forecast = tuple[float, ...] | Callable[[], tuple[float, ...]]
"""Calibrated expected accepted draft tokens per request, or how to work them out when first read."""


def forecast_values(forecast: Forecast) -> tuple[float, ...]:
    """A forecast's figures (a lazy one worked out now)."""
    return forecast() if callable(forecast) else forecast


@dataclass(frozen=True)
class Allocation:
    """Draft nodes per request (root excluded; 0 = root only) and what the choice predicts."""

    num_nodes: tuple[int, ...]
    # Calibrated expected accepted draft tokens per request, or how to work them out when first
    # read (`expected_accepted`): a settled step's choice leaves them to whoever reads them.
    forecast: Forecast = field(repr=False)
    step_ms: float  # predicted drafter + verify milliseconds

    @functools.cached_property
    def expected_accepted(self) -> tuple[float, ...]:
        """Calibrated expected accepted draft tokens per request."""
        return forecast_values(self.forecast)

    @property
    def expected_tokens(self) -> float:
        """Tokens the step is predicted to emit: accepted drafts plus one bonus per request."""
        return sum(self.expected_accepted) + len(self.num_nodes)

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.expected_tokens / self.step_ms


def allocate(
    accept_probs: Sequence[np.ndarray],
    caps: Sequence[int],
    cost: StepCost,
    *,
    draft_ms: float,
    layout: TokenLayout = "padded",
) -> Allocation:
    """Choose each request's tree size.

    `accept_probs[i]`: request i's calibrated acceptance probabilities in its best-first order
    (made non-increasing here, so a request's share is always a prefix). `caps[i]`: most draft
    nodes request i may verify (its `draft_budget`, the engine budget). `draft_ms`: the drafter's
    cost of this step, counted in every option (0 when it is not part of the choice).
    """
    if len(accept_probs) != len(caps) or not caps:
        raise ValueError("need one cap per request and at least one request")
    probs = [_non_increasing(p)[: max(int(c), 0)] for p, c in zip(accept_probs, caps, strict=True)]
    if layout == "packed":
        return _allocate_packed(probs, cost, draft_ms)
    return _allocate_padded(probs, cost, draft_ms)


def ceiling_rates(
    curve: np.ndarray,
    caps: Sequence[int],
    ceilings: Sequence[int],
    cost: StepCost,
    *,
    draft_ms: np.ndarray,
    layout: TokenLayout,
) -> tuple[np.ndarray, np.ndarray]:
    """Best predicted tokens/s of each candidate ceiling when every request's candidates follow
    one acceptance `curve`, and the predicted step milliseconds of that best choice: for ceiling
    `c`, `allocate([curve] * B, [min(cap, c) for cap in caps], draft_ms=draft_ms[j])`'s
    `tokens_per_s` and `step_ms`. `draft_ms[j]`: the drafter's call and the build at ceiling j.
    The gate asks this every step, so on the padded layout it is one pass for all ceilings: a
    width `w` within a ceiling gains the same accepted tokens under any larger one (and costs
    the same forward), so only each ceiling's fixed cost and its widest width differ.
    """
    draft_ms = np.asarray(draft_ms, dtype=np.float64)
    if layout == "packed":
        allocations = [
            allocate([curve] * len(caps), [min(c, ceiling) for c in caps], cost, draft_ms=d, layout=layout)
            for ceiling, d in zip(ceilings, draft_ms, strict=True)
        ]
        return np.array([a.tokens_per_s for a in allocations]), np.array([a.step_ms for a in allocations])
    batch_size = len(caps)
    shared = _non_increasing(curve)
    lengths = np.minimum(np.maximum(np.asarray(caps, dtype=np.int64), 0), len(shared))  # [B]
    widths = np.arange(int(lengths.max(initial=0)) + 1)  # draft nodes of the widest tree
    cumulative = np.concatenate(([0.0], np.cumsum(shared)))
    expected = batch_size + cumulative[np.minimum(widths[None, :], lengths[:, None])].sum(axis=0)  # [W]
    forward_ms = cost.verify_ms(batch_size, batch_size * (widths + 1))  # [W]
    within = widths[None, :] <= np.asarray(ceilings, dtype=np.int64)[:, None]  # [C, W]
    step_ms = draft_ms[:, None] + forward_ms  # [C, W]
    rates = np.where(within, expected / step_ms, -np.inf)
    best = widest_near_best(rates)
    rows = np.arange(len(ceilings))
    return 1000.0 * rates[rows, best], step_ms[rows, best]


def widest_near_best(rates: np.ndarray) -> np.ndarray:
    """Along the last axis (options from narrowest to widest; -inf: not an option), the index of
    the widest option whose rate is at least (1 - `TRIM_MIN_GAIN`) of the best."""
    near = rates >= (1.0 - TRIM_MIN_GAIN) * rates.max(axis=-1, keepdims=True)
    return rates.shape[-1] - 1 - np.argmax(near[..., ::-1], axis=-1)


def plain_decode_rate(batch_size: int, cost: StepCost, overhead_ms: float = 0.0) -> float:
    """Tokens per second of a step that skips the drafter: one token per request, root-only trees.
    `overhead_ms`: the step's host work besides the verify call."""
    return 1000.0 * batch_size / (float(cost.verify_ms(batch_size, batch_size)) + overhead_ms)


def _allocate_packed(probs: list[np.ndarray], cost: StepCost, draft_ms: float) -> Allocation:
    batch_size = len(probs)
    pooled = np.concatenate([np.zeros(0), *probs])  # [total]
    owner = np.concatenate([np.zeros(0, dtype=np.int64), *[np.full(len(p), i) for i, p in enumerate(probs)]])
    order = np.argsort(-pooled, kind="stable")  # ties: earlier request, earlier node first
    expected = batch_size + np.concatenate(([0.0], np.cumsum(pooled[order])))  # [total + 1]
    target_tokens = batch_size + np.arange(len(pooled) + 1)  # roots + chosen nodes
    rates = expected / (draft_ms + cost.verify_ms(batch_size, target_tokens))
    best = int(widest_near_best(rates))
    num_nodes = np.bincount(owner[order[:best]], minlength=batch_size)
    return _allocation(probs, num_nodes, draft_ms + float(cost.verify_ms(batch_size, target_tokens[best])))


def _allocate_padded(probs: list[np.ndarray], cost: StepCost, draft_ms: float) -> Allocation:
    rows = np.zeros((len(probs), max(len(p) for p in probs)))
    for i, p in enumerate(probs):
        rows[i, : len(p)] = p
    return allocate_padded_rows(rows, np.array([len(p) for p in probs]), cost, draft_ms=draft_ms)


def allocate_padded_rows(
    probs: np.ndarray,
    lengths: np.ndarray,
    cost: StepCost,
    *,
    draft_ms: float,
    token_buckets: Sequence[int] | None = None,
    ordered: bool = False,
    whole: bool = False,
) -> Allocation:
    """`allocate(..., layout="padded")` for a batch held as one matrix: the engine's per-step
    path, without per-request work. `probs [B, W]`: each request's calibrated acceptance
    probabilities in best-first order; only the first `lengths[b]` of row b count (its built
    tree, cut at its cap). `ordered`: the rows are already non-increasing in [0, 1] and zero
    past `lengths` (calibrated trees no cap cuts), so they are taken as they are.

    `token_buckets`: the tree tokens a graphed verify pads to. Its padding runs nodes up to the
    bucket anyway, so each candidate width is priced as its bucket (the forward it really runs)
    and filled up to `bucket - 1` nodes for every request whose tree and cap have them: the
    widths the engine verifies fall on the buckets, and none looks cheaper than its graph.
    `whole`: no choice, every request keeps its first `lengths[b]` nodes (the widest width).
    """
    batch_size, width = probs.shape
    if not ordered:
        usable = np.arange(width) < lengths[:, None]
        probs = np.minimum.accumulate(np.clip(probs, 0.0, 1.0), axis=1) * usable
    cumulative = np.concatenate((np.zeros((batch_size, 1)), np.cumsum(probs, axis=1)), axis=1)  # [B, W + 1]
    buckets = None if token_buckets is None else tuple(token_buckets)
    widths = _candidate_widths(int(lengths.max(initial=0)), buckets)
    if whole:
        widths = widths[-1:]
    expected = batch_size + cumulative.sum(axis=0)[np.minimum(widths, width)]
    step_ms = draft_ms + cost.verify_ms(batch_size, batch_size * (widths + 1))
    best = int(widest_near_best(expected / step_ms))
    num_nodes = np.minimum(widths[best], lengths)
    return Allocation(
        num_nodes=tuple(num_nodes.tolist()),
        forecast=tuple(cumulative[np.arange(batch_size), num_nodes].tolist()),
        step_ms=float(step_ms[best]),
    )


@functools.lru_cache(maxsize=256)
def _candidate_widths(max_width: int, token_buckets: tuple[int, ...] | None) -> np.ndarray:
    """The widths (draft nodes of the widest tree) worth pricing, ascending: every one up to
    `max_width` eagerly; on a graphed verify each filled to its bucket (`bucket - 1` nodes; past
    the last bucket, itself), duplicates dropped (a duplicate has the same price and gain, so
    the narrowest best width is the same). Cached: the engine asks for the same few each step."""
    widths = np.arange(max_width + 1)
    if token_buckets is not None:
        buckets = np.asarray(token_buckets)
        index = np.minimum(np.searchsorted(buckets, widths + 1), len(buckets) - 1)
        widths = np.unique(np.maximum(buckets[index], widths + 1) - 1)
    widths.setflags(write=False)
    return widths


def _allocation(probs: list[np.ndarray], num_nodes: np.ndarray, step_ms: float) -> Allocation:
    return Allocation(
        num_nodes=tuple(int(n) for n in num_nodes),
        forecast=tuple(float(p[:n].sum()) for p, n in zip(probs, num_nodes, strict=True)),
        step_ms=step_ms,
    )


def _non_increasing(values: np.ndarray) -> np.ndarray:
    return np.minimum.accumulate(np.clip(np.asarray(values, dtype=np.float64).reshape(-1), 0.0, 1.0))
