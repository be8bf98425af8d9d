"""`TreeBatch`: a step's best-first trees as [B, N] planes, and their verify buffers in one pass.

`build_verify_batch` links each tree's children with a per-tree sort, which at batch 64 is most
of its time. Trees from the best-first builders need no sort: their node order is (-logw, rank
path), so among one parent's children index order already is the descending-logw sibling order
(ties by rank, the order `DraftTree.children` defines), and a best-first prefix of such a tree
is itself one (`prefix`). The links then come from one integer sort over the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddtree_serve.tree.buffers import VerifyBatch, verify_batch_of_planes
from ddtree_serve.tree.draft_tree import DraftTree


@dataclass(frozen=True)
class TreeBatch:
    """B best-first trees padded to N nodes; row b's first `num_nodes[b]` entries are its tree
    (root at 0, parents before children, node order = descending logw, ties by rank path).
    Entries past a row's tree are unspecified: everything that reads the planes masks them."""

    tokens: np.ndarray  # [B, N] int64
    depths: np.ndarray  # [B, N] int64
    parents: np.ndarray  # [B, N] int64, -1 for the root
    logws: np.ndarray  # [B, N] float64, cumulative draft log-weight, root 0.0
    num_nodes: np.ndarray  # [B] int64, root included

    @property
    def batch_size(self) -> int:
        return len(self.num_nodes)

    @classmethod
    def from_trees(cls, trees: Sequence[DraftTree]) -> TreeBatch:
        """Stack best-first trees (the builders' output, or prefixes of it; not hand-made trees,
        whose sibling order `verify_batch` would not see)."""
        num_nodes = np.array([tree.num_nodes for tree in trees], dtype=np.int64)
        width = int(num_nodes.max(initial=1))
        tokens, depths, parents = np.zeros((3, len(trees), width), dtype=np.int64)
        logws = np.zeros((len(trees), width))
        for row, tree in enumerate(trees):
            n = tree.num_nodes
            tokens[row, :n], depths[row, :n] = tree.token_ids, tree.depths
            parents[row, :n], logws[row, :n] = tree.parents, tree.logws
        return cls(tokens, depths, parents, logws, num_nodes)

    @classmethod
    def root_only(cls, root_tokens: Sequence[int]) -> TreeBatch:
        """Each request's tree as its root alone (a step that does not draft it)."""
        batch_size = len(root_tokens)
        tokens = np.asarray(root_tokens, dtype=np.int64).reshape(batch_size, 1)
        zeros = np.zeros((batch_size, 1), dtype=np.int64)
        return cls(tokens, zeros, zeros - 1, np.zeros((batch_size, 1)), np.ones(batch_size, dtype=np.int64))

    def with_root_only(self, root_tokens: Sequence[int]) -> TreeBatch:
        """These trees, then one root-only tree per `root_tokens` entry (requests not drafted)."""
        extra = len(root_tokens)
        if extra == 0:
            return self

        def grown(plane: np.ndarray, root_value: int | float) -> np.ndarray:
            """`plane` and `extra` rows holding the root's value (past it: unspecified)."""
            return np.concatenate([plane, np.full((extra, plane.shape[1]), root_value, dtype=plane.dtype)])

        tokens = grown(self.tokens, 0)
        tokens[self.batch_size :, 0] = root_tokens
        return TreeBatch(
            tokens,
            grown(self.depths, 0),
            grown(self.parents, -1),
            grown(self.logws, 0.0),
            np.concatenate([self.num_nodes, np.ones(extra, dtype=np.int64)]),
        )

    def within_depth(self, max_depths: Sequence[int]) -> TreeBatch:
        """Each row without its nodes deeper than `max_depths[b]`, the rest kept in order.

        The kept nodes are ancestor-closed (an ancestor is shallower) and keep the best-first
        and sibling orders, so each row is the DDTree of its draft cut to that depth, with a
        budget of the nodes kept. A request with n tokens left keeps at most n - 1 draft
        tokens of a step: its deeper nodes could only be cut off, its shallow ones still count.
        """
        if len(max_depths) == 0 or min(max_depths) >= int(self.depths.max(initial=0)):
            return self  # no node deeper than the smallest limit (most steps: no request near its end)
        limits = np.asarray(max_depths, dtype=np.int64)[:, None]
        width = self.tokens.shape[1]
        real = np.arange(width) < self.num_nodes[:, None]
        kept = real & (self.depths <= limits)
        if np.array_equal(kept, real):
            return self
        # A kept node's new index: kept nodes before it; a dropped node's never read.
        new_index = np.cumsum(kept, axis=1) - 1
        rows, cols = np.nonzero(kept)
        targets = new_index[rows, cols]
        tokens, depths, parents = np.zeros((3, self.batch_size, width), dtype=np.int64)
        logws = np.zeros((self.batch_size, width))
        tokens[rows, targets] = self.tokens[rows, cols]
        depths[rows, targets] = self.depths[rows, cols]
        logws[rows, targets] = self.logws[rows, cols]
        old_parents = self.parents[rows, cols]
        parents[rows, targets] = np.where(old_parents < 0, -1, new_index[rows, np.maximum(old_parents, 0)])
        return TreeBatch(tokens, depths, parents, logws, kept.sum(axis=1))

    def tree(self, row: int) -> DraftTree:
        """Row `row` as a `DraftTree` (views of the planes, no copy)."""
        n = int(self.num_nodes[row])
        return DraftTree(
            token_ids=self.tokens[row, :n],
            depths=self.depths[row, :n],
            parents=self.parents[row, :n],
            logws=self.logws[row, :n],
        )

    def prefix(self, num_draft_nodes: Sequence[int]) -> TreeBatch:
        """Each row cut to its first `num_draft_nodes[b]` draft nodes (and the root): a best-first
        prefix is ancestor-closed and keeps both orders, so it is again a `TreeBatch`."""
        wanted = np.maximum(np.asarray(num_draft_nodes, dtype=np.int64), 0) + 1
        return TreeBatch(
            self.tokens, self.depths, self.parents, self.logws, np.minimum(self.num_nodes, wanted)
        )

    def verify_batch(self, n_max: int | None = None) -> VerifyBatch:
        """The padded `VerifyBatch` of these trees (N = n_max, default the largest tree): equal to
        `build_verify_batch` of the rows' trees for finite drafts (a NaN logw would sort last
        there and keep its index here), without its per-tree sorts."""
        batch_size = self.batch_size
        largest = int(self.num_nodes.max(initial=1))
        padded_num_nodes = largest if n_max is None else n_max
        if largest > padded_num_nodes:
            raise ValueError(f"a tree has {largest} nodes, more than n_max={padded_num_nodes}")
        kept = min(self.tokens.shape[1], padded_num_nodes)
        real = np.arange(kept) < self.num_nodes[:, None]  # [B, kept]

        planes = np.empty((6, batch_size, padded_num_nodes), dtype=np.int64)
        tokens, depths, parents, retrieve_index, next_token, next_sibling = planes
        tokens.fill(0)
        depths.fill(0)
        parents.fill(-1)
        tokens[:, :kept] = np.where(real, self.tokens[:, :kept], 0)
        depths[:, :kept] = np.where(real, self.depths[:, :kept], 0)
        parents[:, :kept] = np.where(real, self.parents[:, :kept], -1)
        retrieve_index[:] = np.arange(batch_size * padded_num_nodes, dtype=np.int64).reshape(
            batch_size, padded_num_nodes
        )
        next_token.fill(-1)
        next_sibling.fill(-1)
        _link_siblings(parents, next_token, next_sibling)

        return verify_batch_of_planes(planes, self.num_nodes.copy())


def _link_siblings(parents: np.ndarray, next_token: np.ndarray, next_sibling: np.ndarray) -> None:
    """First-child and next-sibling links of best-first trees ([B, N] planes, -1 prefilled).

    Sibling order is index order, so one stable sort of the non-root nodes by (row, parent)
    groups each parent's children in that order."""
    rows, nodes = np.nonzero(parents >= 0)  # row-major: by row, then node index
    if len(nodes) == 0:
        return
    width = parents.shape[1]
    groups = rows * width + parents[rows, nodes]  # (row, parent) as one integer
    order = np.argsort(groups, kind="stable")
    groups, rows, nodes = groups[order], rows[order], nodes[order]
    same = groups[1:] == groups[:-1]  # [n-1]: entry j+1 is entry j's next sibling
    next_sibling[rows[:-1][same], nodes[:-1][same]] = nodes[1:][same]
    first = np.concatenate(([True], ~same))
    next_token[rows[first], parents[rows[first], nodes[first]]] = nodes[first]
