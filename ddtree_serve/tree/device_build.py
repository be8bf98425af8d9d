"""The DDTree build and its verify buffers as batched tensor ops: the device half of a step.

`build_ddtree` pops prefixes from a heap on the host; this module finds the same trees with
top-k, cumsums, gathers and scatters whose shapes depend only on (B, L, K, budget_max), so it
runs on CPU (where the tests compare it with the host builder) and on CUDA inside a captured
graph (no host syncs, no data-dependent shapes or control flow).

Order. Prefixes are ranked by (-logw, rank path), the rank path compared lexicographically (a
prefix before its extensions), exactly the host heap's key. A child never outranks its parent
(log-probs are <= 0 and float addition is monotone; on a tie the parent's path is the shorter),
so the best `budget` prefixes are ancestor-closed and, listed in rank order, are the host's
pop order: the device numbering *is* the host numbering.

Method, per request:
1. Levels. At depth d the candidates are the K children of the nodes kept at depth d-1; keep
   the best `budget_max` of them. Each level is stored in rank-path order, so the flattened
   [parent, rank] candidate grid is in rank-path order too, and "best" breaks logw ties by
   index. Every one of the best `budget` prefixes survives: its parent is one of them (by
   induction, kept), and fewer than `budget` candidates outrank it.
2. Preorder. The kept levels form a tree; its preorder with children in rank order is the
   rank-path order across levels. Subtree sizes (bottom-up) and preorder positions (top-down)
   give that order, and `pos[j] <= pos[i] < pos[j] + size[j]` is "j is i or an ancestor of i".
3. Selection. Lay the kept nodes out in preorder and take the best `budget_max`; a stable sort
   of those by logw is the host's pop order, whose first `budgets[b]` are request b's tree.
4. Buffers. Parents, tokens, depths and logws by gather; sibling links by a stable sort of
   node indices by parent (node order is descending logw, ties by rank path: the host's
   sibling order); the ancestor mask from the preorder intervals.

"Best n of a row, ties to the lower index" is one top-k for the n-th largest value, then every
value above it and the first tied ones up to n, listed in index order by a cumsum: linear work
instead of a full sort. logws are float64 left-fold sums of the edge log-probs, the host's
arithmetic, so ties and cut-offs fall exactly where the host's do.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from ddtree_serve.tree.buffers import VerifyBatch


@dataclass(frozen=True)
class DeviceTreeBatch:
    """B trees built on the device, padded to N = budget_max + 1 nodes (root at 0).

    `verify` is what verification consumes; its `max_depth` is the static bound
    min(L, budget_max) (the deepest node any request could have), not the batch's deepest node,
    so a walk may run a few empty levels and `accept_index` has that many -1 columns more.
    """

    verify: VerifyBatch
    logws: torch.Tensor  # [B, N] float64 cumulative draft log-weight; root and padding 0.0


@dataclass(frozen=True)
class _Level:
    """The nodes kept at one depth, in rank-path order: [B, W] each."""

    logws: torch.Tensor  # float64
    parent_slots: torch.Tensor  # int64 slot in the previous level (0 = the root at depth 1)
    ranks: torch.Tensor  # int64 draft rank of the node's token at its position


def build_ddtree_batch(
    logp: torch.Tensor, ids: torch.Tensor, budgets: torch.Tensor, root_tokens: torch.Tensor, budget_max: int
) -> DeviceTreeBatch:
    """Build request b's DDTree of `budgets[b]` draft nodes for every b, on `logp`'s device.

    `logp`, `ids`: [B, L, K], finite log-probs descending along K (as `draft_topk` gives) and
    their token ids. `budgets`: [B] int64; a budget <= 0 gives the root alone, one above
    `budget_max` counts as `budget_max`. `root_tokens`: [B] int64. Equals `build_ddtree` per
    request followed by `build_verify_batch(trees, n_max=budget_max + 1)`, node for node.
    Cost: L top-k selections over B x budget_max*K candidates, then a few passes over
    B x L*budget_max kept nodes and B x budget_max**2 mask entries.
    """
    batch_size, num_positions, num_ranks = logp.shape
    num_levels = min(num_positions, budget_max) if num_ranks else 0
    if num_levels == 0:
        return _root_only(root_tokens, budget_max)
    levels = _kept_levels(logp.double(), num_levels, budget_max)
    positions, sizes = _preorder(levels)

    # Kept nodes flattened level after level: "union" index u in [0, U).
    logws = torch.cat([level.logws for level in levels], dim=1)  # [B, U]
    ranks = torch.cat([level.ranks for level in levels], dim=1)
    depths = torch.cat([torch.full_like(level.ranks, d + 1) for d, level in enumerate(levels)], dim=1)
    parents = torch.cat(_union_parents(levels), dim=1)  # [B, U] union index, -1 for the root
    num_kept = logws.shape[1]
    union_index = torch.arange(num_kept, device=logp.device).expand(batch_size, -1)

    # Host pop order: the best budget_max in preorder (rank-path order), stable-sorted by logw.
    num_selected = min(num_kept, budget_max)
    preorder = torch.empty_like(union_index).scatter_(1, positions, union_index)  # [B, U]
    best = preorder.gather(1, _best_in_index_order(logws.gather(1, preorder), num_selected))
    by_logw = torch.sort(logws.gather(1, best), dim=1, descending=True, stable=True).indices
    chosen = best.gather(1, by_logw)  # [B, M] union index of node 1, 2, ...
    node_numbers = torch.arange(1, num_selected + 1, device=logp.device).expand(batch_size, -1)
    node_of_union = torch.zeros_like(union_index).scatter_(1, chosen, node_numbers)  # 0: not chosen
    chosen_parents = parents.gather(1, chosen)
    parent_nodes = torch.where(
        chosen_parents >= 0, node_of_union.gather(1, chosen_parents.clamp(min=0)), torch.zeros_like(chosen)
    )
    chosen_depths = depths.gather(1, chosen)
    token_index = (chosen_depths - 1) * num_ranks + ranks.gather(1, chosen)
    num_draft = budgets.clamp(min=0, max=num_selected)  # [B]
    is_real = torch.arange(num_selected, device=logp.device) < num_draft[:, None]  # [B, M]

    def node_plane(root: int | float | torch.Tensor, values: torch.Tensor, pad: int | float) -> torch.Tensor:
        """[B, N]: the root's value, then `values` where real and `pad` elsewhere, padded to N."""
        body = torch.where(is_real, values, torch.full_like(values, pad))
        tail = torch.full(
            (batch_size, budget_max - num_selected), pad, dtype=values.dtype, device=values.device
        )
        head = root.view(-1, 1) if isinstance(root, torch.Tensor) else torch.full_like(values[:, :1], root)
        return torch.cat([head, body, tail], dim=1)

    node_tokens = node_plane(root_tokens.to(ids.dtype), ids.flatten(1).gather(1, token_index), 0)
    node_parents = node_plane(-1, parent_nodes, -1)
    node_positions = node_plane(-1, positions.gather(1, chosen), -1)
    node_sizes = node_plane(num_kept + 1, sizes.gather(1, chosen), 1)
    next_token, next_sibling = _sibling_links(node_parents)
    verify = VerifyBatch(
        tokens=node_tokens,
        depths=node_plane(0, chosen_depths, 0),
        parents=node_parents,
        retrieve_index=torch.arange(batch_size * (budget_max + 1), device=logp.device).view(batch_size, -1),
        retrieve_next_token=next_token,
        retrieve_next_sibling=next_sibling,
        attn_mask=_ancestor_mask(node_positions, node_sizes, node_parents),
        num_nodes=num_draft + 1,
        max_depth=num_levels,
    )
    return DeviceTreeBatch(verify=verify, logws=node_plane(0.0, logws.gather(1, chosen), 0.0))


