"""Adapter onto `sgl_kernel.tree_speculative_sampling_target_only` (CUDA, optional).

Importing this module fails when sgl_kernel is absent; the registry turns that into
`BackendUnavailableError`. The kernel has no `q > 0` guard, so coins of exactly 0 are raised to
the smallest normal float32: a child of probability 0 can then never satisfy `coin <= acc`
(only children with 0 < q < 1.2e-38 could behave differently).
"""

from __future__ import annotations

import torch
from sgl_kernel import tree_speculative_sampling_target_only

from ddtree_serve.tree import VerifyBatch


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
    tree_speculative_sampling_target_only(
        predicts,
        accept_index,
        accept_token_num,
        batch.tokens.contiguous(),
        batch.retrieve_index.contiguous(),
        batch.retrieve_next_token.contiguous(),
        batch.retrieve_next_sibling.contiguous(),
        safe_coins.contiguous(),
        torch.zeros(batch_size, dtype=torch.float32, device=device),
        target_probs.float().contiguous(),
        threshold_single,
        threshold_acc,
        True,
    )
    # The kernel reports flat rows (b * N + i); convert to local node indices.
    row_base = (torch.arange(batch_size, device=device) * num_slots).view(-1, 1)
    accept_local = torch.where(accept_index >= 0, accept_index.long() - row_base, -1)
    return accept_local, accept_token_num.long()
