"""TargetRunner: prefill/decode against transformers, exact tree verification, commit, slots."""

from pathlib import Path

import pytest
import torch

from ddtree_serve.models.runner import TargetRunner
from tests.models.hf_qwen3 import save_hf_qwen3
from tests.models.runner_checks import (
    TOL,
    check_prefill_and_decode_match_hf,
    check_verify_matches_path_decoding_then_commit,
    full_forward,
)
from tests.models.trees import random_parents, tree_inputs

LAYER_IDS = (0, 2)


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
    check_prefill_and_decode_match_hf(runner, hf_model, ids, num_prompt=10, slot=1)
    assert runner.seq_len(0) == 0


def test_verify_matches_path_decoding_then_commit_continues(tiny_target_dir: Path) -> None:
    runner = TargetRunner.from_pretrained(
        tiny_target_dir, num_slots=4, max_seq_len=96, target_layer_ids=LAYER_IDS
    )
    check_verify_matches_path_decoding_then_commit(runner, seed=7)


def test_uncommitted_verify_leaves_slot_unchanged_and_release_resets(tiny_target_dir: Path) -> None:
    runner = TargetRunner.from_pretrained(tiny_target_dir, num_slots=2, max_seq_len=48)
    assert runner.feature_dim == 0
    prompt = list(range(20, 30))
    runner.prefill(0, prompt)
    batch = tree_inputs([([4, 5, 6, 7], [-1, 0, 0, 1])], padded_num_nodes=4)
    runner.verify([0], batch)
    root_only = tree_inputs([([9], [-1])], padded_num_nodes=1)
    logits, _ = runner.verify([0], root_only)
    assert (logits[0, 0] - full_forward(runner, [*prompt, 9])[0][-1]).abs().max() < TOL
    assert runner.seq_len(0) == len(prompt)
    runner.release(0)
    assert runner.seq_len(0) == 0
    logits, _ = runner.prefill(0, [3, 4])
    assert (logits - full_forward(runner, [3, 4])[0][-1]).abs().max() < TOL


def test_overflowing_the_slot_is_refused(tiny_target_dir: Path) -> None:
    runner = TargetRunner.from_pretrained(tiny_target_dir, num_slots=1, max_seq_len=8)
    runner.prefill(0, list(range(6)))
    with pytest.raises(ValueError, match="max_seq_len"):
        runner.verify([0], tree_inputs([([1, 2, 3], [-1, 0, 1])], padded_num_nodes=3))


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
    batch = tree_inputs(trees, padded_num_nodes=9)
    outputs = []
    for runner in runners:
        runner.prefill_batch([0, 1], [list(range(3, 20)), list(range(40, 47))])
        logits, features = runner.verify([0, 1], batch)
        runner.commit([0, 1], torch.tensor([[0, 1, -1], [0, -1, -1]]))
        after, _ = runner.prefill_batch([0, 1], [[5], [6]])
        outputs.append((logits.cpu(), features.cpu(), after.cpu()))
    for cpu_tensor, cuda_tensor in zip(*outputs, strict=True):
        assert (cpu_tensor - cuda_tensor).abs().max() < 1e-3
