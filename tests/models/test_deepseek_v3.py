"""The DeepseekV3 family (Kimi K2 targets) through TargetRunner, against transformers' DeepseekV3.

Two random tiny configs cover the switches: `lora_q_yarn` (q_lora_rank set, YaRN RoPE with a
softmax mscale, interleaved RoPE, 4 expert groups of which 2 stay eligible, one dense layer)
and `kimi_plain` (q_lora_rank null, plain half-split RoPE, one group, unnormalised top-k
weights, two shared experts, two dense layers, model_type "kimi_k2", tied embeddings). The
runner checks run over both MLA caches (latent and decompressed).
"""

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from ddtree_serve.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from ddtree_serve.models.families import MLA_CACHES, MLACache
from ddtree_serve.models.loading import load_target_model
from ddtree_serve.models.runner import TargetRunner
from tests.models.runner_checks import (
    check_prefill_and_decode_match_hf,
    check_verify_matches_path_decoding_then_commit,
)

VOCAB = 97
LAYER_IDS = (0, 2)
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 20,  # differs from the key head (16 + 8): the cache holds both sizes
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 256,
    "eos_token_id": 5,
}
VARIANTS = {
    "lora_q_yarn": {
        "q_lora_rank": 48,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "rope_interleave": True,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.7,
        },
    },
    "kimi_plain": {
        "q_lora_rank": None,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "n_shared_experts": 2,
        "first_k_dense_replace": 2,
        "rope_interleave": False,
        "tie_word_embeddings": True,
    },
}


def save_hf_deepseek_v3(path: Path, variant: str, seed: int = 0) -> transformers.DeepseekV3ForCausalLM:
    """Random HF DeepseekV3 with fan-in-scaled weights, norms near 1 and a nonzero routing bias."""
    config = transformers.DeepseekV3Config(**_COMMON, **VARIANTS[variant])
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # HF's init (std 0.02, unit norms, zero bias) would hide wiring mistakes
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(path)
    if variant == "kimi_plain":  # Kimi K2 configs name their own model_type
        config_file = path / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model_type": "kimi_k2"}))
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp(f"hf_deepseek_v3_{request.param}")
    return path, save_hf_deepseek_v3(path, request.param)


@pytest.mark.parametrize("mla_cache", MLA_CACHES)
def test_prefill_and_decode_match_transformers(hf_dir: tuple[Path, object], mla_cache: MLACache) -> None:
    path, hf_model = hf_dir
    runner = TargetRunner.from_pretrained(
        path, num_slots=2, max_seq_len=64, target_layer_ids=LAYER_IDS, mla_cache=mla_cache
    )
    assert isinstance(runner.model, DeepseekV3ForCausalLM)
    assert runner.eos_token_ids == (5,)
    if mla_cache == "decompressed":  # decompressed MLA entries: 4 heads, keys 16 + 8 wide, values 20 wide
        assert runner.cache.keys.shape[-2:] == (4, 24) and runner.cache.values.shape[-2:] == (4, 20)
    else:  # one latent entry per token: kv_lora_rank 32 + rope 8, no values
        assert runner.cache.keys.shape[-2:] == (1, 40) and runner.cache.values is None
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    check_prefill_and_decode_match_hf(runner, hf_model, ids, num_prompt=12, slot=1)


@pytest.mark.parametrize("mla_cache", MLA_CACHES)
def test_verify_matches_path_decoding_then_commit_continues(
    hf_dir: tuple[Path, object], mla_cache: MLACache
) -> None:
    runner = TargetRunner.from_pretrained(
        hf_dir[0], num_slots=4, max_seq_len=48, target_layer_ids=LAYER_IDS, mla_cache=mla_cache
    )
    check_verify_matches_path_decoding_then_commit(runner, seed=7)


def test_bf16_load_keeps_router_float32_and_skips_mtp_layers(tmp_path: Path) -> None:
    save_hf_deepseek_v3(tmp_path, "lora_q_yarn")
    # a DeepSeek-V3-style multi-token-prediction layer stored after the last decoder layer
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(64, 128)}, str(tmp_path / "mtp.safetensors"))
    model = load_target_model(tmp_path, dtype=torch.bfloat16)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.bfloat16


def test_quantized_and_unsupported_configs_are_refused(tmp_path: Path) -> None:
    save_hf_deepseek_v3(tmp_path, "kimi_plain")
    config = json.loads((tmp_path / "config.json").read_text())
    refused = {
        "quantization_config": {"quant_method": "compressed-tensors"},
        "scoring_func": "softmax",
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    }
    for key, value in refused.items():
        with pytest.raises(ValueError, match="supported"):
            DeepseekV3Config.from_dict({**config, key: value})
