"""Greedy verification: follow the target's argmax down the tree."""

from __future__ import annotations

import torch

from ddtree_serve.tree import VerifyBatch
from ddtree_serve.verify.result import VerifyResult
from ddtree_serve.verify.walk import final_nodes, walk_tree


def verify_greedy(batch: VerifyBatch, target_logits: torch.Tensor) -> VerifyResult:
    """Accept the child whose token is the target's argmax at its parent, level by level.

    `target_logits`: [B, N, V]. This is the reference walk with q = 1 for the argmax token and 0
    otherwise (and coin 0), i.e. the temperature-0 limit of sampling verification: it equals
    `verify_sampling` on `target_probs(..., temperature=0)` for any coins.
    """
    if batch.device != target_logits.device:
        batch = batch.to(target_logits.device)
    batch_size = batch.batch_size
    rows = torch.arange(batch_size, device=target_logits.device)
    target_argmax = target_logits.argmax(dim=-1)  # [B, N]

    def child_prob(current: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens == target_argmax[rows, current]).float()

    coins = torch.zeros(batch_size, batch.padded_num_nodes, device=target_logits.device)
    accept_index, accept_len = walk_tree(batch, child_prob, coins)
    bonus = target_argmax[rows, final_nodes(accept_index, accept_len)]
    return VerifyResult(accept_index=accept_index, accept_len=accept_len, bonus_token=bonus)
