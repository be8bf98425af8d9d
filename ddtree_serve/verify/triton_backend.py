"""Triton tree walk for sampling verification (GPU): one program per request.

Same contract and arithmetic as the reference `walk.walk_tree`: float32 running sums in sibling
order, IEEE division by the clamped `threshold_acc`, the half-open `coin < acc / threshold_acc`
and the `q > 0` guard, so both agree bit-for-bit on the same coins. The walk is inherently
sequential per request (each level depends on the last), so a program walks one tree with
scalar loads; the batch gives the parallelism.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ddtree_serve.tree import VerifyBatch
from ddtree_serve.verify.walk import clamped_threshold_acc


@triton.jit
def _tree_walk_kernel(
    target_probs_ptr,  # [B, N, V] float32, contiguous
    tokens_ptr,  # [B, N] int64
    next_token_ptr,  # [B, N] int64
    next_sibling_ptr,  # [B, N] int64
    coins_ptr,  # [B, N] float32
    accept_index_ptr,  # [B, D + 1] int64, prefilled with -1
    accept_len_ptr,  # [B] int64
    threshold_single,
    threshold_acc,  # already clamped to >= THRESHOLD_ACC_MIN
    padded_num_nodes,
    vocab_size,
    max_depth,
):
    request = tl.program_id(0).to(tl.int64)
    node_base = request * padded_num_nodes
    accept_base = request * (max_depth + 1)

    # Loop-carried scalars start as int64 tensors (integer args equal to 1 arrive as constants).
    current = tl.load(next_token_ptr + node_base) * 0  # local index of the last accepted node
    tl.store(accept_index_ptr + accept_base, current)
    num_accepted = current
    level = current + 1
    walking = level <= max_depth
    while walking:
        coin = tl.load(coins_ptr + node_base + current)
        row = (node_base + current) * vocab_size
        acc = coin * 0.0  # float32 running sum of the children's target probabilities
        chosen = current * 0 - 1
        child = tl.load(next_token_ptr + node_base + current)
        while child >= 0:
            token = tl.load(tokens_ptr + node_base + child)
            q = tl.load(target_probs_ptr + row + token)
            acc = acc + q
            hit = (q > 0) & ((coin < tl.math.div_rn(acc, threshold_acc)) | (q >= threshold_single))
            chosen = tl.where(hit, child, chosen)
            child = tl.where(hit, -1, tl.load(next_sibling_ptr + node_base + child))
        if chosen >= 0:
            tl.store(accept_index_ptr + accept_base + level, chosen)
            num_accepted += 1
            current = chosen
        level += 1
        walking = (chosen >= 0) & (level <= max_depth)
    tl.store(accept_len_ptr + request, num_accepted)


def triton_walk(
    batch: VerifyBatch,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    threshold_single: float,
    threshold_acc: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `backends.torch_walk`, for CUDA tensors."""
    batch_size, padded_num_nodes = batch.tokens.shape
    device = target_probs.device
    accept_index = torch.full((batch_size, batch.max_depth + 1), -1, dtype=torch.int64, device=device)
    accept_len = torch.zeros(batch_size, dtype=torch.int64, device=device)
    if batch_size == 0:
        return accept_index, accept_len
    _tree_walk_kernel[(batch_size,)](
        target_probs.float().contiguous(),
        batch.tokens.contiguous(),
        batch.retrieve_next_token.contiguous(),
        batch.retrieve_next_sibling.contiguous(),
        coins.to(device=device, dtype=torch.float32).contiguous(),
        accept_index,
        accept_len,
        float(threshold_single),
        clamped_threshold_acc(threshold_acc),
        padded_num_nodes,
        target_probs.shape[-1],
        batch.max_depth,
    )
    return accept_index, accept_len
