"""Drafter logits -> the per-position top-K distributions the DDTree builder consumes."""

from __future__ import annotations

import torch


def draft_topk(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k log-probs normalised over the *full* vocabulary, and their token ids.

    `draft_logits`: [L, V] or [B, L, V]. Returns `(logp, ids)` of shape [..., L, min(k, V)],
    float32 and int64, descending along the last axis. Normalising over the full vocabulary
    (not over the k kept) keeps logws comparable across positions and trees.
    """
    k = min(k, draft_logits.shape[-1])
    # log_softmax is one fused pass (cheaper than logsumexp on CPU); topk of it keeps the order.
    logp, ids = torch.topk(torch.log_softmax(draft_logits.float(), dim=-1), k, dim=-1, sorted=True)
    return logp, ids
