"""The build stage: host and device placements give the same trees; device graphs equal eager."""

import numpy as np
import pytest
import torch

from ddtree_serve.engine.tree_builder import BuiltTrees, DeviceTreeGraphs, TreeBuilder
from ddtree_serve.tree import build_ddtree_batch, draft_topk

FIELDS = ("tokens", "depths", "parents", "retrieve_next_token", "retrieve_next_sibling")
CUDA = torch.cuda.is_available()


def random_draft(
    rng: np.random.Generator, batch_size: int, num_positions: int, num_ranks: int, vocab: int = 40
):
    # Integer-valued logits: many exact ties for the tie rule to settle.
    logits = torch.from_numpy(rng.integers(0, 4, size=(batch_size, num_positions, vocab))).float()
    return draft_topk(logits, num_ranks)


def assert_same_real_nodes(device: BuiltTrees, host: BuiltTrees) -> None:
    """Every request's real nodes agree field by field (the two pad to different widths)."""
    assert device.num_nodes == host.num_nodes
    assert device.batch.num_nodes.tolist() == host.num_nodes
    for b, n in enumerate(host.num_nodes):
        for field in FIELDS:
            assert torch.equal(getattr(device.batch, field)[b, :n], getattr(host.batch, field)[b, :n]), field
        assert torch.equal(device.batch.attn_mask[b, :n, :n], host.batch.attn_mask[b, :n, :n])


@pytest.mark.parametrize("chain", [False, True])
def test_device_placement_builds_the_host_trees_with_mixed_budgets(chain: bool) -> None:
    rng = np.random.default_rng(0)
    for _ in range(10):
        batch_size = int(rng.integers(1, 5))
        logp, ids = random_draft(rng, batch_size, num_positions=6, num_ranks=1 if chain else 5)
        budgets = rng.integers(1, 12, size=batch_size).tolist()
        roots = rng.integers(0, 40, size=batch_size).tolist()
        built = {
            placement: TreeBuilder(placement).build(logp, ids, budgets, roots, chain=chain)
            for placement in ("host", "device")
        }
        assert_same_real_nodes(built["device"], built["host"])
        if chain:
            assert built["host"].num_nodes == [7] * batch_size


def test_no_draft_gives_root_only_trees() -> None:
    built = TreeBuilder("device").build(None, None, [4, 4], [7, 9], chain=False)
    assert built.num_nodes == [1, 1]
    assert built.batch.tokens.tolist() == [[7], [9]]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_build_graph_replay_equals_eager_build_for_every_batch_size() -> None:
    """Batches padded to their bucket (3 -> 4, 5 -> 8); each replay overwrites the last one's inputs."""
    rng = np.random.default_rng(1)
    graphs = DeviceTreeGraphs(torch.device("cuda"))
    budget_max = 16
    for batch_size in (3, 1, 5, 3, 8):
        logp, ids = (t.cuda() for t in random_draft(rng, batch_size, num_positions=7, num_ranks=budget_max))
        budgets = rng.integers(0, budget_max + 1, size=batch_size).tolist()
        roots = rng.integers(0, 40, size=batch_size).tolist()
        replayed = graphs.build(logp, ids, budgets, roots, budget_max)
        eager = build_ddtree_batch(
            logp, ids, torch.tensor(budgets).cuda(), torch.tensor(roots).cuda(), budget_max
        ).verify
        assert replayed is not None
        for field in (*FIELDS, "retrieve_index", "attn_mask", "num_nodes"):
            assert torch.equal(getattr(replayed, field), getattr(eager, field)), field
        assert replayed.max_depth == eager.max_depth
    assert graphs.forward.num_graphs == 3  # buckets 4, 1, 8
