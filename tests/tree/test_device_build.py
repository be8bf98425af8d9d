"""The batched device builder against the host builder: same trees, same numbering, same buffers.

The device builder numbers nodes in the host's pop order, so trees compare index by index
(which implies equal node sets as token paths, parents, sibling order and masks).
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree_serve.tree import (
    DeviceTreeBatch,
    VerifyBatch,
    build_chain,
    build_ddtree,
    build_ddtree_batch,
    build_verify_batch,
    draft_topk,
)
from ddtree_serve.verify import verify_greedy
from tests.tree.drafts import VERIFY_FIELDS, draft_batches


def host_build(
    logp: torch.Tensor, ids: torch.Tensor, budgets: list[int], root_tokens: list[int], budget_max: int
) -> tuple[VerifyBatch, np.ndarray]:
    """The reference: `build_ddtree` per request, then `build_verify_batch` at N = budget_max + 1."""
    trees = [
        build_ddtree(logp[b], ids[b], budget, root_token)
        for b, (budget, root_token) in enumerate(zip(budgets, root_tokens, strict=True))
    ]
    logws = np.zeros((len(trees), budget_max + 1))
    for b, tree in enumerate(trees):
        logws[b, : tree.num_nodes] = tree.logws
    return build_verify_batch(trees, n_max=budget_max + 1), logws


def assert_same_trees(device: DeviceTreeBatch, host: VerifyBatch, host_logws: np.ndarray) -> None:
    for field in VERIFY_FIELDS:
        assert torch.equal(getattr(device.verify, field).cpu(), getattr(host, field)), field
    # Same float64 left-fold sums as the host, so equal to the bit, not just to a tolerance.
    assert device.logws.cpu().tolist() == host_logws.tolist()
    assert device.verify.max_depth >= host.max_depth


@settings(max_examples=300, deadline=None)
@given(draft=draft_batches())
def test_device_build_equals_host_build_with_mixed_budgets(
    draft: tuple[torch.Tensor, torch.Tensor, list[int], int],
) -> None:
    logp, ids, budgets, budget_max = draft
    root_tokens = [7 + b for b in range(len(budgets))]
    device = build_ddtree_batch(logp, ids, torch.tensor(budgets), torch.tensor(root_tokens), budget_max)
    host, host_logws = host_build(logp, ids, budgets, root_tokens, budget_max)
    assert_same_trees(device, host, host_logws)


@settings(max_examples=60, deadline=None)
@given(draft=draft_batches(), seed=st.integers(0, 2**16))
def test_verification_consumes_the_device_batch(
    draft: tuple[torch.Tensor, torch.Tensor, list[int], int], seed: int
) -> None:
    logp, ids, budgets, budget_max = draft
    root_tokens = [0] * len(budgets)
    device = build_ddtree_batch(logp, ids, torch.tensor(budgets), torch.tensor(root_tokens), budget_max)
    host, _ = host_build(logp, ids, budgets, root_tokens, budget_max)
    # Each node's target argmax is the token of a random node of its tree, so walks go deep.
    generator = torch.Generator().manual_seed(seed)
    num_slots = budget_max + 1
    target_logits = torch.randn(len(budgets), num_slots, int(ids.max()) + 2, generator=generator)
    favoured = host.tokens.gather(
        1, torch.randint(0, num_slots, (len(budgets), num_slots), generator=generator)
    )
    target_logits.scatter_add_(2, favoured[:, :, None], torch.full((len(budgets), num_slots, 1), 10.0))
    device_result = verify_greedy(device.verify, target_logits)
    host_result = verify_greedy(host, target_logits)
    assert device_result.emitted_tokens(device.verify) == host_result.emitted_tokens(host)
    assert torch.equal(device_result.accept_len, host_result.accept_len)


def test_hand_worked_ties_across_depths() -> None:
    # test_ddtree_examples' tree: [10,20] ties [11] at 1/4, [10,21] ties [11,20] at 1/8.
    logp = torch.tensor([[0.5, 0.25], [0.5, 0.25], [0.75, 0.125]], dtype=torch.float64).log()
    ids = torch.tensor([[10, 11], [20, 21], [30, 31]])
    built = build_ddtree_batch(
        logp.expand(3, -1, -1), ids.expand(3, -1, -1), torch.tensor([6, 7, 2]), torch.tensor([5, 5, 5]), 7
    )
    batch = built.verify
    assert batch.tokens.tolist() == [
        [5, 10, 20, 11, 30, 21, 20, 0],
        [5, 10, 20, 11, 30, 21, 20, 30],  # [10,21,30] ties [11,20,30] at 3/32: (0,1,0) first
        [5, 10, 20, 0, 0, 0, 0, 0],
    ]
    assert batch.parents.tolist() == [
        [-1, 0, 1, 0, 2, 1, 3, -1],
        [-1, 0, 1, 0, 2, 1, 3, 5],
        [-1, 0, 1, -1, -1, -1, -1, -1],
    ]
    assert batch.retrieve_next_token.tolist()[0] == [1, 2, 4, 6, -1, -1, -1, -1]
    assert batch.retrieve_next_sibling.tolist()[0] == [-1, 3, 5, -1, -1, -1, -1, -1]
    assert batch.num_nodes.tolist() == [7, 8, 3]
    np.testing.assert_allclose(built.logws[0, :7].exp(), [1, 1 / 2, 1 / 4, 1 / 4, 3 / 16, 1 / 8, 1 / 8])


def test_all_equal_logps_pop_in_rank_path_order() -> None:
    # Every prefix has logw 0: the tie rule alone orders them, a prefix before its extensions.
    ids = torch.tensor([[10, 11], [20, 21], [30, 31]]).expand(3, -1, -1)
    built = build_ddtree_batch(torch.zeros(3, 3, 2), ids, torch.tensor([5, 2, 0]), torch.tensor([1, 2, 3]), 5)
    batch = built.verify
    #    paths:       (0)  (0,0) (0,0,0) (0,0,1) (0,1)
    assert batch.tokens.tolist() == [[1, 10, 20, 30, 31, 21], [2, 10, 20, 0, 0, 0], [3, 0, 0, 0, 0, 0]]
    assert batch.parents.tolist()[0] == [-1, 0, 1, 2, 2, 1]
    assert batch.retrieve_next_token.tolist()[0] == [1, 2, 3, -1, -1, -1]
    assert batch.retrieve_next_sibling.tolist()[0] == [-1, -1, 5, 4, -1, -1]
    assert batch.attn_mask[0].long().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0],
        [1, 1, 0, 0, 0, 1],
    ]
    assert batch.attn_mask[2].long().tolist() == torch.eye(6, dtype=torch.long).tolist()
    assert batch.num_nodes.tolist() == [6, 3, 1]


def test_budget_above_budget_max_counts_as_budget_max() -> None:
    logp, ids = draft_topk(torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(1)), 6)
    built = build_ddtree_batch(logp, ids, torch.tensor([50, -3]), torch.tensor([0, 0]), 9)
    host, host_logws = host_build(logp, ids, [9, 0], [0, 0], 9)
    assert_same_trees(built, host, host_logws)


def test_no_positions_or_no_budget_give_the_root_alone() -> None:
    for num_positions, budget_max in ((0, 4), (3, 0)):
        logp, ids = draft_topk(torch.randn(2, num_positions, 5), 3)
        built = build_ddtree_batch(logp, ids, torch.tensor([budget_max, 1]), torch.tensor([4, 6]), budget_max)
        host, host_logws = host_build(logp, ids, [budget_max, min(1, budget_max)], [4, 6], budget_max)
        assert_same_trees(built, host, host_logws)


@settings(max_examples=50, deadline=None)
@given(draft=draft_batches())
def test_k1_is_the_chain(draft: tuple[torch.Tensor, torch.Tensor, list[int], int]) -> None:
    logp, ids, _, _ = draft
    logp, ids = logp[..., :1], ids[..., :1]
    batch_size, num_positions, _ = logp.shape
    built = build_ddtree_batch(
        logp, ids, torch.full((batch_size,), num_positions), torch.arange(batch_size), num_positions
    )
    chains = [build_chain(ids[b, :, 0], root_token=b, logp_row0=logp[b, :, 0]) for b in range(batch_size)]
    chain_batch = build_verify_batch(chains)
    for field in VERIFY_FIELDS:
        assert torch.equal(getattr(built.verify, field), getattr(chain_batch, field)), field
    assert built.logws.tolist() == [chain.logws.tolist() for chain in chains]
    assert built.verify.max_depth == num_positions


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("batch_size", "num_positions", "num_ranks", "budget_max"), [(3, 7, 4, 12), (4, 15, 128, 128)]
)
def test_cuda_graph_replay_equals_eager(
    batch_size: int, num_positions: int, num_ranks: int, budget_max: int
) -> None:
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)

    def random_inputs() -> tuple[torch.Tensor, ...]:
        # Integer-valued logits: many exact ties for the tie rule to settle.
        logits = torch.randint(
            0, 4, (batch_size, num_positions, 2 * num_ranks), generator=generator, device=device
        )
        logp, ids = draft_topk(logits.float(), num_ranks)
        budgets = torch.randint(0, budget_max + 1, (batch_size,), generator=generator, device=device)
        roots = torch.randint(0, 100, (batch_size,), generator=generator, device=device)
        return logp, ids, budgets, roots

    static_inputs = random_inputs()
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
        for _ in range(2):
            build_ddtree_batch(*static_inputs, budget_max)
    torch.cuda.current_stream().wait_stream(side_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_output = build_ddtree_batch(*static_inputs, budget_max)

    for _ in range(3):
        inputs = random_inputs()
        for static, fresh in zip(static_inputs, inputs, strict=True):
            static.copy_(fresh)
        graph.replay()
        eager = build_ddtree_batch(*inputs, budget_max)
        for field in VERIFY_FIELDS:
            assert torch.equal(getattr(static_output.verify, field), getattr(eager.verify, field)), field
        assert torch.equal(static_output.logws, eager.logws)
        logp, ids, budgets, roots = (t.cpu() for t in inputs)
        host, host_logws = host_build(logp, ids, budgets.tolist(), roots.tolist(), budget_max)
        assert_same_trees(eager, host, host_logws)
