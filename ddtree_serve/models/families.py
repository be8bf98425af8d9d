"""Target model families: which config parser and model class serve a `config.json`.

The family is picked once, from `model_type`, when a directory is loaded; everything after that
(the runner, the KV cache, the engine) talks to the model through the contract both families
share: `model(input_ids, positions, mask, kv_store, output_layer_ids) -> DecoderOutput`,
`model.logits(hidden)`, and a config with `vocab_size`, `hidden_size`, `num_hidden_layers`,
`tie_word_embeddings`, `eos_token_ids` and `kv_layout`. Adding a family is one entry here.
`cache_layout` picks the cache entry a runner allocates (for MLA, the latent or the decompressed).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import torch

from ddtree_serve.models import deepseek_v3, qwen3
from ddtree_serve.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from ddtree_serve.models.kv_cache import KVLayout
from ddtree_serve.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

TargetConfig = Qwen3Config | DeepseekV3Config
TargetModel = Qwen3ForCausalLM | DeepseekV3ForCausalLM

ConfigT = TypeVar("ConfigT", Qwen3Config, DeepseekV3Config)
# what an MLA target caches per token: the compressed latent, or every head's decompressed K/V
MLACache = Literal["latent", "decompressed"]
MLA_CACHES: tuple[MLACache, ...] = ("latent", "decompressed")


def _requested_dtype(config: Any, key: str, dtype: torch.dtype) -> torch.dtype | None:
    return dtype


def _as_stored(config: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return tensors


def _no_prefix(config: Any) -> str:
    return ""


@dataclass(frozen=True)
class TargetFamily(Generic[ConfigT]):
    """How to read one family's config and build its model (on whatever device is current)."""

    name: str
    model_types: tuple[str, ...]
    parse_config: Callable[[dict[str, Any]], ConfigT]
    build_model: Callable[[ConfigT], TargetModel]
    # (config, checkpoint key, requested dtype) -> dtype to load the tensor in, None = skip it
    tensor_dtype: Callable[[ConfigT, str, torch.dtype], torch.dtype | None] = _requested_dtype
    # (config, loaded checkpoint tensors) -> the model's state dict (renames, stacked experts)
    prepare_tensors: Callable[[ConfigT, dict[str, torch.Tensor]], dict[str, torch.Tensor]] = _as_stored
    # config -> the prefix of the language model's checkpoint keys ("language_model." for kimi_k25)
    checkpoint_prefix: Callable[[ConfigT], str] = _no_prefix


FAMILIES: tuple[TargetFamily, ...] = (
    TargetFamily("qwen3", qwen3.MODEL_TYPES, Qwen3Config.from_dict, Qwen3ForCausalLM),
    TargetFamily(
        "deepseek_v3",
        deepseek_v3.MODEL_TYPES,
        DeepseekV3Config.from_dict,
        DeepseekV3ForCausalLM,
        deepseek_v3.checkpoint_tensor_dtype,
        deepseek_v3.prepare_checkpoint_tensors,
        deepseek_v3.checkpoint_prefix,
    ),
)


def target_family(config: dict[str, Any]) -> TargetFamily:
    """The family serving an HF config dict's `model_type` (missing: the Qwen3 family)."""
    model_type = config.get("model_type", "qwen3")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = sorted(t for family in FAMILIES for t in family.model_types)
    raise ValueError(f"unsupported model_type {model_type!r} (supported: {supported})")


def cache_layout(config: TargetConfig, mla_cache: MLACache) -> KVLayout:
    """The cache entry of a target: `mla_cache` for MLA families, the family's K/V for the others."""
    if isinstance(config, DeepseekV3Config) and mla_cache == "latent":
        return config.latent_kv_layout
    return config.kv_layout
