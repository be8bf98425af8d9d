"""Tiny Kimi K2.6-format directories written in the exact on-disk layouts, with random weights.

`write_kimi_k25_dir` turns a transformers DeepseekV3 directory into what Moonshot ships: a
`kimi_k25` wrapper config (`KimiK25ForConditionalGeneration`, the decoder under `text_config`
with a compressed-tensors `quantization_config`, a MoonViT `vision_config`), the language model's
keys under `language_model.`, vision tower and projector tensors beside them, and every routed
expert packed to INT4 by compressed-tensors' own compressor. It also writes the dequantized
weights as a plain DeepseekV3 directory, for transformers to run as the reference.
"""

import base64
import json
import math
import re
from pathlib import Path

import torch
import transformers
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import load_file, save_file

_ROUTED_EXPERT_WEIGHT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
INT4_SCHEME = QuantizationScheme(
    targets=["Linear"],
    weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
    format="pack-quantized",
)
# what Kimi K2.x configs declare: INT4 routed experts, everything else left in bf16
KIMI_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
            },
        }
    },
    "ignore": [
        "language_model.lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:vision_tower.*",
        "re:mm_projector.*",
    ],
    "kv_cache_scheme": None,
}
KIMI_VISION_CONFIG = {"model_type": "moonvit", "hidden_size": 16, "patch_size": 14, "num_hidden_layers": 1}
# DeepseekV3 text config in Kimi K2.x's form (one routing group, YaRN with mscale = mscale_all_dim = 1)
KIMI_TEXT_CONFIG = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "first_k_dense_replace": 1,
    "rope_interleave": True,
    "max_position_embeddings": 256,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rope_theta": 50000.0,
    "eos_token_id": 5,
}


def save_hf_deepseek_v3(path: Path, config: dict, seed: int = 0) -> Path:
    """A random transformers DeepseekV3 (fan-in-scaled weights, norms near 1, nonzero routing bias)."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


def pack_int4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' packed form of `weight [out, in]`: absmax group scales (bf16), INT4 words."""
    scale = (weight.float().unflatten(-1, (-1, 32)).abs().amax(-1) / 7).to(torch.bfloat16)
    state = {"weight": weight.float(), "weight_scale": scale}
    return PackedQuantizationCompressor.compress(state, INT4_SCHEME)


def write_kimi_k25_dir(hf_dir: Path, kimi_dir: Path, dequantized_dir: Path) -> None:
    """`hf_dir` (transformers DeepseekV3) -> a `kimi_k25` INT4 directory and its dequantized twin."""
    config = json.loads((hf_dir / "config.json").read_text())
    kimi_tensors: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for key, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        if _ROUTED_EXPERT_WEIGHT.match(key):
            packed = pack_int4(tensor)
            stem = key.removesuffix("weight")
            kimi_tensors.update({f"language_model.{stem}{part}": value for part, value in packed.items()})
            # float32 scales: q * scale exactly, as the float32 model computes it
            exact = {**packed, "weight_scale": packed["weight_scale"].float()}
            dequantized[key] = PackedQuantizationCompressor.decompress(exact, INT4_SCHEME)["weight"]
        else:
            kimi_tensors[f"language_model.{key}"] = tensor
            dequantized[key] = tensor
    generator = torch.Generator().manual_seed(5)
    kimi_tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(16, 3, 14, 14, generator=generator)
    kimi_tensors["mm_projector.proj.0.weight"] = torch.randn(64, 64, generator=generator)
    kimi_dir.mkdir(parents=True, exist_ok=True)
    save_file(kimi_tensors, str(kimi_dir / "model.safetensors"), metadata={"format": "pt"})
    kimi_config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {**config, "model_type": "kimi_k2", "quantization_config": KIMI_QUANTIZATION_CONFIG},
        "vision_config": KIMI_VISION_CONFIG,
        "eos_token_id": config.get("eos_token_id"),
    }
    (kimi_dir / "config.json").write_text(json.dumps(kimi_config, indent=2))
    dequantized_dir.mkdir(parents=True, exist_ok=True)
    save_file(dequantized, str(dequantized_dir / "model.safetensors"), metadata={"format": "pt"})
    (dequantized_dir / "config.json").write_text(json.dumps(config, indent=2))


# A tiny tiktoken BPE in Kimi's layout: the 256 bytes, then merges reaching "hello"; special
# tokens follow at 261.. (named in tokenizer_config.json, the rest `<|reserved_token_N|>`)
_TIKTOKEN_MERGES = [b"he", b"ll", b"hell", b"hello", b"wo", b"rl", b"rld", b"world"]
KIMI_SPECIAL_TOKENS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>"]
KIMI_SPECIAL_TOKENS += ["<|im_middle|>", "[MASK]"]
KIMI_NUM_BASE_TOKENS = 256 + len(_TIKTOKEN_MERGES)
KIMI_VOCAB_SIZE = KIMI_NUM_BASE_TOKENS + 256
KIMI_CHAT_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}{{ raise_exception('unknown role ' + message['role']) }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' and message.get('reasoning_content') -%}"
    "<think>{{ message['reasoning_content'] }}</think>"
    "{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)


def write_kimi_tokenizer(path: Path) -> Path:
    """`tiktoken.model` + `tokenizer_config.json` (special tokens, chat template) as Kimi ships them."""
    path.mkdir(parents=True, exist_ok=True)
    tokens = [bytes([b]) for b in range(256)] + _TIKTOKEN_MERGES
    lines = [f"{base64.b64encode(token).decode()} {rank}" for rank, token in enumerate(tokens)]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    added = {
        str(KIMI_NUM_BASE_TOKENS + i): {"content": token, "special": True}
        for i, token in enumerate(KIMI_SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": added,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "chat_template": KIMI_CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path
