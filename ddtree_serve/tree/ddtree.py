"""Best-first DDTree construction from a drafter's per-position top-K distributions.

The tree holds the `budget` most probable prefixes under the drafter's factorised distribution.
A max-heap keyed by cumulative log-weight pops them in order; each popped node pushes at most two
candidates (its next sibling and its first child), so the heap stays O(budget) and the build is
O(budget log budget). Because every log-prob is <= 0 and ranks are descending, a generated
candidate never outranks the node that generated it, hence the pop order is the global order
and the chosen set is ancestor-closed.
"""

from __future__ import annotations

import heapq
from functools import cache
from typing import Any

import numpy as np

from ddtree_serve.tree.draft_tree import DraftTree


def build_ddtree(logp: Any, ids: Any, budget: int, root_token: int) -> DraftTree:
    """Build the DDTree for one request.

    `logp`, `ids`: [L, K] (numpy or CPU torch), log-probs normalised over the full vocabulary,
    descending along K. `budget` counts draft nodes, so the tree has at most `budget + 1` nodes.
    Heap keys are (-logw, rank path): equal log-weights pop in lexicographic rank-path order.
    A candidate's logw is its parent's logw plus its own edge log-prob, so every logw is the
    left-to-right float sum of the edge log-probs on its path.
    """
    logp_rows: list[list[float]] = logp.tolist()  # [L][K]; ids are looked up once at the end
    num_levels = len(logp_rows)
    num_ranks = len(logp_rows[0]) if num_levels else 0

    depths = [0]
    parents = [-1]
    ranks = [0]
    logws = [0.0]
    if num_levels == 0 or num_ranks == 0 or budget <= 0:
        return _as_tree(np.array([root_token], dtype=np.int64), depths, parents, logws)

    # Heap entry: (-logw, rank-path key, parent node, depth, rank). The key is the rank path as
    # one integer, digit `rank + 1` in base K + 1 at place L - depth: integer order is the paths'
    # lexicographic order with a prefix first, and a child's or sibling's key is one addition
    # away (no tuple per push). Keys are unique, so comparison never reaches the trailing fields.
    place = _path_places(num_levels, num_ranks)
    heap = [(-logp_rows[0][0], place[1], 0, 1, 0)]
    push, pop = heapq.heappush, heapq.heappop
    num_nodes = 1
    while heap and num_nodes <= budget:
        neg_logw, key, parent, depth, rank = pop(heap)
        depths.append(depth)
        parents.append(parent)
        ranks.append(rank)
        logws.append(-neg_logw)
        if rank + 1 < num_ranks:
            sibling_logw = logws[parent] + logp_rows[depth - 1][rank + 1]
            push(heap, (-sibling_logw, key + place[depth], parent, depth, rank + 1))
        if depth < num_levels:
            push(heap, (neg_logw - logp_rows[depth][0], key + place[depth + 1], num_nodes, depth + 1, 0))
        num_nodes += 1

    depth_index = np.array(depths, dtype=np.int64)
    token_ids = np.asarray(ids)[depth_index[1:] - 1, ranks[1:]]
    return _as_tree(np.concatenate(([root_token], token_ids)).astype(np.int64), depths, parents, logws)


def build_chain(ids_row0: Any, root_token: int, logp_row0: Any = None) -> DraftTree:
    """The linear DFlash draft (DDTree with K = 1): node i is the rank-0 token at depth i.

    `ids_row0`: [L] token ids. `logp_row0` ([L], optional) gives the edge log-probs for `logws`;
    without it every logw is 0.0 (a chain needs no ordering).
    """
    chain_ids = [int(t) for t in np.asarray(ids_row0).reshape(-1).tolist()]
    num_levels = len(chain_ids)
    if logp_row0 is None:
        logws = [0.0] * (num_levels + 1)
    else:
        logws = [0.0]
        for edge_logp in np.asarray(logp_row0, dtype=np.float64).reshape(-1).tolist():
            logws.append(logws[-1] + edge_logp)
    return _as_tree(
        np.array([int(root_token), *chain_ids], dtype=np.int64),
        list(range(num_levels + 1)),
        list(range(-1, num_levels)),
        logws,
    )


@cache
def _path_places(num_levels: int, num_ranks: int) -> tuple[int, ...]:
    """Place value of each depth's digit in a rank-path key: (K + 1) ** (L - depth)."""
    return tuple((num_ranks + 1) ** (num_levels - depth) for depth in range(num_levels + 1))


def _as_tree(token_ids: np.ndarray, depths: list[int], parents: list[int], logws: list[float]) -> DraftTree:
    return DraftTree(
        token_ids=token_ids,
        depths=np.array(depths, dtype=np.int64),
        parents=np.array(parents, dtype=np.int64),
        logws=np.array(logws, dtype=np.float64),
    )
