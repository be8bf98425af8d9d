"""The reference tree walk: which draft nodes the target accepts (PyTorch, CPU or CUDA).

This is the specification every verification backend is tested against on the same coins.
Per request, starting at the root, each level tries the current node's children in linked
(descending logw) order, adding each child's target probability to a running sum `acc`;
the first child with `q > 0` and (`coin[row] < acc / max(threshold_acc, 1e-9)` or
`q >= threshold_single`) is accepted and becomes the current node. This is the rule of SGLang's
`tree_speculative_sampling_target_only` after its fix for issue #35771. With thresholds at 1 it
is inverse-CDF sampling of the target distribution over the ordered children with half-open
buckets `[acc - q, acc)`, so acceptance is exact for coins in [0, 1): a coin on a bucket boundary
belongs to the next bucket, and a token of probability 0 (an empty bucket) is never accepted,
not even by a coin of exactly 0. The clamp keeps `threshold_acc <= 0` from dividing by zero.

The walk is vectorised over the batch; Python loops run over depth levels and sibling steps.
All arithmetic is float32 in sibling order, so a kernel doing the same sums agrees bit-for-bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ddtree_serve.tree import VerifyBatch

# (current rows [B], candidate tokens [B]) -> target probability of each candidate [B] float32
ChildProbFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# `threshold_acc` is clamped to at least this before dividing (SGLang's kernel does the same).
THRESHOLD_ACC_MIN = 1e-9


def clamped_threshold_acc(threshold_acc: float) -> float:
    """The divisor every backend uses: `max(threshold_acc, THRESHOLD_ACC_MIN)`.

    Clamping in float64 and then rounding to float32 gives the kernel's `fmaxf` of the rounded
    values, because rounding is monotonic.
    """
    return max(float(threshold_acc), THRESHOLD_ACC_MIN)


def walk_tree(
    batch: VerifyBatch,
    child_prob: ChildProbFn,
    coins: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk every tree of `batch`; returns `(accept_index [B, D+1], accept_len [B])`, int64.

    `coins`: [B, N] uniform draws in [0, 1); the coin of the current node decides among its
    children. Thresholds are applied as float32 (division and comparison), as kernels do.
    """
    batch_size, device = batch.batch_size, batch.device
    rows = torch.arange(batch_size, device=device)
    coins = coins.to(device=device, dtype=torch.float32)
    threshold_single_t = torch.tensor(threshold_single, dtype=torch.float32, device=device)
    threshold_acc_t = torch.tensor(clamped_threshold_acc(threshold_acc), dtype=torch.float32, device=device)

    accept_index = torch.full((batch_size, batch.max_depth + 1), -1, dtype=torch.int64, device=device)
    accept_index[:, 0] = 0
    accept_len = torch.zeros(batch_size, dtype=torch.int64, device=device)
    current = torch.zeros(batch_size, dtype=torch.int64, device=device)  # [B] local node index
    active = torch.ones(batch_size, dtype=torch.bool, device=device)  # still walking down
    none = torch.full_like(current, -1)

    for level in range(1, batch.max_depth + 1):
        coin = coins[rows, current]  # [B]
        acc = torch.zeros(batch_size, dtype=torch.float32, device=device)
        chosen = none
        child = torch.where(active, batch.retrieve_next_token[rows, current], none)
        pending = child >= 0
        while bool(pending.any()):
            node = child.clamp(min=0)
            q = torch.where(pending, child_prob(current, batch.tokens[rows, node]), 0.0)
            acc = acc + q
            hit = pending & (q > 0) & ((coin < acc / threshold_acc_t) | (q >= threshold_single_t))
            chosen = torch.where(hit, node, chosen)
            child = torch.where(hit | ~pending, none, batch.retrieve_next_sibling[rows, node])
            pending = child >= 0
        active = chosen >= 0
        accept_index[:, level] = chosen
        accept_len += active.long()
        current = torch.where(active, chosen, current)
        if not bool(active.any()):
            break
    return accept_index, accept_len


def final_nodes(accept_index: torch.Tensor, accept_len: torch.Tensor) -> torch.Tensor:
    """[B] local index of each request's last accepted node (the root if none was accepted)."""
    return accept_index.gather(1, accept_len.view(-1, 1)).view(-1)
