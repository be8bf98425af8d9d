"""`build_ddtree` for a whole batch at once: the heap's pops, taken in lockstep across requests.

The heap builder spends a few microseconds of Python per node, so a step of 64 requests with
32-node trees spends milliseconds building them. Here every request's frontier is one row of a
[B, F] array and each iteration pops one node from every row with a handful of array
operations: the cost grows with the largest budget, hardly with the batch.

Same trees, node for node. A pop takes the row's largest frontier logw, as the heap does; the
heap breaks an exact tie by rank path, and a row whose frontier holds a tie at its maximum (or
whose draft has a non-finite log-prob) is rebuilt by the heap builder instead. Candidates'
logws are the heap's float sums (a sibling: parent + edge; a child: popped + edge).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ddtree_serve.tree.ddtree import build_ddtree
from ddtree_serve.tree.tree_batch import TreeBatch

LOCKSTEP_BREAK_EVEN = 20
"""Requests at the largest budget above which the lockstep build beats one heap per request:
a lockstep pop costs about as much array work as this many heap pops (measured on the 2-core
CPU: ~35 us against ~1.7 us at batch 64, budget 32)."""


def lockstep_pays(total_budget: Any, largest_budget: Any) -> Any:
    """Whether a batch whose budgets sum to `total_budget` (largest `largest_budget`) is built
    in lockstep (scalars or arrays): the rule `build_host_tree_batch` and the build's price share."""
    return np.asarray(total_budget) > LOCKSTEP_BREAK_EVEN * np.asarray(largest_budget)


def build_ddtrees(
    logp: np.ndarray, ids: np.ndarray, budgets: Sequence[int], root_tokens: Sequence[int]
) -> TreeBatch:
    """Row b: `build_ddtree(logp[b, :, :budgets[b]], ids[b, :, :budgets[b]], budgets[b],
    root_tokens[b])`, as a `TreeBatch` padded to the largest budget.

    `logp`, `ids`: [B, L, K] host arrays, log-probs descending along K.
    """
    batch_size, num_levels, num_ranks = logp.shape
    budget = np.maximum(np.asarray(budgets, dtype=np.int64), 0)
    if num_levels == 0 or num_ranks == 0:
        return TreeBatch.root_only(root_tokens)
    budget_max = int(budget.max(initial=0))
    width = budget_max + 1
    # Edge log-probs in float64 (the heap adds Python floats), padded with -inf: one level past
    # the last (no child there) and one rank past each request's last usable one (no sibling),
    # so a missing candidate is an -inf sum instead of a branch.
    edges = np.full((batch_size, num_levels + 1, num_ranks + 1), -np.inf)
    usable = np.arange(num_ranks) < budget[:, None, None]  # request b reads its first budget ranks
    edges[:, :num_levels, :num_ranks] = np.where(usable, logp, -np.inf)
    unsure = ~np.isfinite(logp).all(axis=(1, 2))  # rebuilt by the heap builder

    # Node t of row b sits at flat index b * width + t; so does frontier slot t, which holds
    # node t's next unpopped child (slot 0: the root's). A pop leaves its slot to the popped
    # node's next sibling. -inf marks an empty slot.
    depths = np.zeros((batch_size, width), dtype=np.int64)
    parents = np.full((batch_size, width), -1, dtype=np.int64)
    ranks = np.zeros((batch_size, width), dtype=np.int64)
    logws = np.zeros((batch_size, width))
    num_nodes = np.ones(batch_size, dtype=np.int64)
    frontier_logw = np.full((batch_size, width), -np.inf)
    frontier_depth = np.ones((batch_size, width), dtype=np.int64)  # of the slot's next child
    frontier_rank = np.zeros((batch_size, width), dtype=np.int64)
    frontier_logw[:, 0] = np.where(budget > 0, edges[:, 0, 0], -np.inf)
    flat_frontier_logw, flat_frontier_depth = frontier_logw.reshape(-1), frontier_depth.reshape(-1)
    flat_frontier_rank, flat_logws, flat_edges = (
        frontier_rank.reshape(-1),
        logws.reshape(-1),
        edges.reshape(-1),
    )
    row_starts = np.arange(batch_size) * width
    level_stride = num_ranks + 1
    # Flat edge index of (row, depth d, rank 0) is edge_bases + d * level_stride (d = 1 -> level 0).
    edge_bases = np.arange(batch_size) * (num_levels + 1) * level_stride - level_stride
    for step in range(1, width):
        local = frontier_logw.argmax(axis=1)  # also the popped node's parent
        slot = row_starts + local
        best = flat_frontier_logw.take(slot)
        active = best > -np.inf
        if step > budget.min():
            active &= step <= budget
        if not active.any():
            break
        unsure |= active & ((frontier_logw == best[:, None]).sum(axis=1) > 1)
        depth, rank = flat_frontier_depth.take(slot), flat_frontier_rank.take(slot)
        parents[:, step], depths[:, step], ranks[:, step], logws[:, step] = local, depth, rank, best
        num_nodes += active

        # The popped slot takes the next sibling, the new slot `step` the first child. (A row
        # past its tree reads clipped indices: its values are never used.)
        level = edge_bases + depth * level_stride
        sibling_logw = flat_logws.take(slot) + flat_edges.take(level + rank + 1, mode="clip")
        flat_frontier_logw[slot] = np.where(active, sibling_logw, -np.inf)
        flat_frontier_rank[slot] = rank + 1
        frontier_logw[:, step] = best + flat_edges.take(level + level_stride, mode="clip")
        frontier_depth[:, step] = depth + 1

    # Past a row's tree the planes hold whatever its empty frontier gave: clip to index safely.
    node_level = np.clip(depths - 1, 0, num_levels - 1)
    tokens = ids[np.arange(batch_size)[:, None], node_level, np.minimum(ranks, num_ranks - 1)].astype(
        np.int64
    )
    tokens[:, 0] = np.asarray(root_tokens, dtype=np.int64)
    for row in np.flatnonzero(unsure & (budget > 0)).tolist():
        cut = int(budget[row])
        tree = build_ddtree(logp[row, :, :cut], ids[row, :, :cut], cut, int(root_tokens[row]))
        n = tree.num_nodes
        tokens[row, :n], depths[row, :n], parents[row, :n] = tree.token_ids, tree.depths, tree.parents
        logws[row, :n] = tree.logws
        num_nodes[row] = n
    return TreeBatch(tokens, depths, parents, logws, num_nodes)
