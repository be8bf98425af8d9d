"""The "device" greedy backend: the greedy walk as a few batched tensor ops, no host syncs.

Same decisions as the reference `backends.torch_greedy_walk` (tested against it): a draft node
is accepted when its token is the target's argmax at its parent and its parent is accepted.
That is "every node on its root path matches", which the ancestor mask answers for all nodes
at once, so the walk has no loop over levels or siblings and reads nothing back to the host:
it runs on CUDA between the verify forward and the KV compaction of the same step.

Precondition: siblings carry distinct tokens (top-k ranks of one position are distinct ids, so
every DDTree and chain has them); then at most one child of a node matches its argmax and the
matching nodes form one path from the root.
"""

from __future__ import annotations

import torch

from ddtree_serve.tree import VerifyBatch


def greedy_walk_on_device(
    batch: VerifyBatch, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (accept_index [B, D+1] int64, -1 padded; accept_len [B]; bonus_token [B]).

    Runs where `target_argmax [B, N]` int64 lies (the batch is moved there if needed); results
    stay there. Cost: one [B, N, N] boolean reduction.
    """
    device = target_argmax.device
    if batch.device != device:
        batch = batch.to(device)
    batch_size, max_depth = batch.batch_size, batch.max_depth
    parent_argmax = target_argmax.gather(1, batch.parents.clamp(min=0))  # [B, N]
    matches = (batch.parents >= 0) & (batch.tokens == parent_argmax)
    matches[:, 0] = True  # the root is always kept
    # accepted: no node on the root path (the mask row) fails to match; padding sees only itself
    accepted = ~(batch.attn_mask & ~matches[:, None, :]).any(dim=2)  # [B, N]
    accept_len = accepted.sum(dim=1) - 1
    # accepted nodes have distinct depths 0..accept_len: scatter each into its depth's column
    columns = torch.where(accepted, batch.depths, max_depth + 1)  # others into a spare column
    nodes = torch.arange(batch.padded_num_nodes, device=device).expand(batch_size, -1)
    accept_index = torch.full((batch_size, max_depth + 2), -1, dtype=torch.int64, device=device)
    accept_index.scatter_(1, columns, nodes)
    accept_index = accept_index[:, : max_depth + 1]
    final_node = accept_index.gather(1, accept_len.view(-1, 1))  # [B, 1]
    bonus = target_argmax.gather(1, final_node).view(-1)
    return accept_index, accept_len, bonus
