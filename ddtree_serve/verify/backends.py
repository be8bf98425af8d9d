"""Registry of tree-walk backends for sampling verification, resolved once per name.

A backend decides the accepted path only; the bonus token is drawn by shared code
(`bonus.sample_bonus`), so backends that walk alike emit alike. Every backend has the signature
of `torch_walk` and is tested against it on the same coins.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache

import torch

from ddtree_serve.tree import VerifyBatch
from ddtree_serve.verify.walk import walk_tree

logger = logging.getLogger(__name__)

# (batch, target_probs [B, N, V], coins [B, N], threshold_single, threshold_acc)
#   -> (accept_index [B, D+1] int64 local indices, accept_len [B] int64)
TreeWalkBackend = Callable[
    [VerifyBatch, torch.Tensor, torch.Tensor, float, float], tuple[torch.Tensor, torch.Tensor]
]


class BackendUnavailableError(RuntimeError):
    """The named backend exists but cannot run here (missing package or device)."""


def torch_walk(
    batch: VerifyBatch,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    threshold_single: float,
    threshold_acc: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference backend: `walk.walk_tree` with q read from `target_probs` (CPU or CUDA)."""
    rows = torch.arange(batch.batch_size, device=target_probs.device)

    def child_prob(current: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return target_probs[rows, current, tokens]

    return walk_tree(batch, child_prob, coins, threshold_single, threshold_acc)


def _load_torch() -> TreeWalkBackend:
    return torch_walk


def _load_sgl_kernel() -> TreeWalkBackend:
    try:
        from ddtree_serve.verify.sgl_backend import sgl_kernel_walk
    except ImportError as err:
        raise BackendUnavailableError(f"sgl_kernel is not importable: {err}") from err
    return sgl_kernel_walk


def _load_triton() -> TreeWalkBackend:
    try:
        from ddtree_serve.verify.triton_backend import triton_walk
    except ImportError as err:
        raise BackendUnavailableError(f"triton backend is not importable: {err}") from err
    return triton_walk


_LOADERS: dict[str, Callable[[], TreeWalkBackend]] = {
    "torch": _load_torch,
    "sgl_kernel": _load_sgl_kernel,
    "triton": _load_triton,
}


def backend_names() -> list[str]:
    """Every registered name, available here or not."""
    return list(_LOADERS)


@cache
def get_backend(name: str) -> TreeWalkBackend:
    """Resolve `name` once; raises ValueError for unknown names, BackendUnavailableError if absent."""
    if name not in _LOADERS:
        raise ValueError(f"unknown verify backend {name!r}; registered: {backend_names()}")
    backend = _LOADERS[name]()
    logger.info("verify backend %r -> %s.%s", name, backend.__module__, backend.__qualname__)
    return backend


def backend_available(name: str) -> bool:
    """True when `get_backend(name)` would succeed."""
    try:
        get_backend(name)
    except BackendUnavailableError:
        return False
    return True
