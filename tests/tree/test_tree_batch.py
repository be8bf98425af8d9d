"""`TreeBatch`: its verify buffers are `build_verify_batch`'s, its prefixes the smaller trees."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_serve.tree import (
    TreeBatch,
    VerifyBatch,
    build_chain,
    build_ddtree,
    build_verify_batch,
    draft_topk,
)
from tests.tree.drafts import VERIFY_FIELDS, draft_batches


def assert_same_batch(built: VerifyBatch, reference: VerifyBatch) -> None:
    for field in VERIFY_FIELDS:
        assert torch.equal(getattr(built, field), getattr(reference, field)), field
    assert built.max_depth == reference.max_depth


def best_first_trees(logp: torch.Tensor, ids: torch.Tensor, budgets: list[int]) -> list:
    return [build_ddtree(logp[b], ids[b], budget, 5 + b) for b, budget in enumerate(budgets)]


@settings(max_examples=200, deadline=None)
@given(draft=draft_batches(), data=st.data())
def test_verify_buffers_and_prefixes_match_the_per_tree_build(draft, data) -> None:
    logp, ids, budgets, _ = draft
    trees = best_first_trees(logp, ids, budgets)
    batch = TreeBatch.from_trees(trees)
    assert_same_batch(batch.verify_batch(), build_verify_batch(trees))
    padded = max(t.num_nodes for t in trees) + data.draw(st.integers(0, 3))
    assert_same_batch(batch.verify_batch(n_max=padded), build_verify_batch(trees, n_max=padded))
    cuts = [data.draw(st.integers(0, budget + 2)) for budget in budgets]
    smaller = best_first_trees(logp, ids, [min(c, b) for c, b in zip(cuts, budgets, strict=True)])
    assert_same_batch(batch.prefix(cuts).verify_batch(), build_verify_batch(smaller))


@pytest.mark.parametrize("seed", range(5))
def test_a_prefix_of_a_best_first_tree_is_the_smaller_best_first_tree(seed: int) -> None:
    logp, ids = draft_topk(torch.randn(6, 40, generator=torch.Generator().manual_seed(seed)) * 3, 6)
    full = TreeBatch.from_trees([build_ddtree(logp, ids, 24, root_token=7)])
    for n in (0, 1, 5, 13, 24, 40):
        prefix, smaller = full.prefix([n]).tree(0), build_ddtree(logp, ids, min(n, 24), root_token=7)
        for field in ("token_ids", "depths", "parents", "logws"):
            np.testing.assert_array_equal(getattr(prefix, field), getattr(smaller, field))


def test_root_only_rows_follow_the_drafted_ones() -> None:
    logp, ids = draft_topk(torch.randn(2, 4, 9, generator=torch.Generator().manual_seed(3)), 3)
    trees = best_first_trees(logp, ids, [6, 2])
    batch = TreeBatch.from_trees(trees).with_root_only([40, 41])
    roots = [build_chain(np.empty(0, dtype=np.int64), root) for root in (40, 41)]
    assert batch.num_nodes.tolist() == [7, 3, 1, 1]
    assert_same_batch(batch.verify_batch(), build_verify_batch([*trees, *roots]))
    assert_same_batch(TreeBatch.root_only([40, 41]).verify_batch(), build_verify_batch(roots))


def test_a_tree_larger_than_n_max_is_refused() -> None:
    logp, ids = draft_topk(torch.randn(3, 9), 3)
    with pytest.raises(ValueError, match="n_max"):
        TreeBatch.from_trees([build_ddtree(logp, ids, 5, 0)]).verify_batch(n_max=3)


@settings(max_examples=200, deadline=None)
@given(draft=draft_batches(), data=st.data())
def test_a_depth_cut_is_the_best_first_tree_of_the_shorter_draft(draft, data) -> None:
    """Dropping the nodes deeper than a row's limit leaves that row's DDTree over the draft's
    first `limit` positions, at a budget of the nodes kept (root and padding rows included)."""
    logp, ids, budgets, _ = draft
    trees = best_first_trees(logp, ids, budgets)
    limits = [data.draw(st.integers(0, logp.shape[1] + 1)) for _ in budgets]
    cut = TreeBatch.from_trees(trees).with_root_only([40]).within_depth([*limits, 0])
    kept = cut.num_nodes.tolist()
    shorter = [
        build_ddtree(logp[b, :limit], ids[b, :limit], kept[b] - 1, 5 + b)
        if limit
        else build_chain(np.empty(0, dtype=np.int64), 5 + b)
        for b, limit in enumerate(limits)
    ]
    root = build_chain(np.empty(0, dtype=np.int64), 40)
    assert_same_batch(cut.verify_batch(), build_verify_batch([*shorter, root]))
    for b, tree in enumerate(shorter):  # the log-weights the policy reads come along too
        np.testing.assert_array_equal(cut.tree(b).logws, tree.logws)
    deeper = [int(tree.depths.max(initial=0)) > limit for tree, limit in zip(trees, limits, strict=True)]
    assert [n < tree.num_nodes for n, tree in zip(kept[:-1], trees, strict=True)] == deeper
