"""The "host" greedy backend: the greedy walk in plain Python, from the target's argmax per node.

Same decisions as the reference `backends.torch_greedy_walk` (tested against it): from the
root, accept the first child in linked (descending logw) order whose token is the target's
argmax at the current node, until no child matches; the bonus is the argmax at the last
accepted node. Worth having because after one `[B, N]` argmax copy the walk is a few dozen host
steps, where the device walk costs a kernel launch per sibling and a sync per level.
"""

from __future__ import annotations

import torch

from ddtree_serve.tree import VerifyBatch


def greedy_walk_on_host(
    batch: VerifyBatch, target_argmax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (accept_index [B, D+1] int64, -1 padded; accept_len [B]; bonus_token [B]), all CPU.

    `batch` and `target_argmax [B, N]` int64 belong on the CPU; device tensors are copied over
    (one blocking copy each), so pass the argmax already on the host where that matters.
    """
    argmax_rows = target_argmax.tolist()  # [B][N]
    token_rows = batch.tokens.tolist()
    first_child_rows = batch.retrieve_next_token.tolist()
    next_sibling_rows = batch.retrieve_next_sibling.tolist()
    accept_index = torch.full((batch.batch_size, batch.max_depth + 1), -1, dtype=torch.int64)
    accept_len = torch.zeros(batch.batch_size, dtype=torch.int64)
    bonus = torch.empty(batch.batch_size, dtype=torch.int64)
    for b in range(batch.batch_size):
        argmax, tokens = argmax_rows[b], token_rows[b]
        first_child, next_sibling = first_child_rows[b], next_sibling_rows[b]
        path = [0]
        current = 0
        while True:
            child = first_child[current]
            while child != -1 and tokens[child] != argmax[current]:
                child = next_sibling[child]
            if child == -1:
                break
            path.append(child)
            current = child
        accept_index[b, : len(path)] = torch.tensor(path)
        accept_len[b] = len(path) - 1
        bonus[b] = argmax[current]
    return accept_index, accept_len, bonus
