"""Registries of tree-walk backends for sampling and greedy verification, resolved once per name.

A sampling backend decides the accepted path only; the bonus token is drawn by shared code
(`bonus.sample_bonus`), so backends that walk alike emit alike. Every sampling backend has the
signature of `torch_walk` and is tested against it on the same coins.

A greedy backend walks from the target's argmax per node and returns the bonus too (the argmax
at the last accepted node). Every greedy backend has the signature of `torch_greedy_walk`, the
reference, and is tested against it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import cache
from typing import TypeVar

import torch

from ddtree_serve.tree import VerifyBatch
from ddtree_serve.verify.greedy_device import greedy_walk_on_device
from ddtree_serve.verify.greedy_host import greedy_walk_on_host
from ddtree_serve.verify.walk import final_nodes, walk_tree

logger = logging.getLogger(__name__)

Backend = TypeVar("Backend")

# (batch, target_probs [B, N, V], coins [B, N], threshold_single, threshold_acc)
#   -> (accept_index [B, D+1] int64 local indices, accept_len [B] int64)
TreeWalkBackend = Callable[
    [VerifyBatch, torch.Tensor, torch.Tensor, float, float], tuple[torch.Tensor, torch.Tensor]
]
# (batch, target_argmax [B, N] int64)
#   -> (accept_index [B, D+1] int64 local indices, accept_len [B] int64, bonus_token [B] int64)
GreedyWalkBackend = Callable[[VerifyBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


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


def torch_greedy_walk(
    batch: VerifyBatch, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The greedy reference: `walk.walk_tree` with q = 1 for the argmax token, else 0, coins 0.

    This is the temperature-0 limit of sampling verification: it equals `torch_walk` on the
    one-hot rows of `target_probs(..., temperature=0)` for any coins. Runs on the device of
    `target_argmax` (the batch is moved there if needed); results stay there.
    """
    device = target_argmax.device
    if batch.device != device:
        batch = batch.to(device)
    rows = torch.arange(batch.batch_size, device=device)

    def child_prob(current: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens == target_argmax[rows, current]).float()

    coins = torch.zeros(batch.batch_size, batch.padded_num_nodes, device=device)
    accept_index, accept_len = walk_tree(batch, child_prob, coins)
    bonus = target_argmax[rows, final_nodes(accept_index, accept_len)]
    return accept_index, accept_len, bonus


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
_GREEDY_LOADERS: dict[str, Callable[[], GreedyWalkBackend]] = {
    "torch": lambda: torch_greedy_walk,
    "host": lambda: greedy_walk_on_host,
    "device": lambda: greedy_walk_on_device,
}


def backend_names() -> list[str]:
    """Every registered sampling backend name, available here or not."""
    return list(_LOADERS)


def greedy_backend_names() -> list[str]:
    """Every registered greedy backend name (all of them run anywhere)."""
    return list(_GREEDY_LOADERS)


@cache
def get_backend(name: str) -> TreeWalkBackend:
    """Resolve sampling backend `name` once; ValueError if unknown, BackendUnavailableError if absent."""
    return _resolve("verify", _LOADERS, name)


@cache
def get_greedy_backend(name: str) -> GreedyWalkBackend:
    """Resolve greedy backend `name` once; ValueError if unknown."""
    return _resolve("greedy verify", _GREEDY_LOADERS, name)


def backend_available(name: str) -> bool:
    """True when `get_backend(name)` would succeed."""
    try:
        get_backend(name)
    except BackendUnavailableError:
        return False
    return True


def _resolve(kind: str, loaders: dict[str, Callable[[], Backend]], name: str) -> Backend:
    if name not in loaders:
        raise ValueError(f"unknown {kind} backend {name!r}; registered: {list(loaders)}")
    backend = loaders[name]()
    logger.info("%s backend %r -> %s.%s", kind, name, backend.__module__, backend.__qualname__)
    return backend
