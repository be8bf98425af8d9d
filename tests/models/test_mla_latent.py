"""The latent MLA cache (absorbed-weight attention) against the decompressed cache it replaces.

Two tiny targets: a plain `deepseek_v3` directory (no query bottleneck, plain half-split RoPE, a
value head wider than the nope key part) and a Kimi K2.6 `kimi_k25` directory (query bottleneck,
interleaved YaRN RoPE, INT4 routed experts). One model serves two runners, one per cache, so only
the cache and its attention arithmetic differ: the same engine-like scenario (prefill, two rounds
of tree verify + commit of non-contiguous accepted nodes, a decode step) gives the same logits and
features within float32 rounding. Greedy speculation over the latent cache emits what plain greedy
decoding over the decompressed cache emits, on the tiny K2.6-format pair.
"""

from pathlib import Path
from typing import get_args

import pytest
import torch

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.models.deepseek_v3 import DeepseekV3Config
from ddtree_serve.models.families import MLA_CACHES, MLACache, TargetModel
from ddtree_serve.models.loading import load_target_model
from ddtree_serve.models.parallel import TensorParallel, local_kv_layout
from ddtree_serve.models.random_weights import write_random_drafter_dir
from ddtree_serve.models.runner import TargetRunner
from ddtree_serve.models.tokenizer import load_tokenizer
from tests.engine.conftest import run_to_completion
from tests.models.kimi_dirs import (
    KIMI_NUM_BASE_TOKENS,
    KIMI_SPECIAL_TOKENS,
    KIMI_TEXT_CONFIG,
    KIMI_VOCAB_SIZE,
    save_hf_deepseek_v3,
    write_kimi_k25_dir,
    write_kimi_tokenizer,
)
from tests.models.test_kimi_drafter import NUM_TARGET_LAYERS, k26_drafter_config
from tests.models.tp_checks import LAYER_IDS, SLOTS, drive_runner
from tests.models.trees import path_to, random_parents, tree_inputs

LATENT_TOL = 1e-5
_DEEPSEEK_V3 = {
    **{k: v for k, v in KIMI_TEXT_CONFIG.items() if k != "rope_scaling"},
    "q_lora_rank": None,
    "n_group": 2,
    "topk_group": 1,
    "rope_interleave": False,
    "v_head_dim": 20,
}
# Kimi K2.6's text config (what the cache sizes depend on), from its config.json
_K26_TEXT_CONFIG = {
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
}


@pytest.fixture(scope="module", params=["deepseek_v3", "kimi_k25_int4"])
def mla_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TargetModel:
    root = tmp_path_factory.mktemp(f"mla_{request.param}")
    if request.param == "deepseek_v3":
        return load_target_model(save_hf_deepseek_v3(root / "deepseek_v3", _DEEPSEEK_V3, seed=5))
    hf_dir = save_hf_deepseek_v3(root / "hf", KIMI_TEXT_CONFIG, seed=6)
    write_kimi_k25_dir(hf_dir, root / "kimi", root / "dequantized")
    return load_target_model(root / "kimi")


def runner_over(model: TargetModel, mla_cache: MLACache) -> TargetRunner:
    return TargetRunner(model, num_slots=4, max_seq_len=64, target_layer_ids=LAYER_IDS, mla_cache=mla_cache)


def test_k26_cache_entry_shrinks_from_40_kib_to_1152_bytes_per_token_and_layer() -> None:
    config = DeepseekV3Config.from_dict(_K26_TEXT_CONFIG)
    decompressed, latent = config.kv_layout, config.latent_kv_layout
    assert decompressed.bytes_per_token(torch.bfloat16) == 64 * (192 + 128) * 2 == 40 * 1024
    assert (latent.num_heads, latent.key_dim, latent.value_dim) == (1, 576, 0)
    assert latent.bytes_per_token(torch.bfloat16) == 576 * 2 == 1152
    # over an 8-rank group each rank caches 8 heads decompressed, or the whole latent
    rank = TensorParallel(3, 8)
    assert local_kv_layout(decompressed, rank).bytes_per_token(torch.bfloat16) == 5 * 1024
    assert local_kv_layout(latent, rank) == latent


