"""Stochastic tree verification (SGLang `tree_speculative_sampling_target_only` semantics)."""

from __future__ import annotations

import torch

from ddtree_serve.tree import VerifyBatch
from ddtree_serve.verify.backends import get_backend
from ddtree_serve.verify.bonus import sample_bonus
from ddtree_serve.verify.result import VerifyResult
from ddtree_serve.verify.walk import final_nodes


def verify_sampling(
    batch: VerifyBatch,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    coin_final: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    backend: str = "torch",
) -> VerifyResult:
    """Verify each tree against `target_probs` [B, N, V] (rows from `target_probs()`).

    `coins` [B, N] and `coin_final` [B] are uniform in [0, 1). With both thresholds at 1 every
    emitted token is distributed exactly as the target would sample it; rows made at
    temperature 0 (one-hot) give the greedy result. Lower thresholds accept more, with bias.
    """
    if batch.device != target_probs.device:
        batch = batch.to(target_probs.device)
    walk = get_backend(backend)
    accept_index, accept_len = walk(batch, target_probs, coins, threshold_single, threshold_acc)
    bonus = sample_bonus(batch, target_probs, final_nodes(accept_index, accept_len), coin_final)
    return VerifyResult(accept_index=accept_index, accept_len=accept_len, bonus_token=bonus)
