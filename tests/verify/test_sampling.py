"""Sampling verification on hand-worked trees with rigged probabilities and coins."""

import numpy as np
import pytest
import torch

from ddtree_serve.tree import DraftTree, build_ddtree, build_verify_batch, draft_topk
from ddtree_serve.verify import target_probs, verify_greedy, verify_sampling

#          0 (root 0)
#        /    |    \
#     1:2    2:3    3:4      root's children in descending logw order
#      |
#     4:5
TREE = DraftTree(
    token_ids=np.array([0, 2, 3, 4, 5]),
    depths=np.array([0, 1, 1, 1, 2]),
    parents=np.array([-1, 0, 0, 0, 1]),
    logws=np.array([0.0, -0.5, -1.0, -2.0, -1.5]),
)
PROBS = torch.tensor(
    [
        [0.1, 0.1, 0.3, 0.4, 0.0, 0.1],  # root: children 2 (0.3), 3 (0.4), 4 (0.0)
        [0.5, 0.0, 0.0, 0.0, 0.0, 0.5],  # node 1: child 5 (0.5)
        [0.25, 0.25, 0.25, 0.25, 0.0, 0.0],  # node 2: leaf
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ]
).unsqueeze(0)


def run(coin_root: float, coin_node1: float, coin_final: float, **thresholds: float) -> tuple[list, int]:
    batch = build_verify_batch([TREE])
    coins = torch.tensor([[coin_root, coin_node1, 0.0, 0.0, 0.0]])
    result = verify_sampling(batch, PROBS, coins, torch.tensor([coin_final]), **thresholds)
    assert int(result.accept_len[0]) == int((result.accept_index[0] >= 0).sum()) - 1
    return result.accept_index[0].tolist(), int(result.bonus_token[0])


def test_first_child_accepted_then_child_rejected() -> None:
    # Root: coin 0.2 < acc 0.3 at node 1. Node 1: coin 0.6 > 0.5 rejects node 4 (token 5);
    # bonus from node 1's row without token 5 = token 0 whatever coin_final is.
    assert run(0.2, 0.6, 0.9) == ([0, 1, -1], 0)


def test_second_child_accepted_then_leaf_bonus_by_inverse_cdf() -> None:
    # Root: acc 0.3 <= 0.65 < 0.7 accepts node 2 (token 3), a leaf. Bonus: cdf of node 2's row is
    # 0.25, 0.5, 0.75, 1.0; u = 0.6 falls in token 2's interval.
    assert run(0.65, 0.0, 0.6) == ([0, 2, -1], 2)


def test_all_children_rejected_bonus_from_residual() -> None:
    # Root: acc 0.3, 0.7, 0.7 all < 0.75. Residual: tokens 0, 1, 5 with 0.1 each; u = 0.5 * 0.3
    # = 0.15 falls in token 1's interval (0.1, 0.2].
    assert run(0.75, 0.0, 0.5) == ([0, -1, -1], 1)


def test_thresholds_accept_more() -> None:
    assert run(0.75, 0.0, 0.5, threshold_single=0.35) == ([0, 2, -1], 2)  # q = 0.4 >= 0.35
    assert run(0.75, 0.0, 0.5, threshold_acc=0.5) == ([0, 2, -1], 2)  # 0.75 < 0.7 / 0.5


def test_coin_zero_never_accepts_a_zero_probability_token() -> None:
    probs = PROBS.clone()
    probs[0, 0] = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0, 0.0])  # every root child has q = 0
    batch = build_verify_batch([TREE])
    result = verify_sampling(batch, probs, torch.zeros(1, 5), torch.zeros(1))
    assert result.accept_len.tolist() == [0]
    assert result.bonus_token.tolist() == [0]  # first token with positive residual
    # Coin 0 still accepts the first child that has positive probability.
    result = verify_sampling(batch, PROBS, torch.zeros(1, 5), torch.zeros(1))
    assert result.accept_index[0].tolist() == [0, 1, 4]


def test_bonus_is_never_a_child_or_zero_probability_token() -> None:
    generator = torch.Generator().manual_seed(3)
    trees = [build_ddtree(*draft_topk(torch.randn(3, 6, generator=generator), 3), 6, 0) for _ in range(64)]
    batch = build_verify_batch(trees)
    logits = torch.randn(64, batch.padded_num_nodes, 6, generator=generator)
    probs = target_probs(logits, torch.ones(64), torch.full((64,), 3), torch.ones(64))
    result = verify_sampling(
        batch,
        probs,
        torch.rand(64, batch.padded_num_nodes, generator=generator),
        torch.rand(64, generator=generator),
    )
    final = result.accept_index.gather(1, result.accept_len.view(-1, 1)).view(-1)
    for b in range(64):
        children_tokens = batch.tokens[b][batch.parents[b] == final[b]].tolist()
        assert int(result.bonus_token[b]) not in children_tokens
        assert probs[b, final[b], result.bonus_token[b]] > 0


def test_mixed_temperatures_greedy_rows_equal_verify_greedy() -> None:
    generator = torch.Generator().manual_seed(11)
    trees = [
        build_ddtree(*draft_topk(torch.randn(4, 8, generator=generator) * 3, 3), 10, 1) for _ in range(8)
    ]
    batch = build_verify_batch(trees)
    logits = torch.randn(8, batch.padded_num_nodes, 8, generator=generator) * 3
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.7, 0.0, 1.3, 0.0, 0.0])
    probs = target_probs(logits, temperature, torch.zeros(8, dtype=torch.int64), torch.ones(8))
    sampled = verify_sampling(
        batch,
        probs,
        torch.rand(8, batch.padded_num_nodes, generator=generator),
        torch.rand(8, generator=generator),
    )
    greedy = verify_greedy(batch, logits)
    rows = temperature == 0
    assert torch.equal(sampled.accept_index[rows], greedy.accept_index[rows])
    assert torch.equal(sampled.bonus_token[rows], greedy.bonus_token[rows])


@pytest.mark.parametrize("top_k", [1, 3])
def test_target_probs_filters(top_k: int) -> None:
    logits = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0]]]).expand(2, 1, 5)
    probs = target_probs(logits, torch.tensor([1.0, 1.0]), torch.tensor([top_k, 0]), torch.tensor([1.0, 0.5]))
    assert torch.allclose(probs.sum(-1), torch.ones(2, 1))
    assert (probs[0, 0] > 0).sum() == top_k
    # Row 1: softmax is 0.64, 0.24, ... : the nucleus at 0.5 holds the top token only.
    assert (probs[1, 0] > 0).sum() == 1
    full = torch.softmax(logits[0, 0], -1)
    assert torch.allclose(probs[0, 0, :top_k], full[:top_k] / full[:top_k].sum())
    greedy = target_probs(logits, torch.zeros(2), torch.tensor([0, 0]), torch.tensor([1.0, 1.0]))
    assert greedy[:, 0].tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]] * 2


def test_vanishing_temperature_is_greedy_not_nan() -> None:
    """1e-30 would overflow logits / temperature into NaN; below 1e-5 a row is the argmax one-hot."""
    logits = torch.tensor([[[0.5, 2.0, -1.0, 1.9]]]).repeat(3, 1, 1)  # [3, 1, 4]
    temperature = torch.tensor([1e-30, 1e-6, 0.5])
    probs = target_probs(logits, temperature, torch.zeros(3, dtype=torch.int64), torch.ones(3))
    assert not torch.isnan(probs).any()
    assert probs[0, 0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert probs[1, 0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert 0.0 < probs[2, 0, 3].item() < probs[2, 0, 1].item() < 1.0
