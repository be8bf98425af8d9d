"""The lockstep batch builder against the heap builder: the same trees, node for node."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from ddtree_serve.tree import (
    DraftTree,
    TreeBatch,
    build_ddtree,
    build_ddtrees,
    build_verify_batch,
    draft_topk,
)
from tests.tree.drafts import draft_batches

TREE_FIELDS = ("token_ids", "depths", "parents", "logws")


def heap_trees(logp: np.ndarray, ids: np.ndarray, budgets: list[int], roots: list[int]) -> list[DraftTree]:
    return [
        build_ddtree(logp[b, :, : max(budget, 0)], ids[b, :, : max(budget, 0)], budget, root)
        for b, (budget, root) in enumerate(zip(budgets, roots, strict=True))
    ]


def assert_rows_are(batch: TreeBatch, trees: list[DraftTree]) -> None:
    assert batch.batch_size == len(trees)
    for row, tree in enumerate(trees):
        built = batch.tree(row)
        for field in TREE_FIELDS:  # logws too, to the bit: the same float sums
            np.testing.assert_array_equal(getattr(built, field), getattr(tree, field), err_msg=field)


@settings(max_examples=300, deadline=None)
@given(draft=draft_batches())
def test_lockstep_equals_the_heap_with_mixed_budgets(draft) -> None:
    logp, ids, budgets, _ = draft
    logp_np, ids_np = logp.numpy(), ids.numpy()
    roots = [3 + b for b in range(len(budgets))]
    assert_rows_are(
        build_ddtrees(logp_np, ids_np, budgets, roots), heap_trees(logp_np, ids_np, budgets, roots)
    )


@pytest.mark.parametrize("seed", range(3))
def test_a_drafter_sized_batch_equals_the_heap(seed: int) -> None:
    """Batch 48, 16 positions, top-32, budgets 1-40: the engine's high-batch case."""
    generator = torch.Generator().manual_seed(seed)
    logp, ids = draft_topk(torch.randn(48, 16, 300, generator=generator) * 4, 32)
    budgets = torch.randint(1, 41, (48,), generator=generator).tolist()
    roots = list(range(48))
    logp_np, ids_np = logp.numpy(), ids.numpy()
    assert_rows_are(
        build_ddtrees(logp_np, ids_np, budgets, roots), heap_trees(logp_np, ids_np, budgets, roots)
    )


def test_a_tie_at_the_frontier_goes_to_the_rank_path_like_the_heap() -> None:
    """Every prefix weighs the same: only the heap's tie rule orders them; a lockstep pop of the
    first slot holding the maximum would take (1) before (0, 0)."""
    ids = np.array([[[10, 11], [20, 21], [30, 31]]])
    built = build_ddtrees(np.zeros((1, 3, 2), dtype=np.float32), ids, [5], [1])
    #                                  (0)  (0,0) (0,0,0) (0,0,1) (0,1)
    assert built.tree(0).token_ids.tolist() == [1, 10, 20, 30, 31, 21]


def test_a_non_finite_log_prob_is_left_to_the_heap() -> None:
    logp, ids = draft_topk(torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(2)), 4)
    logp[0, 1, 3] = -torch.inf
    logp_np, ids_np = logp.numpy(), ids.numpy()
    assert_rows_are(
        build_ddtrees(logp_np, ids_np, [9, 9], [0, 0]), heap_trees(logp_np, ids_np, [9, 9], [0, 0])
    )


def test_no_positions_no_ranks_or_no_budget_give_the_root_alone() -> None:
    for shape, budgets in (((2, 0, 3), [4, 1]), ((2, 3, 0), [4, 1]), ((2, 3, 3), [0, -2])):
        built = build_ddtrees(
            np.zeros(shape, dtype=np.float32), np.zeros(shape, dtype=np.int64), budgets, [4, 6]
        )
        assert built.num_nodes.tolist() == [1, 1]
        assert [built.tree(b).token_ids.tolist() for b in range(2)] == [[4], [6]]


def test_tie_free_rows_stay_in_lockstep_and_its_planes_give_the_same_buffers(monkeypatch) -> None:
    """Float drafts have no frontier ties: no row goes to the heap builder, and the lockstep
    planes (unspecified past each tree) give `build_verify_batch`'s buffers of the heap's trees."""
    generator = torch.Generator().manual_seed(5)
    logp, ids = draft_topk(torch.randn(24, 15, 500, generator=generator) * 4, 32)
    budgets = torch.randint(0, 33, (24,), generator=generator).tolist()
    logp_np, ids_np = logp.numpy(), ids.numpy()
    expected = heap_trees(logp_np, ids_np, budgets, list(range(24)))

    def no_heap(*args, **kwargs):
        raise AssertionError("a tie-free row went to the heap builder")

    monkeypatch.setattr("ddtree_serve.tree.ddtree_batch.build_ddtree", no_heap)
    built = build_ddtrees(logp_np, ids_np, budgets, list(range(24)))
    assert_rows_are(built, expected)
    reference = build_verify_batch(expected)
    for field in ("tokens", "depths", "parents", "retrieve_next_token", "retrieve_next_sibling", "attn_mask"):
        assert torch.equal(getattr(built.verify_batch(), field), getattr(reference, field)), field
