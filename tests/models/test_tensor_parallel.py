"""A TP=2 target (two gloo processes) computes what the TP=1 target computes, from half the weights.

Three tiny checkpoints cover the sharded paths: the conftest Qwen3 (GQA heads, tied head), a
DeepseekV3 (MLA without a query bottleneck, dense first layers, two shared experts, an odd
vocabulary of 97 so the vocabulary splits unevenly, tied head) and a Kimi K2.6 `kimi_k25`
directory (MLA with a query bottleneck, YaRN, INT4 routed experts split across the ranks, the
`language_model.` prefix); the MLA targets run over the latent cache (replicated on every rank,
each rank absorbing its own heads). Every rank runs `tp_checks.drive_runner`: prefill, two rounds of tree
verify + commit, a decode step; both ranks see the same logits and features, equal to TP=1's
within 1e-5 in float32.
"""

from pathlib import Path

import pytest
import torch
import torch.multiprocessing

from ddtree_serve.models.parallel import ShardPlan, TensorParallel, TensorSlice
from tests.models.kimi_dirs import KIMI_TEXT_CONFIG, save_hf_deepseek_v3, write_kimi_k25_dir
from tests.models.tp_checks import Case, build_runner, case_name, drive_runner, rank_main, shard_summary

TP_TOL = 1e-5
WORLD_SIZE = 2
# a DeepseekV3 unlike the Kimi one: no query bottleneck, plain RoPE, 2 dense layers, tied head
_DEEPSEEK_TIED = {
    **{k: v for k, v in KIMI_TEXT_CONFIG.items() if k != "rope_scaling"},
    "q_lora_rank": None,
    "n_shared_experts": 2,
    "first_k_dense_replace": 2,
    "rope_interleave": False,
    "tie_word_embeddings": True,
    "v_head_dim": 20,
}


@pytest.fixture(scope="module")
def cases(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Case]:
    """Every model over its default cache (MLA: the latent), and the Kimi one over the decompressed."""
    root = tmp_path_factory.mktemp("tp_models")
    deepseek = save_hf_deepseek_v3(root / "deepseek_tied", _DEEPSEEK_TIED, seed=3)
    hf_kimi = save_hf_deepseek_v3(root / "hf_kimi", KIMI_TEXT_CONFIG, seed=4)
    kimi = root / "kimi_k25_int4"
    write_kimi_k25_dir(hf_kimi, kimi, root / "kimi_dequantized")
    return [(tiny_target_dir, "latent"), (deepseek, "latent"), (kimi, "latent"), (kimi, "decompressed")]


@pytest.fixture(scope="module")
def rank_outputs(cases: list[Case], tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """What each of the two ranks saw, per case name."""
    out_dir = tmp_path_factory.mktemp("tp_ranks")
    init_method = f"file://{out_dir / 'rendezvous'}"
    torch.multiprocessing.start_processes(
        rank_main,
        args=(WORLD_SIZE, init_method, cases, out_dir),
        nprocs=WORLD_SIZE,
        start_method="spawn",
    )
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


def test_tp2_logits_and_features_equal_tp1_through_prefill_verify_and_commit(
    cases: list[Case], rank_outputs: list[dict]
) -> None:
    for case in cases:
        name_of_case = case_name(case)
        expected = drive_runner(build_runner(case))
        for rank, outputs in enumerate(rank_outputs):
            results = outputs[name_of_case]["results"]
            assert results.keys() == expected.keys()
            for name, value in expected.items():
                assert results[name].shape == value.shape, (name_of_case, rank, name)
                if name.startswith("commit"):
                    assert torch.equal(results[name], value), (name_of_case, rank, name)
                else:
                    error = (results[name] - value).abs().max().item()
                    assert error < TP_TOL, (name_of_case, rank, name, error)
        # the ranks agree exactly: they walk the same trees and commit the same entries
        first, second = (outputs[name_of_case]["results"] for outputs in rank_outputs)
        for name, value in first.items():
            assert torch.equal(second[name], value), (name_of_case, name)


def test_each_rank_holds_only_its_shard(cases: list[Case], rank_outputs: list[dict]) -> None:
    for case in cases:
        whole = shard_summary(build_runner(case))
        summaries = [outputs[case_name(case)]["summary"] for outputs in rank_outputs]
        assert sum(s["embed_rows"] for s in summaries) == whole["embed_rows"]
        for summary in summaries:
            if whole["cache_replicated"]:  # MLA's latent cache: every rank caches the whole latent
                assert summary["cached_heads"] == whole["cached_heads"] == 1, (case_name(case), summary)
            else:
                assert summary["cached_heads"] * WORLD_SIZE == whole["cached_heads"]
            # attention, MLPs, experts and vocabulary are split; only norms, routers and latents repeat
            assert summary["num_values"] < 0.65 * whole["num_values"], (case_name(case), summary, whole)
            if "local_experts" in whole:
                assert summary["local_experts"] * WORLD_SIZE == whole["local_experts"]


def test_shard_plan_renumbers_this_ranks_experts_and_skips_the_others() -> None:
    plan = ShardPlan(
        slices={"model.layers.0.self_attn.o_proj.weight": TensorSlice(1, 32, 64)},
        expert_blocks={"model.layers.1.mlp.experts": (4, 8)},
    )
    resolve = plan.with_prefix("language_model.")
    assert resolve("language_model.model.layers.1.mlp.experts.5.up_proj.weight_packed") == (
        "language_model.model.layers.1.mlp.experts.1.up_proj.weight_packed",
        None,
    )
    assert resolve("language_model.model.layers.1.mlp.experts.3.up_proj.weight") is None
    assert resolve("language_model.model.layers.0.self_attn.o_proj.weight") == (
        "language_model.model.layers.0.self_attn.o_proj.weight",
        TensorSlice(1, 32, 64),
    )
    assert resolve("language_model.model.norm.weight") == ("language_model.model.norm.weight", None)


def test_uneven_parts_cover_the_whole_and_heads_must_split_evenly() -> None:
    parts = [TensorParallel(rank, 3).part(97) for rank in range(3)]
    assert parts == [(0, 32), (32, 64), (64, 97)]
    with pytest.raises(ValueError, match="num_attention_heads = 6 does not split over 4"):
        TensorParallel(1, 4).even_part(6, "num_attention_heads")
