"""Adapter onto `sgl_kernel.tree_speculative_sampling_target_only` (CUDA, optional).

Importing this module fails when sgl_kernel is absent; the registry turns that into
`BackendUnavailableError`.

Two kernel semantics are in the field. The fix for SGLang issue #35771 accepts a child when
`q > 0 and (coin < acc / threshold_acc or q >= threshold_single)`, our reference rule; that
fix ships in SGLang's JIT kernels, and sgl-kernel wheels built before it accept when
`coin <= acc / threshold_acc or q >= threshold_single`. Which one is installed cannot be read
from a compiled kernel, so the adapter asks it once per device with a one-child tree whose coin
lies exactly on the child's cumulative probability (`_kernel_is_half_open`), then feeds the
older kernel inputs under which its rule decides as the new one does:

- coins become `nextafter(coin, +inf)`: for float32 `a` and `x`, `a < x` exactly when
  `nextafter(a, +inf) <= x`;
- coins and `threshold_single` are raised to at least the smallest normal float32, so a kernel
  that flushes subnormals to zero still never passes `0 <= 0` or `0 >= 0`;
- a child with `q = 0` then cannot be accepted: `acc` is what the previous sibling was rejected
  with (or 0 at the first child), and `q >= threshold_single` fails.

What remains different on an older kernel is a coin of 0 against `0 < acc / threshold_acc` below
1.2e-38 (that child is rejected there, accepted by the rule), and `0 < q < 1.2e-38` against a
`threshold_single` at or below 1.2e-38. `threshold_acc` is clamped here as the reference does,
which makes the kernel's own clamp (where it has one) a no-op.

sgl-kernel releases also differ in one argument: older ones take a `draft_probs` buffer
`[B, N, V]` after `target_probs` (zeros for target-only verification), newer ones do not take
it. The signature is read once here and every argument is passed by name.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch
from sgl_kernel import tree_speculative_sampling_target_only

from ddtree_serve.tree import VerifyBatch
from ddtree_serve.verify.walk import clamped_threshold_acc

_TAKES_DRAFT_PROBS = "draft_probs" in inspect.signature(tree_speculative_sampling_target_only).parameters
_SMALLEST_NORMAL = torch.finfo(torch.float32).tiny


def sgl_kernel_walk(
    batch: VerifyBatch,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    threshold_single: float,
    threshold_acc: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `backends.torch_walk`; the kernel's own bonus sample is discarded."""
    device = target_probs.device
    kernel_coins = coins.to(device=device, dtype=torch.float32)
    kernel_threshold_single = float(threshold_single)
    if not _kernel_is_half_open(device):
        kernel_coins = torch.nextafter(kernel_coins, torch.tensor(torch.inf, device=device))
        kernel_coins = kernel_coins.clamp(min=_SMALLEST_NORMAL)
        kernel_threshold_single = max(kernel_threshold_single, _SMALLEST_NORMAL)
    return _run_kernel(
        tokens=batch.tokens,
        retrieve_index=batch.retrieve_index,
        next_token=batch.retrieve_next_token,
        next_sibling=batch.retrieve_next_sibling,
        coins=kernel_coins,
        target_probs=target_probs,
        threshold_single=kernel_threshold_single,
        threshold_acc=clamped_threshold_acc(threshold_acc),
        max_depth=batch.max_depth,
    )


@cache
def _kernel_is_half_open(device: torch.device) -> bool:
    """True when the installed kernel compares `coin < acc` (after SGLang #35771), not `<=`.

    The probe: a root with one child of target probability 0.5 and a root coin of 0.5. The
    half-open rule rejects the child, the inclusive one accepts it.
    """
    accept_index, _ = _run_kernel(
        tokens=torch.tensor([[0, 1]], device=device),
        retrieve_index=torch.tensor([[0, 1]], device=device),
        next_token=torch.tensor([[1, -1]], device=device),
        next_sibling=torch.tensor([[-1, -1]], device=device),
        coins=torch.tensor([[0.5, 0.5]], device=device),
        target_probs=torch.full((1, 2, 2), 0.5, device=device),
        threshold_single=1.0,
        threshold_acc=1.0,
        max_depth=1,
    )
    return int(accept_index[0, 1]) == -1


def _run_kernel(
    *,
    tokens: torch.Tensor,
    retrieve_index: torch.Tensor,
    next_token: torch.Tensor,
    next_sibling: torch.Tensor,
    coins: torch.Tensor,
    target_probs: torch.Tensor,
    threshold_single: float,
    threshold_acc: float,
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel call on `[B, N]` tree buffers -> (accept_index [B, D+1] local, accept_len [B])."""
    batch_size, padded_num_nodes = tokens.shape
    device = target_probs.device
    predicts = torch.full((batch_size * padded_num_nodes,), -1, dtype=torch.int32, device=device)
    accept_index = torch.full((batch_size, max_depth + 1), -1, dtype=torch.int32, device=device)
    accept_token_num = torch.zeros(batch_size, dtype=torch.int32, device=device)
    probs = target_probs.float().contiguous()
    extra = {"draft_probs": torch.zeros_like(probs)} if _TAKES_DRAFT_PROBS else {}
    tree_speculative_sampling_target_only(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_token_num,
        candidates=tokens.contiguous(),
        retrive_index=retrieve_index.contiguous(),
        retrive_next_token=next_token.contiguous(),
        retrive_next_sibling=next_sibling.contiguous(),
        uniform_samples=coins.contiguous(),
        uniform_samples_for_final_sampling=torch.zeros(batch_size, dtype=torch.float32, device=device),
        target_probs=probs,
        **extra,
        threshold_single=float(threshold_single),
        threshold_acc=float(threshold_acc),
        deterministic=True,
    )
    # The kernel reports flat rows (b * N + i); convert to local node indices.
    row_base = (torch.arange(batch_size, device=device) * padded_num_nodes).view(-1, 1)
    accept_local = torch.where(accept_index >= 0, accept_index.long() - row_base, -1)
    return accept_local, accept_token_num.long()
