"""The device step (trees built by `build_ddtree_batch`, the greedy walk on the device, device
indices for the KV compaction and the feature gather) emits exactly what the host step emits.

Production picks it on CUDA only; here it runs on the CPU by choosing the device builder and
the "device" greedy backend explicitly.
"""

import dataclasses
import warnings

import pytest
import torch

from ddtree_serve.engine.builder import build_draft_step, build_target_step
from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.engine.target_step import TargetStep
from ddtree_serve.engine.tree_builder import TreeBuilder
from ddtree_serve.models import TargetRunner
from tests.engine.conftest import REFERENCE_TOKENS, run_joining_midway, run_to_completion
from tests.engine.fakes import OracleDrafter, RecordingTarget

GREEDY = SamplingParams(max_tokens=REFERENCE_TOKENS, ignore_eos=True)
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def real_pair_engine(make_pair_config, pair_tokenizer, placement, **overrides) -> SpecEngine:
    """The test pair's real drafter and target; `placement` "device" takes the device step."""
    config = make_pair_config(**overrides)
    target = build_target_step(config)
    if placement == "device":
        target = TargetStep(target.runner, target.verify_backend, greedy_backend="device")
    drafter = build_draft_step(config) if config.mode != "ar" else None
    return SpecEngine(
        config.to_settings(), target, drafter, pair_tokenizer, tree_builder=TreeBuilder(placement)
    )


@pytest.mark.parametrize(("mode", "budget"), [("ar", 1), ("chain", 1), ("ddtree", 6)])
def test_device_step_with_the_real_drafter_matches_plain_greedy(
    make_pair_config, pair_tokenizer, prompt_ids, greedy_references, mode, budget
):
    engine = real_pair_engine(
        make_pair_config, pair_tokenizer, "device", mode=mode, budget=budget, max_num_seqs=2
    )
    for i, prompt in enumerate(prompt_ids):
        engine.add_request(str(i), prompt, GREEDY)
    outputs = run_to_completion(engine)
    for i, prompt in enumerate(prompt_ids):
        assert [*prompt, *outputs[str(i)]] == greedy_references[tuple(prompt)]


@pytest.mark.parametrize(("mode", "budget"), [("chain", 1), ("ddtree", 8)])
def test_device_step_with_an_oracle_drafter_matches_plain_greedy(
    pair_dirs, pair_tokenizer, make_pair_config, prompt_ids, greedy_references, mode, budget
):
    """The oracle's drafts are accepted deep and through siblings, every step, batched."""
    config = make_pair_config(mode=mode, budget=budget, max_num_seqs=3)
    runner = TargetRunner.from_pretrained(pair_dirs[0], num_slots=3, max_seq_len=config.max_seq_len)
    target = RecordingTarget(TargetStep(runner, verify_backend="torch", greedy_backend="device"))
    drafter = OracleDrafter(target, greedy_references, vocab_size=runner.vocab_size)
    engine = SpecEngine(
        config.to_settings(), target, drafter, pair_tokenizer, tree_builder=TreeBuilder("device")
    )
    outputs = run_joining_midway(engine, prompt_ids, GREEDY)
    for i, prompt in enumerate(prompt_ids):
        assert [*prompt, *outputs[str(i)]] == greedy_references[tuple(prompt)]
    tokens_per_step = len(prompt_ids) * REFERENCE_TOKENS / len(target.verify_batch_sizes)
    assert tokens_per_step > 1.5  # deep paths were accepted and committed


@pytest.mark.parametrize(("mode", "budget"), [("chain", 1), ("ddtree", 6)])
def test_seeded_sampling_is_token_for_token_the_same_with_either_builder(
    make_pair_config, pair_tokenizer, prompt_ids, mode, budget
):
    """Same seeds draw the same coins (the device tree sizes are known on the host), so the
    two builders' trees, walked by the same sampling backend, emit the same tokens."""
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=8, ignore_eos=True)
    outputs = {}
    for placement in ("host", "device"):
        engine = real_pair_engine(
            make_pair_config, pair_tokenizer, placement, mode=mode, budget=budget, max_num_seqs=3
        )
        for i, prompt in enumerate(prompt_ids):
            engine.add_request(str(i), prompt, dataclasses.replace(params, seed=100 + i))
        outputs[placement] = run_to_completion(engine)
    assert outputs["device"] == outputs["host"]
    assert len({tuple(tokens) for tokens in outputs["host"].values()}) == len(prompt_ids)


def steady_state_syncs(engine: SpecEngine, num_steps: int) -> list[int]:
    """Synchronizing CUDA calls (torch's sync debug mode) in each of `num_steps` engine steps."""
    syncs = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(num_steps):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
            syncs.append(sum("synchronizing" in str(w.message) for w in caught))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return syncs


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize(("mode", "budget"), [("ar", 1), ("chain", 1), ("ddtree", 8)])
def test_cuda_step_reads_the_device_once_and_matches_the_host_build(
    make_pair_config, pair_tokenizer, prompt_ids, mode, budget
):
    """On CUDA the device build (graphs, event timer on) syncs once per step and emits the
    host build's tokens (float32)."""
    outputs = {}
    for placement in ("host", "device"):
        config = make_pair_config(
            mode=mode, budget=budget, max_num_seqs=3, device="cuda", max_seq_len=256, record_timings=True
        )
        engine = build_local_engine(config)
        engine.tree_builder = TreeBuilder(placement)  # type: ignore[arg-type]
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        for i, prompt in enumerate(prompt_ids):
            engine.add_request(str(i), prompt, params)
        if placement == "device":
            for _ in range(3):  # prefill and the graphs' first captures
                engine.step()
            assert steady_state_syncs(engine, 3) == [1, 1, 1]
        outputs[placement] = run_to_completion(engine)
    assert outputs["device"] == outputs["host"]


@pytest.mark.gpu
@cuda_only
def test_a_cuda_verify_runs_the_engines_hook_while_its_kernels_are_queued(make_pair_config, prompt_ids):
    """The adaptive policy's lesson runs inside each CUDA verify (`while_verifying`), once."""
    config = make_pair_config(
        mode="ddtree", budget=8, max_num_seqs=3, device="cuda", max_seq_len=256, budget_policy="adaptive"
    )
    engine = build_local_engine(config)
    policy, target = engine.budget_policy, engine.target
    inside, verifies, hooked = [False], [0], [0]
    learn, verify = policy.learn, target.verify_and_commit

    def counted_learn() -> None:
        hooked[0] += inside[0]
        learn()

    def marked_verify(inputs):
        inside[0], verifies[0] = True, verifies[0] + 1
        try:
            return verify(inputs)
        finally:
            inside[0] = False

    policy.learn, target.verify_and_commit = counted_learn, marked_verify
    for i, prompt in enumerate(prompt_ids):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    run_to_completion(engine)
    assert verifies[0] > 5 and hooked[0] == verifies[0]
