"""Draft trees -> the padded batch of tensors a target needs to verify them (`VerifyBatch`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from ddtree_serve.tree.draft_tree import DraftTree


@dataclass(frozen=True)
class VerifyBatch:
    """Verification inputs for B trees padded to N nodes (local node index 0 = root).

    Links use local node indices and -1 for "none"; each parent's children are linked in
    descending logw order. Padding nodes (index >= num_nodes[b]) have token 0, depth 0, no
    parent and no links, and attend only to themselves, so no walk ever reaches them.
    """

    tokens: torch.Tensor  # [B, N] int64
    depths: torch.Tensor  # [B, N] int64; a node sits at position start + depth
    parents: torch.Tensor  # [B, N] int64, -1 for roots and padding
    retrieve_index: torch.Tensor  # [B, N] int64, b * N + i (flat row of node i in [B * N, ...])
    retrieve_next_token: torch.Tensor  # [B, N] int64, first child (highest logw) or -1
    retrieve_next_sibling: torch.Tensor  # [B, N] int64, next lower-logw sibling or -1
    attn_mask: torch.Tensor  # [B, N, N] bool, [b, i, j] = j is i or an ancestor of i
    num_nodes: torch.Tensor  # [B] int64, real nodes per tree, root included
    max_depth: int  # deepest real node over the batch

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def padded_num_nodes(self) -> int:
        """N: nodes per tree after padding."""
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> VerifyBatch:
        """Copy every tensor to `device` (pin first for a truly asynchronous host-to-device copy)."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return VerifyBatch(
            tokens=move(self.tokens),
            depths=move(self.depths),
            parents=move(self.parents),
            retrieve_index=move(self.retrieve_index),
            retrieve_next_token=move(self.retrieve_next_token),
            retrieve_next_sibling=move(self.retrieve_next_sibling),
            attn_mask=move(self.attn_mask),
            num_nodes=move(self.num_nodes),
            max_depth=self.max_depth,
        )


def build_verify_batch(trees: Sequence[DraftTree], n_max: int | None = None) -> VerifyBatch:
    """Pad and link `trees` into one `VerifyBatch` of N = n_max (default: largest tree) nodes.

    Everything is assembled in numpy and turned into tensors once (tensor creation, not the
    arithmetic, dominates at these sizes).
    """
    sizes = [tree.num_nodes for tree in trees]
    padded_num_nodes = max(sizes) if n_max is None else n_max
    if sizes and max(sizes) > padded_num_nodes:
        raise ValueError(f"a tree has {max(sizes)} nodes, more than n_max={padded_num_nodes}")
    batch_size = len(trees)

    # One int64 block, split into named [B, N] planes.
    planes = np.empty((6, batch_size, padded_num_nodes), dtype=np.int64)
    tokens, depths, parents, retrieve_index, next_token, next_sibling = planes
    tokens.fill(0)
    depths.fill(0)
    parents.fill(-1)
    retrieve_index[:] = np.arange(batch_size * padded_num_nodes, dtype=np.int64).reshape(
        batch_size, padded_num_nodes
    )
    next_token.fill(-1)
    next_sibling.fill(-1)

    for b, tree in enumerate(trees):
        n = tree.num_nodes
        tokens[b, :n] = tree.token_ids
        depths[b, :n] = tree.depths
        parents[b, :n] = tree.parents
        if n > 1:
            _link_children(tree, next_token[b], next_sibling[b])

    return verify_batch_of_planes(planes, np.array(sizes, dtype=np.int64))


def verify_batch_of_planes(planes: np.ndarray, num_nodes: np.ndarray) -> VerifyBatch:
    """The `VerifyBatch` of filled planes: [6, B, N] int64 (tokens, depths, parents, retrieve
    index, first child, next sibling) and each tree's real nodes [B]; adds the ancestor mask."""
    depths, parents = planes[1], planes[2]
    max_depth = int(depths.max(initial=0))
    planes_t = torch.from_numpy(planes)
    return VerifyBatch(
        tokens=planes_t[0],
        depths=planes_t[1],
        parents=planes_t[2],
        retrieve_index=planes_t[3],
        retrieve_next_token=planes_t[4],
        retrieve_next_sibling=planes_t[5],
        attn_mask=torch.from_numpy(ancestor_mask(parents, max_depth)),
        num_nodes=torch.from_numpy(num_nodes),
        max_depth=max_depth,
    )


def _link_children(tree: DraftTree, next_token: np.ndarray, next_sibling: np.ndarray) -> None:
    """Fill one tree's first-child and next-sibling links ([N] int64 rows, -1 prefilled)."""
    order = tree.sibling_order()  # [n] non-root nodes grouped by parent, descending logw
    group_parents = tree.parents[order]
    same_parent = group_parents[1:] == group_parents[:-1]  # [n-1]: order[j+1] follows order[j]
    next_sibling[order[:-1][same_parent]] = order[1:][same_parent]
    group_starts = np.concatenate(([True], ~same_parent))
    first_children = order[group_starts]
    next_token[tree.parents[first_children]] = first_children


def ancestor_mask(parents: np.ndarray, max_depth: int) -> np.ndarray:
    """[B, N, N] bool: [b, i, j] is True iff j == i or j is an ancestor of i.

    Pointer doubling: after step s every row holds the ancestors within distance 2**s, and
    row i gains row `jump[i]` (its ancestor at distance 2**s), so ceil(log2(max_depth)) vectorised
    steps cover the deepest tree. Roots and padding point to themselves, which ends their walk.
    """
    batch_size, padded_num_nodes = parents.shape
    self_index, row_offsets, mask_rows = _flat_indices(batch_size, padded_num_nodes)
    flat_parents = parents.reshape(-1)
    jump = row_offsets + np.where(flat_parents >= 0, flat_parents, self_index)  # [B*N] flat parent/self
    mask = np.zeros((batch_size * padded_num_nodes, padded_num_nodes), dtype=np.bool_)  # row b*N+i
    mask.reshape(-1)[mask_rows + self_index] = True
    mask.reshape(-1)[mask_rows + jump - row_offsets] = True
    reach = 1  # rows now hold every ancestor within distance `reach`
    while reach < max_depth:
        mask |= mask[jump]
        jump = jump[jump]
        reach *= 2
    return mask.reshape(batch_size, padded_num_nodes, padded_num_nodes)


@cache
def _flat_indices(batch_size: int, padded_num_nodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per flat node b*N+i: its local index i, its tree's offset b*N, its mask row start (b*N+i)*N."""
    flat = np.arange(batch_size * padded_num_nodes, dtype=np.int64)
    local = flat % padded_num_nodes
    offsets = flat - local
    row_starts = flat * padded_num_nodes
    for array in (local, offsets, row_starts):
        array.flags.writeable = False
    return local, offsets, row_starts
