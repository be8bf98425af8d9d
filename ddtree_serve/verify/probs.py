"""Target logits -> the per-request sampling distributions that verification tests against."""

from __future__ import annotations

import torch

# Temperatures below this are greedy (as vLLM treats them): dividing logits by them overflows
# float32 into NaN probabilities, and their distributions are one-hot to within rounding anyway.
GREEDY_TEMPERATURE_EPS = 1e-5


def target_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per-request temperature / top-k / top-p transform of `logits` [B, N, V] -> float32 probs.

    `temperature`, `top_k`, `top_p`: [B]. Temperature < `GREEDY_TEMPERATURE_EPS` means greedy:
    the row becomes the one-hot of `argmax(logits)`, so sampling verification on it reproduces
    greedy verification exactly. `top_k <= 0` or `>= V` and `top_p >= 1` disable those filters.
    Top-p applies to the distribution left after top-k (renormalised), as SGLang and vLLM do.
    """
    batch_size, _, vocab_size = logits.shape
    device = logits.device
    temperature = temperature.to(device=device, dtype=torch.float32)
    top_k = top_k.to(device=device, dtype=torch.int64)
    top_p = top_p.to(device=device, dtype=torch.float32)

    greedy = temperature < GREEDY_TEMPERATURE_EPS  # [B]
    safe_temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits.float() / safe_temperature.view(batch_size, 1, 1), dim=-1)  # [B, N, V]

    limits_k = (top_k > 0) & (top_k < vocab_size)
    filtered = ~greedy & (limits_k | (top_p < 1))
    if bool(filtered.any()):
        probs = torch.where(filtered.view(batch_size, 1, 1), _top_k_top_p(probs, top_k, top_p), probs)

    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.view(batch_size, 1, 1), one_hot, probs)
    return probs


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero everything outside each row's top-k, then outside the top-p nucleus; renormalise."""
    batch_size, _, vocab_size = probs.shape
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [B, N, V]
    rank = torch.arange(vocab_size, device=probs.device)
    k_eff = torch.where(top_k > 0, top_k, vocab_size).view(batch_size, 1, 1)
    keep_sorted = (rank < k_eff).expand_as(sorted_probs).clone()  # [B, N, V]
    kept_probs = sorted_probs * keep_sorted
    mass_before = kept_probs.cumsum(dim=-1) - kept_probs  # exclusive prefix sum
    nucleus_mass = top_p.view(batch_size, 1, 1) * kept_probs.sum(dim=-1, keepdim=True)
    keep_sorted &= mass_before < nucleus_mass
    keep_sorted[..., 0] = True  # the most probable token always survives
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)
