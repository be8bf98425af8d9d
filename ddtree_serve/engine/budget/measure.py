"""The start-up cost calibration: time verify and draft calls over a grid of shapes.

`measure_cost_curve` takes a `CostProbe`, something that can run one verify forward of a given
batch and tree width and one drafter call of a given batch and say how long each took; the
engine's probe (`ModelCostProbe`) runs them through its `Target` and `Drafter` on scratch
slots. Each shape is run once to warm up, then `repeats` times; the fastest run is kept (other
work on the machine only ever adds time), and each batch row is made non-decreasing in tokens
(a least-squares monotone fit), so one slow outlier cannot make a larger tree look cheaper.
`measure_build_cost` times the host build stage the same way (`BuildProbe`; the engine's probe
builds from a real draft) and fits its `BuildCost` (linear per builder).
"""

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from ddtree_serve.engine.budget.build_cost import BuildCost
from ddtree_serve.engine.budget.cost_curve import CostCurve
from ddtree_serve.engine.budget.isotonic import isotonic_increasing
from ddtree_serve.engine.interfaces import (
    ContextSlice,
    Drafter,
    DraftInput,
    DraftOutput,
    PrefillInput,
    SamplingBatch,
    Target,
    VerifyInput,
)
from ddtree_serve.engine.tree_builder import build_host_tree_batch
from ddtree_serve.tree import build_chain, build_verify_batch


class CostProbe(Protocol):
    def verify_ms(self, batch_size: int, tree_nodes: int) -> float:
        """Milliseconds of one verify of `batch_size` trees of `tree_nodes` nodes (root included)."""
        ...

    def draft_ms(self, batch_size: int) -> float:
        """Milliseconds of one drafter call for `batch_size` requests."""
        ...


class BuildProbe(Protocol):
    def build_ms(self, batch_size: int, ceiling: int) -> float:
        """Milliseconds of the host build of `batch_size` trees of up to `ceiling` draft nodes."""
        ...


def measure_cost_curve(
    probe: CostProbe, batch_sizes: Sequence[int], tree_nodes: Sequence[int], repeats: int = 3
) -> CostCurve:
    """A grid over `batch_sizes` x target tokens (`batch * tree_nodes`, the padded verify width)."""
    token_counts = sorted({b * n for b in batch_sizes for n in tree_nodes})
    grid = np.empty((len(batch_sizes), len(token_counts)))
    draft_ms = []
    for row, batch_size in enumerate(batch_sizes):
        tokens, row_ms = [], []
        for nodes in tree_nodes:
            probe.verify_ms(batch_size, nodes)
            tokens.append(batch_size * nodes)
            row_ms.append(min(probe.verify_ms(batch_size, nodes) for _ in range(repeats)))
        order = np.argsort(tokens)
        fitted = isotonic_increasing(np.array(row_ms)[order], np.ones(len(tokens)))
        # Token counts this row did not measure: interpolated, held below, flat above its range.
        grid[row] = np.interp(token_counts, np.array(tokens, dtype=np.float64)[order], fitted)
        probe.draft_ms(batch_size)
        draft_ms.append(min(probe.draft_ms(batch_size) for _ in range(repeats)))
    return CostCurve(batch_sizes, token_counts, grid, draft_ms=draft_ms)


def measure_build_cost(
    probe: BuildProbe, batch_sizes: Sequence[int], ceilings: Sequence[int], repeats: int = 3
) -> BuildCost:
    """`BuildCost` fitted over `batch_sizes` x `ceilings`; each shape warmed once, fastest kept."""
    points = []
    for batch_size in batch_sizes:
        for ceiling in ceilings:
            probe.build_ms(batch_size, ceiling)
            fastest = min(probe.build_ms(batch_size, ceiling) for _ in range(repeats))
            points.append((batch_size, batch_size * ceiling, ceiling, fastest))
    return BuildCost.fit(points)


