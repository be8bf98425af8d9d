"""Greedy verification: a rigged hand-worked tree, a naive walk on random batches, chains."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_serve.tree import DraftTree, build_chain, build_ddtree, build_verify_batch, draft_topk
from ddtree_serve.verify import target_probs, verify_greedy, verify_sampling

VOCAB = 8


def _tree(tokens: list[int], parents: list[int], logws: list[float]) -> DraftTree:
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    return DraftTree(
        token_ids=np.array(tokens, dtype=np.int64),
        depths=np.array(depths, dtype=np.int64),
        parents=np.array(parents, dtype=np.int64),
        logws=np.array(logws, dtype=np.float64),
    )


def _rigged_logits(argmax_per_node: list[int], num_slots: int) -> torch.Tensor:
    logits = torch.zeros(1, num_slots, VOCAB)
    for node, token in enumerate(argmax_per_node):
        logits[0, node, token] = 5.0
    return logits


def test_rigged_tree_accepts_the_argmax_path() -> None:
    #         0 (root 1)
    #       /    \
    #    1:2      2:3
    #    / \        \
    #  3:4  4:5     5:6
    #        |
    #       6:7
    tree = _tree([1, 2, 3, 4, 5, 6, 7], [-1, 0, 0, 1, 1, 2, 4], [0, -1, -2, -2, -3, -3, -4])
    batch = build_verify_batch([tree])
    # Target argmax at each node: root -> 2 (node 1), node 1 -> 5 (node 4), node 4 -> 7 (node 6),
    # node 6 -> 0 (bonus).
    result = verify_greedy(batch, _rigged_logits([2, 5, 0, 0, 7, 0, 0], 7))
    assert result.accept_index.tolist() == [[0, 1, 4, 6]]
    assert result.accept_len.tolist() == [3]
    assert result.bonus_token.tolist() == [0]
    assert result.emitted_tokens(batch) == [[2, 5, 7, 0]]

    # Root's argmax is 3 (second child), then 0 is not a child of node 2: stop with bonus 0.
    result = verify_greedy(batch, _rigged_logits([3, 0, 0, 0, 0, 0, 0], 7))
    assert result.accept_index.tolist() == [[0, 2, -1, -1]]
    assert result.emitted_tokens(batch) == [[3, 0]]

    # Nothing matches at the root: only the bonus.
    result = verify_greedy(batch, _rigged_logits([6, 0, 0, 0, 0, 0, 0], 7))
    assert result.accept_len.tolist() == [0]
    assert result.emitted_tokens(batch) == [[6]]


def _naive_greedy(tree: DraftTree, target_argmax: np.ndarray) -> list[int]:
    """Walk the tree node by node with the target argmax; returns the emitted tokens."""
    node, emitted = 0, []
    while True:
        want = int(target_argmax[node])
        matches = [c for c in tree.children(node) if tree.token_ids[c] == want]
        emitted.append(want)
        if not matches:
            return emitted
        node = int(matches[0])


def _random_trees(generator: torch.Generator, count: int, num_levels: int, k: int) -> list[DraftTree]:
    trees = []
    for i in range(count):
        logits = torch.randn(num_levels, VOCAB, generator=generator) * 2
        budget = int(torch.randint(1, 20, (1,), generator=generator))
        if i % 4 == 0:
            trees.append(build_chain(logits.argmax(-1), root_token=i % VOCAB))
        else:
            trees.append(build_ddtree(*draft_topk(logits, k), budget=budget, root_token=i % VOCAB))
    return trees


def test_greedy_equals_naive_walk_on_random_batches() -> None:
    generator = torch.Generator().manual_seed(1234)
    for _ in range(20):
        trees = _random_trees(generator, count=16, num_levels=5, k=3)
        batch = build_verify_batch(trees, n_max=24)
        # Sharp target logits concentrated on few tokens so that long paths get accepted.
        logits = torch.randn(16, 24, VOCAB, generator=generator) * 3
        result = verify_greedy(batch, logits)
        argmax = logits.argmax(-1).numpy()
        expected = [_naive_greedy(tree, argmax[b]) for b, tree in enumerate(trees)]
        assert result.emitted_tokens(batch) == expected


def test_sampling_at_temperature_zero_equals_greedy() -> None:
    generator = torch.Generator().manual_seed(99)
    trees = _random_trees(generator, count=32, num_levels=5, k=3)
    batch = build_verify_batch(trees)
    logits = torch.randn(32, batch.padded_num_nodes, VOCAB, generator=generator) * 3
    greedy = verify_greedy(batch, logits)
    zeros = torch.zeros(32)
    probs = target_probs(logits, zeros, torch.zeros(32, dtype=torch.int64), torch.ones(32))
    for coins in (
        torch.rand(32, batch.padded_num_nodes, generator=generator),
        torch.zeros(32, batch.padded_num_nodes),
    ):
        sampled = verify_sampling(batch, probs, coins, coins[:, 0])
        assert torch.equal(sampled.accept_index, greedy.accept_index)
        assert torch.equal(sampled.bonus_token, greedy.bonus_token)


@settings(max_examples=200, deadline=None)
@given(
    draft=st.lists(st.integers(0, 2), min_size=0, max_size=8),
    data=st.data(),
)
def test_chain_greedy_is_dflash_cumprod_rule(draft: list[int], data: st.DataObject) -> None:
    # Target's argmax after the root and after each chain node: L + 1 predictions.
    target = data.draw(st.lists(st.integers(0, 2), min_size=len(draft) + 1, max_size=len(draft) + 1))
    batch = build_verify_batch([build_chain(np.array(draft, dtype=np.int64), root_token=0)])
    logits = torch.nn.functional.one_hot(torch.tensor(target), 3).float().unsqueeze(0)  # [1, L+1, 3]
    draft_t, target_t = torch.tensor(draft, dtype=torch.int64), torch.tensor(target)
    dflash_accepted = int(torch.cumprod((draft_t == target_t[: len(draft)]).long(), dim=0).sum())
    result = verify_greedy(batch, logits)
    assert int(result.accept_len[0]) == dflash_accepted
    assert result.emitted_tokens(batch) == [target[: dflash_accepted + 1]]