def test_engine_config_offers_the_runner_caches_latent_first() -> None:
    field = EngineConfig.model_fields["mla_cache"]
    assert get_args(field.annotation) == MLA_CACHES and field.default == "latent"


def test_latent_cache_gives_the_decompressed_cache_logits_through_verify_and_commit(
    mla_model: TargetModel,
) -> None:
    config = mla_model.config
    latent_runner = runner_over(mla_model, "latent")
    decompressed_runner = runner_over(mla_model, "decompressed")
    entry = config.kv_lora_rank + config.qk_rope_head_dim
    assert latent_runner.cache.keys.shape[-2:] == (1, entry) and latent_runner.cache.values is None
    assert decompressed_runner.cache.values.shape[-2:] == (config.num_attention_heads, config.v_head_dim)
    latent, decompressed = drive_runner(latent_runner), drive_runner(decompressed_runner)
    assert latent.keys() == decompressed.keys()
    for name, expected in decompressed.items():
        if name.startswith("commit"):
            assert torch.equal(latent[name], expected), name
        else:
            error = (latent[name] - expected).abs().max().item()
            assert error < LATENT_TOL, (name, error)


def test_commit_keeps_the_latent_entries_of_the_accepted_nodes(mla_model: TargetModel) -> None:
    """After a verify + commit of a non-contiguous path, the slot holds what prefilling it would."""
    gen = torch.Generator().manual_seed(11)
    vocab = mla_model.config.vocab_size
    prompt = torch.randint(0, vocab, (9,), generator=gen).tolist()
    tokens = torch.randint(0, vocab, (10,), generator=gen).tolist()
    parents = random_parents(10, gen)
    accepted = path_to(parents, 9)
    verified, prefilled = runner_over(mla_model, "latent"), runner_over(mla_model, "latent")
    slot = SLOTS[0]
    verified.prefill(slot, prompt)
    verified.verify([slot], tree_inputs([(tokens, parents)], padded_num_nodes=12))
    assert verified.commit([slot], torch.tensor([accepted])) == [len(prompt) + len(accepted)]
    prefilled.prefill(slot, prompt + [tokens[i] for i in accepted])
    length = prefilled.seq_len(slot)
    error = (verified.cache.keys[:, slot, :length] - prefilled.cache.keys[:, slot, :length]).abs().max()
    assert error < LATENT_TOL


@pytest.fixture(scope="module")
def k26_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("k26_latent_pair")
    text = {**KIMI_TEXT_CONFIG, "vocab_size": KIMI_VOCAB_SIZE, "num_hidden_layers": NUM_TARGET_LAYERS}
    text["eos_token_id"] = KIMI_NUM_BASE_TOKENS + KIMI_SPECIAL_TOKENS.index("[EOS]")
    write_kimi_k25_dir(save_hf_deepseek_v3(root / "hf", text, seed=7), root / "target", root / "dequantized")
    write_kimi_tokenizer(root / "target")
    return root / "target", write_random_drafter_dir(root / "drafter", k26_drafter_config(), seed=8)


def test_greedy_speculation_over_the_latent_cache_equals_decompressed_greedy_decoding(
    k26_pair: tuple[Path, Path],
) -> None:
    target, drafter = k26_pair
    tokenizer = load_tokenizer(target)
    prompts = [tokenizer.encode(text).ids for text in ("<|im_user|>user<|im_middle|>hello", "world hello")]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outputs = {}
    for mode, mla_cache in (("ar", "decompressed"), ("ddtree", "latent")):
        config = EngineConfig(
            target=str(target),
            drafter=str(drafter),
            mode=mode,
            budget=6,
            max_num_seqs=2,
            max_seq_len=64,
            mla_cache=mla_cache,
        )
        engine = build_local_engine(config)
        assert engine.target.runner.cache.keys_only == (mla_cache == "latent")
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        outputs[mode] = run_to_completion(engine)
    assert outputs["ddtree"] == outputs["ar"]
    assert all(len(tokens) == 12 for tokens in outputs["ar"].values())
