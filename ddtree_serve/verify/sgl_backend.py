"""Adapter onto `sgl_kernel.tree_speculative_sampling_target_only` (CUDA, optional).

Importing this module fails when sgl_kernel is absent; the registry turns that into
`BackendUnavailableError`. The kernel has no `q > 0` guard, so coins of exactly 0 are raised to
the smallest normal float32: a child of probability 0 can then never satisfy `coin <= acc`
(only children with 0 < q < 1.2e-38 could behave differently).

sgl-kernel releases differ in one argument: older ones take a `draft_probs` buffer `[B, N, V]`
after `target_probs` (zeros for target-only verification), newer ones do not take it.
The signature is read once here and every argument is passed by name.
"""

from __future__ import annotations

import inspect

import torch
from sgl_kernel import tree_speculative_sampling_target_only

from ddtree_serve.tree import VerifyBatch

_TAKES_DRAFT_PROBS = "draft_probs" in inspect.signature(tree_speculative_sampling_target_only).parameters


def sgl_kernel_walk(
    batch: VerifyBatch,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    threshold_single: float,
    threshold_acc: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `backends.torch_walk`; the kernel's own bonus sample is discarded."""
    batch_size, num_slots = batch.tokens.shape
    device = target_probs.device
    predicts = torch.full((batch_size * num_slots,), -1, dtype=torch.int32, device=device)
    accept_index = torch.full((batch_size, batch.max_depth + 1), -1, dtype=torch.int32, device=device)
    accept_token_num = torch.zeros(batch_size, dtype=torch.int32, device=device)
    safe_coins = coins.to(device=device, dtype=torch.float32).clamp(min=torch.finfo(torch.float32).tiny)
    probs = target_probs.float().contiguous()
    extra = {"draft_probs": torch.zeros_like(probs)} if _TAKES_DRAFT_PROBS else {}
    tree_speculative_sampling_target_only(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_token_num,
        candidates=batch.tokens.contiguous(),
        retrive_index=batch.retrieve_index.contiguous(),
        retrive_next_token=batch.retrieve_next_token.contiguous(),
        retrive_next_sibling=batch.retrieve_next_sibling.contiguous(),
        uniform_samples=safe_coins.contiguous(),
        uniform_samples_for_final_sampling=torch.zeros(batch_size, dtype=torch.float32, device=device),
        target_probs=probs,
        **extra,
        threshold_single=float(threshold_single),
        threshold_acc=float(threshold_acc),
        deterministic=True,
    )
    # The kernel reports flat rows (b * N + i); convert to local node indices.
    row_base = (torch.arange(batch_size, device=device) * num_slots).view(-1, 1)
    accept_local = torch.where(accept_index >= 0, accept_index.long() - row_base, -1)
    return accept_local, accept_token_num.long()
