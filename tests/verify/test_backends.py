"""Backend registry and agreement of every backend with the reference walk on the same coins."""

import pytest
import torch

from ddtree_serve.tree import DraftTree, build_chain, build_ddtree, build_verify_batch, draft_topk
from ddtree_serve.verify import backend_available, get_backend, target_probs, verify_sampling

CUDA = torch.cuda.is_available()
VOCAB = 12


def random_trees(generator: torch.Generator, batch_size: int) -> list[DraftTree]:
    """Mixed DDTrees (budgets 0..23) and chains over a small vocabulary."""
    trees = []
    for i in range(batch_size):
        draft = torch.randn(5, VOCAB, generator=generator) * 2
        if i % 5 == 0:
            trees.append(build_chain(draft.argmax(-1), root_token=i % VOCAB))
        else:
            budget = int(torch.randint(0, 24, (1,), generator=generator))
            trees.append(build_ddtree(*draft_topk(draft, 4), budget=budget, root_token=i % VOCAB))
    return trees


def random_case(trees: list[DraftTree], generator: torch.Generator, device: str = "cpu"):
    """(batch, target probs with zeros from top-k and greedy rows, coins with some zeros, coin_final)."""
    batch_size = len(trees)
    batch = build_verify_batch(trees, n_max=26)
    logits = torch.randn(batch_size, 26, VOCAB, generator=generator) * 2
    temperature = torch.rand(batch_size, generator=generator) * 1.5
    temperature[::4] = 0.0
    top_k = torch.randint(0, 6, (batch_size,), generator=generator)
    probs = target_probs(logits, temperature, top_k, torch.full((batch_size,), 0.95))
    coins = torch.rand(batch_size, 26, generator=generator)
    coins[::3] = 0.0
    coin_final = torch.rand(batch_size, generator=generator)
    return batch.to(device), probs.to(device), coins.to(device), coin_final.to(device)


def assert_same(left, right) -> None:
    assert torch.equal(left.accept_index.cpu(), right.accept_index.cpu())
    assert torch.equal(left.accept_len.cpu(), right.accept_len.cpu())
    assert torch.equal(left.bonus_token.cpu(), right.bonus_token.cpu())


THRESHOLDS = [(1.0, 1.0), (0.4, 0.7), (0.05, 1.0)]


def test_registry_resolves_once_and_rejects_unknown_names() -> None:
    assert get_backend("torch") is get_backend("torch")
    with pytest.raises(ValueError, match="unknown verify backend"):
        get_backend("no-such-backend")
    assert backend_available("torch")


def test_batched_equals_one_request_at_a_time() -> None:
    generator = torch.Generator().manual_seed(0)
    trees = random_trees(generator, 24)
    batch, probs, coins, coin_final = random_case(trees, generator)
    together = verify_sampling(batch, probs, coins, coin_final, 0.4, 0.7)
    for b, tree in enumerate(trees):
        n = tree.num_nodes
        single = build_verify_batch([tree])
        alone = verify_sampling(
            single, probs[b : b + 1, :n], coins[b : b + 1, :n], coin_final[b : b + 1], 0.4, 0.7
        )
        width = alone.accept_index.shape[1]
        assert together.accept_index[b, :width].tolist() == alone.accept_index[0].tolist()
        assert (together.accept_index[b, width:] == -1).all()
        assert together.bonus_token[b] == alone.bonus_token[0]


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("threshold_single", "threshold_acc"), THRESHOLDS)
def test_torch_cuda_walk_equals_cpu(threshold_single: float, threshold_acc: float) -> None:
    generator = torch.Generator().manual_seed(1)
    batch, probs, coins, _ = random_case(random_trees(generator, 64), generator)
    cpu = get_backend("torch")(batch, probs, coins, threshold_single, threshold_acc)
    gpu = get_backend("torch")(batch.to("cuda"), probs.cuda(), coins.cuda(), threshold_single, threshold_acc)
    assert torch.equal(cpu[0], gpu[0].cpu()) and torch.equal(cpu[1], gpu[1].cpu())


@pytest.mark.skipif(not (CUDA and backend_available("triton")), reason="needs CUDA and triton")
@pytest.mark.parametrize(("threshold_single", "threshold_acc"), THRESHOLDS)
def test_triton_equals_torch_reference(threshold_single: float, threshold_acc: float) -> None:
    generator = torch.Generator().manual_seed(2)
    for _ in range(5):
        case = random_case(random_trees(generator, 128), generator, device="cuda")
        reference = verify_sampling(*case, threshold_single, threshold_acc, backend="torch")
        kernel = verify_sampling(*case, threshold_single, threshold_acc, backend="triton")
        assert_same(reference, kernel)


@pytest.mark.skipif(not (CUDA and backend_available("sgl_kernel")), reason="needs CUDA and sgl_kernel")
@pytest.mark.parametrize(("threshold_single", "threshold_acc"), THRESHOLDS)
def test_sgl_kernel_equals_torch_reference(threshold_single: float, threshold_acc: float) -> None:
    generator = torch.Generator().manual_seed(3)
    case = random_case(random_trees(generator, 128), generator, device="cuda")
    reference = verify_sampling(*case, threshold_single, threshold_acc, backend="torch")
    kernel = verify_sampling(*case, threshold_single, threshold_acc, backend="sgl_kernel")
    assert_same(reference, kernel)
