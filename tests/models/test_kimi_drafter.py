"""The Kimi K2.6 DFlash drafter layout (6 taps, block 8, DeepSeek-YaRN rope) and the K2.6-format pair.

The drafter's rope is checked against a direct computation (transformers' own YaRN frequencies
and attention factor), through the rotary module and through a layer's context keys; the tiny
K2.6-format pair (kimi_k25 INT4 target with a tiktoken tokenizer + YaRN drafter) decodes
greedily to exactly the target's own greedy output.
"""

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.models.dflash import DFlashConfig, DFlashDraftModel
from ddtree_serve.models.drafter import DFlashDrafter
from ddtree_serve.models.layers import apply_rope
from ddtree_serve.models.random_weights import randomize_, write_random_drafter_dir
from ddtree_serve.models.rope import YarnRotaryEmbedding
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

MASK_ID = KIMI_NUM_BASE_TOKENS + KIMI_SPECIAL_TOKENS.index("[MASK]")
NUM_TARGET_LAYERS = 6
TAPS = [0, 1, 2, 3, 4, 5]  # K2.6's drafter taps 6 of 61 target layers: (1, 12, 24, 35, 47, 58)
K26_YARN = {
    "type": "yarn",
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def k26_drafter_config(rope_scaling: dict = K26_YARN) -> dict:
    """The K2.6 DFlash drafter's config.json with its widths reduced (64 q / 8 kv heads -> 8 / 1)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "num_hidden_layers": 6,
        "block_size": 8,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": TAPS},
        "num_target_layers": NUM_TARGET_LAYERS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": 262144,
        "vocab_size": KIMI_VOCAB_SIZE,
        "tie_word_embeddings": False,
    }


def direct_rope(config: dict, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[T, head_dim]` from transformers' YaRN init for the same config.

    Angles in float32, as transformers' rotary embedding computes them (far positions round).
    """
    hf_config = transformers.Qwen3Config(**{k: v for k, v in config.items() if k != "dflash_config"})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    angles = positions[:, None].float() * inv_freq.float()
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


@pytest.mark.parametrize("mscale_all_dim", [1.0, 0.8])  # K2.6's value, and one with attention factor != 1
def test_yarn_drafter_rope_matches_direct_computation(mscale_all_dim: float) -> None:
    config = k26_drafter_config({**K26_YARN, "mscale_all_dim": mscale_all_dim})
    model = DFlashDraftModel(DFlashConfig.from_dict(config))
    assert isinstance(model.rotary_emb, YarnRotaryEmbedding)
    expected_factor = (0.1 * math.log(64) + 1) / (0.1 * mscale_all_dim * math.log(64) + 1)
    assert model.rotary_emb.attention_factor == pytest.approx(expected_factor)
    positions = torch.tensor([0, 1, 7, 4095, 4096, 50_000, 200_000])
    cos, sin = model.rotary_emb(positions[None], torch.float32)
    expected_cos, expected_sin = direct_rope(config, positions)
    assert (cos[0] - expected_cos).abs().max() < 1e-6 and (sin[0] - expected_sin).abs().max() < 1e-6

    # through a layer: the context keys are k_norm(k_proj(context)) rotated by the direct cos/sin
    randomize_(model, seed=3)
    features = torch.randn(
        1, len(positions), model.config.feature_dim, generator=torch.Generator().manual_seed(4)
    )
    with torch.no_grad():
        keys, _ = model.context_key_values(features, positions[None])[2]
        attn = model.layers[2].self_attn
        context = model.hidden_norm(model.fc(features))
        unrotated = attn.k_norm(attn.k_proj(context).unflatten(-1, (1, 16)))
        expected_keys = apply_rope(unrotated, expected_cos[None], expected_sin[None])
    assert (keys - expected_keys).abs().max() < 1e-4


def test_k26_drafter_config_fields() -> None:
    config = DFlashConfig.from_dict(k26_drafter_config())
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (8, MASK_ID, tuple(TAPS))
    assert config.feature_dim == 6 * 64


@pytest.fixture(scope="module")
def k26_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("k26_pair")
    text = {**KIMI_TEXT_CONFIG, "vocab_size": KIMI_VOCAB_SIZE, "num_hidden_layers": NUM_TARGET_LAYERS}
    text["eos_token_id"] = KIMI_NUM_BASE_TOKENS + KIMI_SPECIAL_TOKENS.index("[EOS]")
    hf_dir = save_hf_deepseek_v3(root / "hf", text)
    write_kimi_k25_dir(hf_dir, root / "target", root / "dequantized")
    write_kimi_tokenizer(root / "target")
    drafter = write_random_drafter_dir(root / "drafter", k26_drafter_config(), seed=2)
    return root / "target", drafter


def test_drafter_loads_beside_a_kimi_k25_target(k26_pair: tuple[Path, Path]) -> None:
    drafter = DFlashDrafter.from_pretrained(k26_pair[1], k26_pair[0], num_slots=1, max_seq_len=32)
    assert drafter.vocab_size == KIMI_VOCAB_SIZE and drafter.block_size == 8
    assert json.loads((k26_pair[1] / "config.json").read_text())["rope_scaling"]["factor"] == 64.0


@pytest.mark.parametrize(("mode", "budget"), [("chain", 1), ("ddtree", 6)])
def test_k26_pair_greedy_speculation_equals_target_greedy(
    k26_pair: tuple[Path, Path], mode: str, budget: int
) -> None:
    target, drafter = k26_pair
    tokenizer = load_tokenizer(target)
    prompts = [
        tokenizer.encode(text).ids for text in ("<|im_user|>user<|im_middle|>hello world", "你好 hello")
    ]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outputs = {}
    for run_mode, run_budget in (("ar", 1), (mode, budget)):
        config = EngineConfig(
            target=str(target),
            drafter=str(drafter),
            mode=run_mode,
            budget=run_budget,
            max_num_seqs=2,
            max_seq_len=64,
        )
        engine = build_local_engine(config)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        outputs[run_mode] = run_to_completion(engine)
    assert outputs[mode] == outputs["ar"]
    assert all(len(tokens) == 12 for tokens in outputs["ar"].values())
