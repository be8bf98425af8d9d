"""A random tiny transformers Qwen3 saved as an HF directory: the reference our models must match."""

from pathlib import Path

import torch
import transformers


def save_hf_qwen3(path: Path, *, tie: bool, seed: int = 0) -> transformers.Qwen3ForCausalLM:
    config = transformers.Qwen3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        eos_token_id=5,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to 1; perturb them so their wiring is tested
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(path)
    return model
