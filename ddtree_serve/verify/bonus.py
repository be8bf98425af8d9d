"""The bonus token: one target sample at the last accepted node, shared by every backend."""

from __future__ import annotations

import torch

from ddtree_serve.tree import VerifyBatch


def sample_bonus(
    batch: VerifyBatch, target_probs: torch.Tensor, final_node: torch.Tensor, coin_final: torch.Tensor
) -> torch.Tensor:
    """Sample the bonus token of each request: [B] int64.

    The walk ends at `final_node` after rejecting all of its children (or because it has none),
    so the rejected mass of the design's loop is exactly the children's target probability:
    the bonus is drawn by inverse CDF with `coin_final` from `target_probs[final_node]` with the
    children's tokens removed.

    Boundaries as in SGLang's kernel: the token is the first whose cumulative residual exceeds
    `u = coin_final * total` (buckets are half-open), so `u` exactly on a cumulative value goes
    to the next token of positive residual and zero-residual tokens are never drawn; where `u`
    rounds up to `total` it is moved below it, which picks the last positive token (the kernel's
    `last_valid_id` fallback). One deliberate difference: if float rounding rejected every child
    while they held all the mass, the residual is empty; the kernel then returns token V - 1,
    here the bonus is the target's argmax.
    """
    batch_size, _, vocab_size = target_probs.shape
    rows = torch.arange(batch_size, device=target_probs.device)
    row_probs = target_probs[rows, final_node]  # [B, V]
    is_child = (batch.parents == final_node.view(-1, 1)).float()  # [B, N]; padding has parent -1
    child_hits = torch.zeros(batch_size, vocab_size, device=target_probs.device)
    child_hits.scatter_add_(1, batch.tokens, is_child)  # exact counts, any order
    residual = torch.where(child_hits > 0, 0.0, row_probs)  # relu(P - rejected_mass)
    cdf = residual.double().cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]
    # u < total whenever total > 0, so the first cdf entry above u has positive residual.
    u = torch.minimum(
        coin_final.double().view(-1, 1) * total, torch.nextafter(total, torch.zeros_like(total))
    )
    sampled = torch.searchsorted(cdf, u, right=True).view(-1).clamp(max=vocab_size - 1)
    return torch.where(total.view(-1) > 0, sampled, row_probs.argmax(dim=-1))
