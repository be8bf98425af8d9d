"""Hand-worked DDTree builds: every node order, parent, logw and sibling link written out."""

import math

import numpy as np
import torch

from ddtree_serve.tree import build_chain, build_ddtree, build_verify_batch, draft_topk

# Drafter distribution, L = 3 positions, K = 2 ranks (probabilities, descending per row).
# Powers of two make the ties below exact in floating point too.
#   depth 1: token 10 p=1/2, token 11 p=1/4
#   depth 2: token 20 p=1/2, token 21 p=1/4
#   depth 3: token 30 p=3/4, token 31 p=1/8
PROBS = np.array([[0.5, 0.25], [0.5, 0.25], [0.75, 0.125]])
IDS = np.array([[10, 11], [20, 21], [30, 31]])
LOGP = np.log(PROBS)

# Budget 6, prefixes popped best first (ties: lexicographically smaller rank path first):
#   1: [10]          1/2
#   2: [10,20]       1/4    ties [11] 1/4: rank path (0,0) < (1,)
#   3: [11]          1/4
#   4: [10,20,30]    3/16
#   5: [10,21]       1/8    ties [11,20] 1/8: (0,1) < (1,0)
#   6: [11,20]       1/8
#
#             0 (root 5)
#           /          \
#        1:10          3:11
#        /    \           \
#     2:20    5:21        6:20
#      |
#     4:30
EXPECTED_TOKENS = [5, 10, 20, 11, 30, 21, 20]
EXPECTED_PARENTS = [-1, 0, 1, 0, 2, 1, 3]
EXPECTED_DEPTHS = [0, 1, 2, 1, 3, 2, 2]
EXPECTED_PROBS = [1.0, 1 / 2, 1 / 4, 1 / 4, 3 / 16, 1 / 8, 1 / 8]


def test_hand_worked_tree_nodes() -> None:
    tree = build_ddtree(LOGP, IDS, budget=6, root_token=5)
    assert tree.token_ids.tolist() == EXPECTED_TOKENS
    assert tree.parents.tolist() == EXPECTED_PARENTS
    assert tree.depths.tolist() == EXPECTED_DEPTHS
    np.testing.assert_allclose(np.exp(tree.logws), EXPECTED_PROBS, rtol=1e-12)
    assert tree.children(0).tolist() == [1, 3]
    assert tree.children(1).tolist() == [2, 5]
    assert tree.children(2).tolist() == [4]
    assert tree.children(3).tolist() == [6]
    assert tree.children(4).tolist() == []
    # One more node: [10,21,30] and [11,20,30] tie at 3/32; (0,1,0) < (1,0,0).
    bigger = build_ddtree(LOGP, IDS, budget=7, root_token=5)
    assert bigger.token_ids[7] == 30 and bigger.parents[7] == 5


def test_hand_worked_tree_buffers() -> None:
    batch = build_verify_batch([build_ddtree(LOGP, IDS, budget=6, root_token=5)], n_max=8)
    assert batch.tokens.tolist() == [[*EXPECTED_TOKENS, 0]]
    assert batch.depths.tolist() == [[*EXPECTED_DEPTHS, 0]]
    #                       node:   0  1  2   3   4   5   6   7(pad)
    assert batch.retrieve_next_token.tolist() == [[1, 2, 4, 6, -1, -1, -1, -1]]
    assert batch.retrieve_next_sibling.tolist() == [[-1, 3, 5, -1, -1, -1, -1, -1]]
    assert batch.retrieve_index.tolist() == [list(range(8))]
    assert batch.num_nodes.tolist() == [7]
    assert batch.max_depth == 3
    expected_mask = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
            [1, 0, 0, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 0, 1, 0, 0],
            [1, 0, 0, 1, 0, 0, 1, 0],
            [0, 0, 0, 0, 0, 0, 0, 1],  # padding attends only to itself
        ],
        dtype=torch.bool,
    )
    assert torch.equal(batch.attn_mask[0], expected_mask)


def test_budget_larger_than_tree_takes_every_prefix() -> None:
    # 2 + 4 + 8 prefixes exist; the heap empties before the budget.
    tree = build_ddtree(LOGP, IDS, budget=100, root_token=5)
    assert tree.num_nodes == 15
    assert build_ddtree(LOGP, IDS, budget=0, root_token=5).num_nodes == 1


def test_chain_is_the_rank0_path() -> None:
    chain = build_chain(IDS[:, 0], root_token=5, logp_row0=LOGP[:, 0])
    assert chain.token_ids.tolist() == [5, 10, 20, 30]
    assert chain.parents.tolist() == [-1, 0, 1, 2]
    assert chain.depths.tolist() == [0, 1, 2, 3]
    assert math.isclose(float(np.exp(chain.logws[-1])), 0.5 * 0.5 * 0.75)
    assert build_ddtree(LOGP[:, :1], IDS[:, :1], budget=3, root_token=5).token_ids.tolist() == [5, 10, 20, 30]


def test_draft_topk_normalises_over_full_vocab() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, -1.0, 0.5, 0.0]])
    logp, ids = draft_topk(logits, 2)
    assert ids.tolist() == [[3, 2], [0, 2]]
    full = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(logp, full.gather(1, ids))
    batched_logp, batched_ids = draft_topk(logits.expand(3, 2, 4), 9)
    assert batched_logp.shape == (3, 2, 4) and batched_ids.shape == (3, 2, 4)


def test_long_chain_mask_is_lower_triangular() -> None:
    for num_levels in (1, 2, 7, 15, 16, 33):
        batch = build_verify_batch([build_chain(np.arange(num_levels), root_token=0)])
        expected = torch.tril(torch.ones(num_levels + 1, num_levels + 1, dtype=torch.bool))
        assert torch.equal(batch.attn_mask[0], expected)
