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
    top_logits, ids = torch.topk(draft_logits, k, dim=-1, sorted=True)
    log_normaliser = torch.logsumexp(draft_logits.float(), dim=-1, keepdim=True)  # [..., L, 1]
    return top_logits.float() - log_normaliser, ids
