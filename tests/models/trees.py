"""Random draft trees for model tests, turned into a real `VerifyBatch` by the tree package."""

import numpy as np
import torch

from ddtree_serve.tree import DraftTree, VerifyBatch, build_verify_batch


def random_parents(num_nodes: int, generator: torch.Generator) -> list[int]:
    """Parents of a random tree in node order: root -1, each parent earlier than its child."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, num_nodes)]


def path_to(parents: list[int], node: int) -> list[int]:
    """Nodes from the root to `node`, both included."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def tree_inputs(trees: list[tuple[list[int], list[int]]], padded_num_nodes: int) -> VerifyBatch:
    """`trees[b] = (token_ids, parents)` -> a `VerifyBatch` padded to `padded_num_nodes` nodes."""
    draft_trees = []
    for token_ids, parents in trees:
        depths = [len(path_to(parents, i)) - 1 for i in range(len(token_ids))]
        draft_trees.append(
            DraftTree(
                token_ids=np.array(token_ids, dtype=np.int64),
                depths=np.array(depths, dtype=np.int64),
                parents=np.array(parents, dtype=np.int64),
                logws=-np.arange(len(token_ids), dtype=np.float64),  # any order works for the model
            )
        )
    return build_verify_batch(draft_trees, n_max=padded_num_nodes)
