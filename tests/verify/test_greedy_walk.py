"""The host and device greedy walks make exactly the reference `verify_greedy`'s decisions."""

import numpy as np
import pytest
import torch

from ddtree_serve.tree import build_chain, build_ddtree, build_ddtree_batch, build_verify_batch, draft_topk
from ddtree_serve.verify import get_greedy_backend, greedy_backend_names, verify_greedy
from ddtree_serve.verify.backends import torch_greedy_walk
from ddtree_serve.verify.greedy_device import greedy_walk_on_device
from ddtree_serve.verify.greedy_host import greedy_walk_on_host

CUDA = torch.cuda.is_available()
VOCAB = 12


def rigged_logits(batch, rng: np.random.Generator, p_follow: float) -> torch.Tensor:
    """[B, N, V] random logits whose argmax at a node is one of its children's tokens w.p. p_follow."""
    logits = torch.from_numpy(rng.normal(size=(batch.batch_size, batch.padded_num_nodes, VOCAB))).float()
    tokens, parents = batch.tokens.numpy(), batch.parents.numpy()
    for b in range(batch.batch_size):
        for node in range(int(batch.num_nodes[b])):
            children = np.flatnonzero(parents[b] == node)
            if len(children) and rng.random() < p_follow:
                logits[b, node, tokens[b, rng.choice(children)]] = 10.0
    return logits


def random_batches(rng: np.random.Generator, count: int):
    """`count` (batch, logits) pairs: mixed chains and DDTrees, logits that follow the tree often."""
    for trial in range(count):
        trees = []
        for _ in range(int(rng.integers(1, 5))):
            root = int(rng.integers(VOCAB))
            if trial % 4 == 0:
                trees.append(build_chain(rng.integers(VOCAB, size=int(rng.integers(0, 6))), root))
            else:
                logp, ids = draft_topk(torch.from_numpy(rng.normal(size=(5, VOCAB))).float(), 4)
                trees.append(build_ddtree(logp, ids, int(rng.integers(1, 20)), root))
        batch = build_verify_batch(trees)
        yield batch, rigged_logits(batch, rng, p_follow=0.8)


@pytest.mark.parametrize(
    ("walk", "seed"), [(greedy_walk_on_host, 0), (greedy_walk_on_device, 2)], ids=["host", "device"]
)
def test_walk_matches_reference_on_random_trees(walk, seed):
    rng = np.random.default_rng(seed)
    deepest = 0
    for batch, logits in random_batches(rng, 40):
        expected = verify_greedy(batch, logits)
        accept_index, accept_len, bonus = walk(batch, logits.argmax(dim=-1))
        assert torch.equal(accept_index, expected.accept_index)
        assert torch.equal(accept_len, expected.accept_len)
        assert torch.equal(bonus, expected.bonus_token)
        deepest = max(deepest, int(accept_len.max()))
    assert deepest >= 3  # the rigged logits make the walks go deep


def test_device_walk_matches_reference_on_device_built_trees():
    """Device-built batches: padded to budget_max + 1, max_depth the static bound."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        batch_size, budget_max = int(rng.integers(1, 5)), int(rng.integers(1, 20))
        logp, ids = draft_topk(torch.from_numpy(rng.normal(size=(batch_size, 5, VOCAB))).float(), 4)
        budgets = torch.from_numpy(rng.integers(0, budget_max + 1, size=batch_size))
        roots = torch.from_numpy(rng.integers(VOCAB, size=batch_size))
        batch = build_ddtree_batch(logp, ids, budgets, roots, budget_max).verify
        logits = rigged_logits(batch, rng, p_follow=0.8)
        expected = verify_greedy(batch, logits)
        accept_index, accept_len, bonus = greedy_walk_on_device(batch, logits.argmax(dim=-1))
        assert torch.equal(accept_index, expected.accept_index)
        assert torch.equal(accept_len, expected.accept_len)
        assert torch.equal(bonus, expected.bonus_token)


def test_registry_resolves_greedy_backends_once_by_name():
    assert greedy_backend_names() == ["torch", "host", "device"]
    assert get_greedy_backend("torch") is torch_greedy_walk
    assert get_greedy_backend("host") is greedy_walk_on_host
    assert get_greedy_backend("device") is greedy_walk_on_device
    with pytest.raises(ValueError, match="unknown greedy verify backend"):
        get_greedy_backend("triton")


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))]
)
def test_every_greedy_backend_equals_the_reference(device: str):
    rng = np.random.default_rng(1)
    for batch, logits in random_batches(rng, 20):
        expected = verify_greedy(batch, logits)
        for name in greedy_backend_names():
            result = verify_greedy(batch, logits.to(device), backend=name)
            assert torch.equal(result.accept_index.cpu(), expected.accept_index), name
            assert torch.equal(result.accept_len.cpu(), expected.accept_len), name
            assert torch.equal(result.bonus_token.cpu(), expected.bonus_token), name
