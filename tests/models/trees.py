"""Hand-built verify inputs for model tests: random trees and the VerifyBatch fields the runner reads."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeInputs:
    """The `VerifyBatch` fields `TargetRunner.verify` consumes, padded like the tree package pads."""

    tokens: torch.Tensor  # [B, N] int64, padding 0
    depths: torch.Tensor  # [B, N] int64, padding 0
    attn_mask: torch.Tensor  # [B, N, N] bool, padding rows see only themselves


def random_parents(num_nodes: int, generator: torch.Generator) -> list[int]:
    """Parents of a random tree in node order: root -1, each parent earlier than its child."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, num_nodes)]


def path_to(parents: list[int], node: int) -> list[int]:
    """Nodes from the root to `node`, both included."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def tree_inputs(trees: list[tuple[list[int], list[int]]], num_slots: int) -> TreeInputs:
    """`trees[b] = (token_ids, parents)` -> padded inputs with ancestor masks."""
    batch = len(trees)
    tokens = torch.zeros(batch, num_slots, dtype=torch.int64)
    depths = torch.zeros(batch, num_slots, dtype=torch.int64)
    mask = torch.eye(num_slots, dtype=torch.bool).repeat(batch, 1, 1)
    for b, (token_ids, parents) in enumerate(trees):
        for i in range(len(token_ids)):
            ancestors = path_to(parents, i)
            tokens[b, i] = token_ids[i]
            depths[b, i] = len(ancestors) - 1
            mask[b, i, ancestors] = True
    return TreeInputs(tokens, depths, mask)
