"""`DraftTree`: one request's draft tree, the hand-off from the builder to the verify buffers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DraftTree:
    """A draft tree in node order: root (the bonus token) at index 0, parents before children.

    All arrays have length `num_nodes` (= n + 1). Among the children of one node, index order is
    descending `logws` order (ties broken by draft rank): `build_verify_batch` sorts anyway
    (`children()`), so hand-made trees need not follow it; `TreeBatch.verify_batch` relies on it
    and takes the builders' trees only.
    """

    token_ids: np.ndarray  # [n+1] int64, token_ids[0] = root token
    depths: np.ndarray  # [n+1] int64, depths[0] = 0, depths[i] = depths[parents[i]] + 1
    parents: np.ndarray  # [n+1] int64, parents[0] = -1, parents[i] < i
    logws: np.ndarray  # [n+1] float64, cumulative draft log-weight, logws[0] = 0.0

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return len(self.token_ids)

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def children(self, i: int) -> np.ndarray:
        """Node i's children in descending logw order (ties: lower node index first)."""
        kids = np.flatnonzero(self.parents == i)
        order = np.lexsort((kids, -self.logws[kids]))
        return kids[order]

    def sibling_order(self) -> np.ndarray:
        """All non-root nodes grouped by parent, each group in `children()` order: [n] int64."""
        nodes = np.arange(1, self.num_nodes)
        return nodes[np.lexsort((nodes, -self.logws[1:], self.parents[1:]))]
