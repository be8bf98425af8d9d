"""Greedy verification: follow the target's argmax down the tree."""

from __future__ import annotations

import torch

from ddtree_serve.tree import VerifyBatch
from ddtree_serve.verify.backends import get_greedy_backend
from ddtree_serve.verify.result import VerifyResult


def verify_greedy(batch: VerifyBatch, target_logits: torch.Tensor, backend: str = "torch") -> VerifyResult:
    """Accept the child whose token is the target's argmax at its parent, level by level.

    `target_logits`: [B, N, V]. With the default backend, the reference (`torch_greedy_walk`),
    this equals `verify_sampling` on `target_probs(..., temperature=0)` for any coins. The
    result lies where the backend walks: on the logits' device for "torch", the CPU for "host".
    """
    walk = get_greedy_backend(backend)
    accept_index, accept_len, bonus = walk(batch, target_logits.argmax(dim=-1))
    return VerifyResult(accept_index=accept_index, accept_len=accept_len, bonus_token=bonus)