class ModelCostProbe:
    """Times the engine's own `Target` and `Drafter` calls on scratch slots, before serving.

    Each timed call gets freshly prefilled slots (a short dummy prompt, not timed) and releases
    them afterwards, so the probe leaves every slot empty. Both calls return host tensors, so
    the wall clock covers the device work (and, over Ray, the transport). Without a `drafter`
    (an engine in mode "ar") only the verify is probed.
    """

    def __init__(self, target: Target, drafter: Drafter | None, top_k: int, prompt_tokens: int = 8) -> None:
        self.target = target
        self.drafter = drafter
        self.top_k = top_k
        self.prompt = [t % target.vocab_size for t in range(1, prompt_tokens + 1)]
        self._drafts: dict[int, DraftOutput] = {}  # batch size -> a real draft to build from

    def build_ms(self, batch_size: int, ceiling: int) -> float:
        """The engine's host build (its trees, then the padded verify buffers) on a real draft."""
        if batch_size not in self._drafts:
            self._drafts[batch_size] = self._timed_draft(list(range(batch_size)))[0]
        draft = self._drafts[batch_size]
        started = time.perf_counter()
        build_host_tree_batch(draft.logp, draft.ids, [ceiling] * batch_size, [0] * batch_size).verify_batch()
        return 1000.0 * (time.perf_counter() - started)

    def verify_ms(self, batch_size: int, tree_nodes: int) -> float:
        slots = list(range(batch_size))
        self._prefill(slots)
        chain = build_chain(np.zeros(tree_nodes - 1, dtype=np.int64), 0)  # tree_nodes incl. root
        inputs = VerifyInput(
            slots, build_verify_batch([chain] * batch_size), _greedy(batch_size), None, None, False
        )
        started = time.perf_counter()
        self.target.verify_and_commit(inputs)
        elapsed_ms = 1000.0 * (time.perf_counter() - started)
        self._release(slots)
        return elapsed_ms

    def draft_ms(self, batch_size: int) -> float:
        return self._timed_draft(list(range(batch_size)))[1]

    def _timed_draft(self, slots: list[int]) -> tuple[DraftOutput, float]:
        """One drafter call over freshly prefilled `slots` (released after), and its milliseconds."""
        if self.drafter is None:
            raise ValueError("a probe without a drafter times no draft")
        prefill = self._prefill(slots)
        contexts = [(ContextSlice(prefill.context, i),) for i in range(len(slots))]
        inputs = DraftInput(slots, prefill.first_tokens, contexts, self.top_k)
        started = time.perf_counter()
        draft = self.drafter.draft(inputs)
        elapsed_ms = 1000.0 * (time.perf_counter() - started)
        self._release(slots)
        return draft, elapsed_ms

    def _prefill(self, slots: list[int]):
        return self.target.prefill(PrefillInput(slots, [self.prompt] * len(slots), _greedy(len(slots)), None))

    def _release(self, slots: list[int]) -> None:
        """Both sides of each slot, a verify's too: a served target's prefill delivers the slot's
        context features to the drafter's worker, which keeps them until a draft takes them or
        the slot is released (left there, the next draft of the slot found 29 deliveries for its
        one context slice, and the served engine's start-up calibration failed)."""
        for slot in slots:
            self.target.release(slot)
            if self.drafter is not None:
                self.drafter.release(slot)


def _greedy(batch_size: int) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.zeros(batch_size),
        top_k=torch.zeros(batch_size, dtype=torch.int64),
        top_p=torch.ones(batch_size),
        all_greedy=True,
    )


def buckets_upto(buckets: Sequence[int], limit: int) -> list[int]:
    """The buckets below `limit`, then `limit` itself: a graphed target's calibration points."""
    return [*(b for b in buckets if b < limit), limit]


def powers_of_two_upto(limit: int) -> list[int]:
    """1, 2, 4, ... below `limit`, then `limit` itself: the default calibration buckets."""
    values = [1 << i for i in range(limit.bit_length()) if 1 << i < limit]
    return [*values, limit]
