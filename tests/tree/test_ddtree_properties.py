"""Property tests of the DDTree builder and verify buffers against brute force (hypothesis)."""

import itertools

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_serve.tree import DraftTree, build_chain, build_ddtree, build_verify_batch

# Probabilities from a small grid of dyadic values: many exact ties in the log domain.
GRID = [1.0, 0.75, 0.5, 0.375, 0.25, 0.125, 0.0625, 0.03125]


@st.composite
def drafts(draw: st.DrawFn, max_levels: int = 4, max_ranks: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """(logp [L, K] descending per row, ids [L, K]) with ids = 100 * depth + rank, so a node's
    token names its (depth, rank) uniquely."""
    num_levels = draw(st.integers(1, max_levels))
    num_ranks = draw(st.integers(1, max_ranks))
    values = st.sampled_from(GRID) if draw(st.booleans()) else st.floats(1e-4, 1.0, allow_nan=False)
    rows = [
        sorted(draw(st.lists(values, min_size=num_ranks, max_size=num_ranks)), reverse=True)
        for _ in range(num_levels)
    ]
    logp = np.log(np.array(rows, dtype=np.float64))
    ids = 100 * np.arange(1, num_levels + 1)[:, None] + np.arange(num_ranks)[None, :]
    return logp, ids


def rank_path(tree: DraftTree, node: int) -> tuple[int, ...]:
    path = []
    while node > 0:
        path.append(int(tree.token_ids[node]) % 100)
        node = int(tree.parents[node])
    return tuple(reversed(path))


def brute_force_order(logp: np.ndarray) -> list[tuple[tuple[int, ...], float]]:
    """Every prefix with its left-folded logw, sorted by (-logw, rank path)."""
    num_levels, num_ranks = logp.shape
    prefixes = []
    for length in range(1, num_levels + 1):
        for path in itertools.product(range(num_ranks), repeat=length):
            logw = 0.0
            for depth, rank in enumerate(path):
                logw = logw + float(logp[depth, rank])
            prefixes.append((path, logw))
    return sorted(prefixes, key=lambda item: (-item[1], item[0]))


@settings(max_examples=150, deadline=None)
@given(draft=drafts(), budget=st.integers(0, 40))
def test_tree_is_the_budget_best_prefixes_in_order(draft: tuple[np.ndarray, np.ndarray], budget: int) -> None:
    logp, ids = draft
    tree = build_ddtree(logp, ids, budget, root_token=7)
    expected = brute_force_order(logp)[:budget]
    assert tree.num_nodes == len(expected) + 1
    # Pop order is the global (-logw, rank path) order, not just the same set.
    assert [rank_path(tree, i) for i in range(1, tree.num_nodes)] == [path for path, _ in expected]
    assert tree.logws[1:].tolist() == [logw for _, logw in expected]
    # Ancestor-closed, parents first, depths consistent, root conventions.
    assert tree.token_ids[0] == 7 and tree.parents[0] == -1 and tree.depths[0] == 0 and tree.logws[0] == 0.0
    for i in range(1, tree.num_nodes):
        parent = int(tree.parents[i])
        assert 0 <= parent < i
        assert tree.depths[i] == tree.depths[parent] + 1
        assert rank_path(tree, i)[:-1] == rank_path(tree, parent)


@settings(max_examples=100, deadline=None)
@given(draft=drafts(max_levels=5, max_ranks=4), budget=st.integers(1, 30))
def test_logw_is_the_sum_of_edge_logps(draft: tuple[np.ndarray, np.ndarray], budget: int) -> None:
    logp, ids = draft
    tree = build_ddtree(logp, ids, budget, root_token=0)
    for i in range(1, tree.num_nodes):
        depth, rank = int(tree.depths[i]), int(tree.token_ids[i]) % 100
        assert tree.logws[i] == tree.logws[tree.parents[i]] + logp[depth - 1, rank]
        path_sum = 0.0
        for d, r in enumerate(rank_path(tree, i)):
            path_sum += float(logp[d, r])
        assert tree.logws[i] == path_sum


def ancestors(tree: DraftTree, node: int) -> set[int]:
    found = {node}
    while node > 0:
        node = int(tree.parents[node])
        found.add(node)
    return found


@settings(max_examples=80, deadline=None)
@given(
    drafts_and_budgets=st.lists(
        st.tuples(drafts(max_levels=5, max_ranks=4), st.integers(0, 25)), min_size=1, max_size=4
    ),
    extra_padding=st.integers(0, 3),
)
def test_buffers_link_siblings_by_logw_and_mask_is_ancestry(
    drafts_and_budgets: list[tuple[tuple[np.ndarray, np.ndarray], int]], extra_padding: int
) -> None:
    trees = [
        build_ddtree(logp, ids, budget, root_token=b)
        for b, ((logp, ids), budget) in enumerate(drafts_and_budgets)
    ]
    padded_num_nodes = max(t.num_nodes for t in trees) + extra_padding
    batch = build_verify_batch(trees, n_max=padded_num_nodes)
    assert batch.attn_mask.shape == (len(trees), padded_num_nodes, padded_num_nodes)
    assert (
        batch.retrieve_index.tolist()
        == np.arange(len(trees) * padded_num_nodes).reshape(len(trees), -1).tolist()
    )
    assert batch.max_depth == max(t.max_depth for t in trees)
    next_token = batch.retrieve_next_token.numpy()
    next_sibling = batch.retrieve_next_sibling.numpy()
    mask = batch.attn_mask.numpy()
    for b, tree in enumerate(trees):
        n = tree.num_nodes
        assert batch.num_nodes[b] == n
        assert batch.tokens[b, :n].tolist() == tree.token_ids.tolist()
        for i in range(n):
            linked = []
            child = next_token[b, i]
            while child != -1:
                linked.append(int(child))
                child = next_sibling[b, child]
            assert linked == tree.children(i).tolist()
            assert sorted(linked) == np.flatnonzero(tree.parents == i).tolist()
            logws = tree.logws[linked]
            assert np.all(logws[:-1] >= logws[1:])
            assert set(np.flatnonzero(mask[b, i]).tolist()) == ancestors(tree, i)
        # Padding: isolated, no links in or out.
        for i in range(n, padded_num_nodes):
            assert np.flatnonzero(mask[b, i]).tolist() == [i]
            assert next_token[b, i] == -1 and next_sibling[b, i] == -1
        assert np.all(next_token[b] < n) and np.all(next_sibling[b] < n)
        assert not mask[b, :n, n:].any()


def test_children_follow_logw_for_hand_made_trees_out_of_index_order() -> None:
    # Root's children were appended in the wrong order (node 1 has the lower logw).
    tree = DraftTree(
        token_ids=np.array([0, 5, 6, 7]),
        depths=np.array([0, 1, 1, 2]),
        parents=np.array([-1, 0, 0, 2]),
        logws=np.array([0.0, -2.0, -1.0, -1.5]),
    )
    batch = build_verify_batch([tree])
    assert batch.retrieve_next_token[0].tolist() == [2, -1, 3, -1]
    assert batch.retrieve_next_sibling[0].tolist() == [-1, -1, 1, -1]


@settings(max_examples=50, deadline=None)
@given(draft=drafts(max_levels=6, max_ranks=1))
def test_k1_ddtree_is_the_chain(draft: tuple[np.ndarray, np.ndarray]) -> None:
    logp, ids = draft
    tree = build_ddtree(logp, ids, budget=64, root_token=3)
    chain = build_chain(ids[:, 0], root_token=3, logp_row0=logp[:, 0])
    for field in ("token_ids", "depths", "parents", "logws"):
        assert getattr(tree, field).tolist() == getattr(chain, field).tolist()
    assert torch.equal(build_verify_batch([tree]).attn_mask, build_verify_batch([chain]).attn_mask)
