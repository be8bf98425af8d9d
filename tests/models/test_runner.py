"""TargetRunner: prefill/decode against transformers, exact tree verification, commit, slots."""

from pathlib import Path

import pytest
import torch

from ddtree_serve.models.layers import causal_mask
from ddtree_serve.models.qwen3 import context_features
from ddtree_serve.models.runner import TargetRunner
from tests.models.hf_qwen3 import save_hf_qwen3
from tests.models.trees import path_to, random_parents, tree_inputs

TOL = 1e-4
LAYER_IDS = (0, 2)


def full_forward(runner: TargetRunner, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Uncached reference: logits `[T, V]` and features `[T, F]` of one plain causal pass."""
    ids = torch.tensor([token_ids])
    positions = torch.arange(len(token_ids))[None]
    with torch.no_grad():
        out = runner.model(
            ids, positions, causal_mask(len(token_ids)), output_layer_ids=runner.target_layer_ids
        )
    features = context_features(out, runner.target_layer_ids)
    return runner.model.logits(out.hidden)[0], features[0]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("hf_qwen3")
    return path, save_hf_qwen3(path, tie=False)


def test_prefill_and_decode_match_transformers(hf_dir: tuple[Path, object]) -> None:
    path, hf_model = hf_dir
    runner = TargetRunner.from_pretrained(path, num_slots=2, max_seq_len=64, target_layer_ids=LAYER_IDS)
    assert runner.eos_token_ids == (5,)
    assert runner.feature_dim == 2 * 64
    ids = torch.randint(0, 97, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]  # [T, V]
    logits, features = runner.prefill(1, ids[:10])
    assert features.shape == (10, 128)
    assert (logits - expected[9]).abs().max() < TOL
    for t in range(10, 16):  # decode: one token at a time on top of the cache
        logits, _ = runner.prefill(1, ids[t : t + 1])
        assert (logits - expected[t]).abs().max() < TOL
    assert runner.seq_len(1) == 16 and runner.seq_len(0) == 0


def test_verify_matches_path_decoding_then_commit_continues(tiny_target_dir: Path) -> None:
    """Random trees in non-contiguous slots with different prefixes, padded to a common N."""
    runner = TargetRunner.from_pretrained(
        tiny_target_dir, num_slots=4, max_seq_len=96, target_layer_ids=LAYER_IDS
    )
    gen = torch.Generator().manual_seed(7)
    vocab = runner.vocab_size
    slots = [3, 1]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (13, 5)]
    trees = []
    for num_nodes in (12, 7):
        trees.append(
            (torch.randint(0, vocab, (num_nodes,), generator=gen).tolist(), random_parents(num_nodes, gen))
        )
    for slot, prompt in zip(slots, prompts, strict=True):
        runner.prefill(slot, prompt)
    batch = tree_inputs(trees, num_slots=14)
    starts = [runner.seq_len(s) for s in slots]
    logits, features = runner.verify(slots, batch, starts)
    assert logits.shape == (2, 14, vocab) and features.shape == (2, 14, runner.feature_dim)

    for b, (token_ids, parents) in enumerate(trees):
        for node in range(len(token_ids)):
            path = [token_ids[i] for i in path_to(parents, node)]
            ref_logits, ref_features = full_forward(runner, prompts[b] + path)
            assert (logits[b, node] - ref_logits[-1]).abs().max() < TOL, (b, node)
            assert (features[b, node] - ref_features[-1]).abs().max() < TOL, (b, node)

    # accept the path to each tree's last node (arbitrary, non-contiguous node indices)
    accepted = [path_to(parents, len(token_ids) - 1) for token_ids, parents in trees]
    depth = max(len(p) for p in accepted)
    accept_index = torch.full((2, depth), -1, dtype=torch.int64)
    for b, path in enumerate(accepted):
        accept_index[b, : len(path)] = torch.tensor(path)
    runner.commit(slots, accept_index)
    for b, slot in enumerate(slots):
        assert runner.seq_len(slot) == starts[b] + len(accepted[b])
        committed = prompts[b] + [trees[b][0][i] for i in accepted[b]]
        next_token = (7 * b + 11) % vocab
        logits_after, _ = runner.prefill(slot, [next_token])
        ref_logits, _ = full_forward(runner, [*committed, next_token])
        assert (logits_after - ref_logits[-1]).abs().max() < TOL


def test_uncommitted_verify_leaves_slot_unchanged_and_release_resets(tiny_target_dir: Path) -> None:
    runner = TargetRunner.from_pretrained(tiny_target_dir, num_slots=2, max_seq_len=48)
    assert runner.feature_dim == 0
    prompt = list(range(20, 30))
    runner.prefill(0, prompt)
    batch = tree_inputs([([4, 5, 6, 7], [-1, 0, 0, 1])], num_slots=4)
    runner.verify([0], batch, [10])
    root_only = tree_inputs([([9], [-1])], num_slots=1)
    logits, _ = runner.verify([0], root_only, [10])
    assert (logits[0, 0] - full_forward(runner, [*prompt, 9])[0][-1]).abs().max() < TOL
    with pytest.raises(ValueError, match="starts"):
        runner.verify([0], root_only, [11])
    runner.release(0)
    assert runner.seq_len(0) == 0
    logits, _ = runner.prefill(0, [3, 4])
    assert (logits - full_forward(runner, [3, 4])[0][-1]).abs().max() < TOL


def test_overflowing_the_slot_is_refused(tiny_target_dir: Path) -> None:
    runner = TargetRunner.from_pretrained(tiny_target_dir, num_slots=1, max_seq_len=8)
    runner.prefill(0, list(range(6)))
    with pytest.raises(ValueError, match="max_seq_len"):
        runner.verify([0], tree_inputs([([1, 2, 3], [-1, 0, 1])], num_slots=3), [6])


def test_batched_prefill_equals_one_slot_at_a_time(tiny_target_dir: Path) -> None:
    runner = TargetRunner.from_pretrained(
        tiny_target_dir, num_slots=3, max_seq_len=32, target_layer_ids=LAYER_IDS
    )
    runner.prefill(2, [9, 8, 7])  # slot 2 already holds text: the batch extends it
    prompts = [[1, 2, 3, 4, 5, 6], [40, 41], [10, 11, 12]]
    logits, features = runner.prefill_batch([0, 1, 2], prompts)
    assert [runner.seq_len(s) for s in (0, 1, 2)] == [6, 2, 6]
    for b, text in enumerate([prompts[0], prompts[1], [9, 8, 7, *prompts[2]]]):
        ref_logits, ref_features = full_forward(runner, text)
        assert (logits[b] - ref_logits[-1]).abs().max() < TOL
        assert features[b].shape == (len(prompts[b]), runner.feature_dim)
        assert (features[b] - ref_features[-len(prompts[b]) :]).abs().max() < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_verify_and_commit_match_cpu(tiny_target_dir: Path) -> None:
    """The CUDA path (repeated K/V heads, memory-efficient SDPA) agrees with the CPU reference."""
    runners = [
        TargetRunner.from_pretrained(
            tiny_target_dir, num_slots=2, max_seq_len=64, device=d, target_layer_ids=LAYER_IDS
        )
        for d in ("cpu", "cuda")
    ]
    gen = torch.Generator().manual_seed(11)
    trees = [(torch.randint(0, 300, (9,), generator=gen).tolist(), random_parents(9, gen)) for _ in range(2)]
    batch = tree_inputs(trees, num_slots=9)
    outputs = []
    for runner in runners:
        runner.prefill_batch([0, 1], [list(range(3, 20)), list(range(40, 47))])
        logits, features = runner.verify([0, 1], batch, [17, 7])
        runner.commit([0, 1], torch.tensor([[0, 1, -1], [0, -1, -1]]))
        after, _ = runner.prefill_batch([0, 1], [[5], [6]])
        outputs.append((logits.cpu(), features.cpu(), after.cpu()))
    for cpu_tensor, cuda_tensor in zip(*outputs, strict=True):
        assert (cpu_tensor - cuda_tensor).abs().max() < 1e-3
