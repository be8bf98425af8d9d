"""Our Qwen3 decoder against transformers' implementation, loaded from the same directory."""

from pathlib import Path

import pytest
import torch
import transformers

from ddtree_serve.models.layers import causal_mask, grouped_attention
from ddtree_serve.models.loading import load_target_model
from ddtree_serve.models.qwen3 import context_features
from tests.models.hf_qwen3 import save_hf_qwen3

# a tiny two-layer GQA decoder, for the family tests that build their transformers config here
TINY_DECODER = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


@pytest.mark.parametrize("tie", [True, False])
def test_full_sequence_logits_match_transformers(tmp_path: Path, tie: bool) -> None:
    hf_model = save_hf_qwen3(tmp_path, tie=tie)
    ours = load_target_model(tmp_path)
    input_ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(input_ids, output_hidden_states=True)
        out = ours(input_ids, torch.arange(11).expand(2, 11), causal_mask(11), output_layer_ids=(0, 2))
        logits = ours.logits(out.hidden)
    assert (logits - expected.logits).abs().max() < 1e-4
    # DFlash feature convention: layer id i is HF hidden_states[i + 1] (the last one normed)
    features = context_features(out, (0, 2))
    hf_features = torch.cat([expected.hidden_states[1], expected.hidden_states[3]], dim=-1)
    assert (features - hf_features).abs().max() < 1e-4


def test_llama_with_llama3_rope_matches_transformers(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
        "rope_theta": 500000.0,
    }
    config = transformers.LlamaConfig(**TINY_DECODER, rope_scaling=rope)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    hf_model.save_pretrained(tmp_path)
    ours = load_target_model(tmp_path)
    assert ours.model.layers[0].self_attn.q_norm is None
    input_ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf_model(input_ids).logits
        logits = ours.logits(ours(input_ids, torch.arange(40)[None], causal_mask(40)).hidden)
    assert (logits - expected).abs().max() < 1e-4


def test_expanded_and_grouped_kv_attention_agree() -> None:
    """The CUDA path (repeated K/V heads) and the CPU path (enable_gqa) compute the same thing."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, h, 8, generator=gen) for h in (4, 2, 2))
    mask = torch.rand(2, 5, 2, generator=gen) > 0.5
    mask = torch.cat([mask, torch.ones(2, 5, 1, dtype=torch.bool)], dim=2)  # [2, 5, 3], no empty row
    k, v = k[:, :3], v[:, :3]
    grouped = grouped_attention(q, k, v, mask, expand_kv=False)
    expanded = grouped_attention(q, k, v, mask, expand_kv=True)
    assert grouped.shape == (2, 5, 4, 8)
    assert (grouped - expanded).abs().max() < 1e-5


def test_qwen2_with_qkv_biases_matches_transformers(tmp_path: Path) -> None:
    """Qwen2 has q/k/v biases but no o_proj bias; its checkpoints must load and match."""
    config = transformers.Qwen2Config(**TINY_DECODER)
    torch.manual_seed(0)
    hf_model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises biases to 0; make them matter
        for name, param in hf_model.named_parameters():
            if name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    hf_model.save_pretrained(tmp_path)
    ours = load_target_model(tmp_path)
    input_ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(input_ids).logits
        logits = ours.logits(ours(input_ids, torch.arange(12)[None], causal_mask(12)).hidden)
    assert (logits - expected).abs().max() < 1e-4