def num_device_tree_nodes(budget: int, num_positions: int, num_ranks: int, budget_max: int) -> int:
    """Nodes (root included) of the tree `build_ddtree_batch` makes for `budget`, on the host.

    Known from the shapes alone (the kept levels' widths), so a caller can size per-node data
    such as sampling coins without reading the device. Equals the host builder's tree size.
    """
    num_levels = min(num_positions, budget_max) if num_ranks else 0
    width, num_kept = 1, 0
    for _ in range(num_levels):
        width = min(width * num_ranks, budget_max)
        num_kept += width
    return 1 + max(0, min(budget, num_kept, budget_max))


def _kept_levels(logp: torch.Tensor, num_levels: int, budget_max: int) -> list[_Level]:
    """Levels 1..num_levels, each the best `budget_max` children of the previous level's nodes.

    `logp`: [B, L, K] float64. The root's logw 0.0 is added at depth 1 as the host does for
    siblings (it also turns a -0.0 edge into 0.0, which a radix sort would order below 0.0).
    """
    batch_size, _, num_ranks = logp.shape
    parent_logws = logp.new_zeros(batch_size, 1)  # [B, W_prev], the root
    levels = []
    for depth in range(num_levels):
        candidates = (parent_logws[:, :, None] + logp[:, depth, None, :]).flatten(1)  # [B, W_prev * K]
        width = min(candidates.shape[1], budget_max)
        kept = _best_in_index_order(candidates, width)  # [B, W], in rank-path order
        levels.append(_Level(candidates.gather(1, kept), kept // num_ranks, kept % num_ranks))
        parent_logws = levels[-1].logws
    return levels


def _best_in_index_order(values: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` largest of each row of `values` [B, n], ties to the lower index,
    in increasing index order: [B, count] int64 (count <= n)."""
    batch_size, num_values = values.shape
    threshold = _kth_largest(values, count)  # [B, 1]
    above = values > threshold
    tied = values == threshold
    room = count - above.sum(dim=1, keepdim=True)  # tied values still to take, >= 1
    chosen = above | (tied & (torch.cumsum(tied, dim=1) <= room))  # exactly `count` per row
    slots = torch.where(chosen, torch.cumsum(chosen, dim=1) - 1, count)  # unchosen: a spare column
    indices = torch.arange(num_values, device=values.device).expand(batch_size, -1)
    best = indices.new_empty(batch_size, count + 1).scatter_(1, slots, indices)
    return best[:, :count]


def _kth_largest(values: torch.Tensor, count: int) -> torch.Tensor:
    """The `count`-th largest value of each row of `values` [B, n]: [B, 1].

    On CUDA a full sort: topk of a float64 row of thousands runs a radix select inside one
    thread block (measured 145 us per call on an H200 for 128 of 16384, most of a DDTree-128
    build), where the sort spreads over the device. On a CPU topk is the cheaper one.
    """
    if values.is_cuda:
        return torch.sort(values, dim=1, descending=True).values[:, count - 1 : count]
    return torch.topk(values, count, dim=1, sorted=False).values.amin(dim=1, keepdim=True)


def _preorder(levels: list[_Level]) -> tuple[torch.Tensor, torch.Tensor]:
    """Preorder position and subtree size of every kept node, children in rank order: [B, U] each.

    The root is not numbered (position -1); level d's nodes are contiguous per parent and in
    rank order, so a node's position is its parent's plus one plus the sizes of its earlier
    siblings.
    """
    sizes = [torch.ones_like(level.ranks) for level in levels]
    for depth in range(len(levels) - 1, 0, -1):
        sizes[depth - 1].scatter_add_(1, levels[depth].parent_slots, sizes[depth])
    parent_positions = torch.full_like(levels[0].ranks[:, :1], -1)  # [B, 1], the root
    parent_child_offsets = torch.zeros_like(parent_positions)  # sizes of earlier parents' subtrees
    positions = []
    for level, level_sizes in zip(levels, sizes, strict=True):
        before = torch.cumsum(level_sizes, dim=1) - level_sizes  # subtree sizes before, in level
        slots = level.parent_slots
        level_positions = (
            parent_positions.gather(1, slots) + 1 + before - parent_child_offsets.gather(1, slots)
        )
        positions.append(level_positions)
        descendants = level_sizes - 1
        parent_child_offsets = torch.cumsum(descendants, dim=1) - descendants
        parent_positions = level_positions
    return torch.cat(positions, dim=1), torch.cat(sizes, dim=1)


def _union_parents(levels: list[_Level]) -> list[torch.Tensor]:
    """Per level, each node's parent as a union index (levels concatenated), -1 for the root."""
    parents = [torch.full_like(levels[0].parent_slots, -1)]
    offset = 0
    for previous, level in pairwise(levels):
        parents.append(level.parent_slots + offset)
        offset += previous.ranks.shape[1]
    return parents


def _sibling_links(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First-child and next-sibling links ([B, N] int64, -1 = none) from node parents [B, N].

    Node order is descending logw with the host's tie rule, so a stable sort of node indices by
    parent lists each parent's children in the host's sibling order.
    """
    batch_size, padded_num_nodes = parents.shape
    group = torch.where(parents >= 0, parents, padded_num_nodes)[:, 1:]  # [B, N-1]; root, padding last
    grouped, order = torch.sort(group, dim=1, stable=True)
    nodes = order + 1
    is_child = grouped < padded_num_nodes
    follows = is_child[:, 1:] & (grouped[:, 1:] == grouped[:, :-1])  # nodes[j+1] is nodes[j]'s sibling
    next_sibling = torch.full_like(parents, -1)
    next_sibling.scatter_(1, nodes[:, :-1], torch.where(follows, nodes[:, 1:], -1))
    first = is_child & torch.cat([torch.ones_like(is_child[:, :1]), ~follows], dim=1)
    next_token = parents.new_full((batch_size, padded_num_nodes + 1), -1)  # last column takes the rest
    next_token.scatter_(1, torch.where(first, grouped, padded_num_nodes), torch.where(first, nodes, -1))
    return next_token[:, :padded_num_nodes], next_sibling


def _ancestor_mask(positions: torch.Tensor, sizes: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool, [b, i, j] = j is i or an ancestor of i (preorder interval containment).

    Real nodes are the root and those with a parent; padding attends only to itself.
    """
    is_real = parents >= 0
    is_real[:, 0] = True
    row_positions = positions[:, :, None]
    inside = (positions[:, None, :] <= row_positions) & (row_positions < (positions + sizes)[:, None, :])
    both_real = is_real[:, :, None] & is_real[:, None, :]
    eye = torch.eye(positions.shape[1], dtype=torch.bool, device=positions.device)
    return (inside & both_real) | eye


def _root_only(root_tokens: torch.Tensor, budget_max: int) -> DeviceTreeBatch:
    """Trees of the root alone (no draft positions, ranks or budget), padded to budget_max + 1."""
    batch_size, padded_num_nodes, device = root_tokens.shape[0], budget_max + 1, root_tokens.device
    tokens = torch.zeros(batch_size, padded_num_nodes, dtype=torch.int64, device=device)
    tokens[:, 0] = root_tokens
    none = torch.full_like(tokens, -1)
    verify = VerifyBatch(
        tokens=tokens,
        depths=torch.zeros_like(tokens),
        parents=none,
        retrieve_index=torch.arange(batch_size * padded_num_nodes, device=device).view(batch_size, -1),
        retrieve_next_token=none.clone(),
        retrieve_next_sibling=none.clone(),
        attn_mask=torch.eye(padded_num_nodes, dtype=torch.bool, device=device)
        .expand(batch_size, -1, -1)
        .clone(),
        num_nodes=torch.ones(batch_size, dtype=torch.int64, device=device),
        max_depth=0,
    )
    return DeviceTreeBatch(
        verify=verify, logws=torch.zeros(batch_size, padded_num_nodes, dtype=torch.float64, device=device)
    )
