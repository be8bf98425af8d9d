"""The host greedy walk makes exactly the reference `verify_greedy`'s decisions."""

import numpy as np
import torch

from ddtree_serve.engine.greedy_walk import greedy_walk_on_host
from ddtree_serve.tree import build_chain, build_ddtree, build_verify_batch, draft_topk
from ddtree_serve.verify import verify_greedy

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


def test_host_walk_matches_reference_on_random_trees():
    rng = np.random.default_rng(0)
    deepest = 0
    for trial in range(40):
        trees = []
        for _ in range(int(rng.integers(1, 5))):
            root = int(rng.integers(VOCAB))
            if trial % 4 == 0:
                trees.append(build_chain(rng.integers(VOCAB, size=int(rng.integers(0, 6))), root))
            else:
                logp, ids = draft_topk(torch.from_numpy(rng.normal(size=(5, VOCAB))).float(), 4)
                trees.append(build_ddtree(logp, ids, int(rng.integers(1, 20)), root))
        batch = build_verify_batch(trees)
        logits = rigged_logits(batch, rng, p_follow=0.8)
        expected = verify_greedy(batch, logits)
        accept_index, accept_len, bonus = greedy_walk_on_host(batch, logits.argmax(dim=-1))
        assert torch.equal(accept_index, expected.accept_index)
        assert torch.equal(accept_len, expected.accept_len)
        assert torch.equal(bonus, expected.bonus_token)
        deepest = max(deepest, int(accept_len.max()))
    assert deepest >= 3  # the rigged logits make the walks go deep
