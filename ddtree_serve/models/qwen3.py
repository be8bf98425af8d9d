"""The Qwen3/Llama-family causal LM: config parsed from an HF `config.json`, and the model.

One class serves Qwen3 (per-head q/k RMSNorm), Qwen2 (q/k/v biases) and Llama (neither):
the differences are two switches of `LayerShape`. Module names mirror HF's
`Qwen3ForCausalLM` (`model.embed_tokens`, `model.layers.N...`, `model.norm`, `lm_head`) so
checkpoint keys load as they are.

Training use: `Qwen3ForCausalLM(config)` is a plain `nn.Module`. Call
`model(input_ids [B, T], positions [B, T], causal_mask(T))` for hidden states and
`model.logits(hidden)` for `[B, T, V]` logits; pass `output_layer_ids` to also get the
hidden states that DFlash context features are made of (`context_features`).
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddtree_serve.models.kv_cache import KVLayout
from ddtree_serve.models.layers import (
    DecoderLayer,
    KVStore,
    LayerShape,
    RMSNorm,
    RotaryEmbedding,
    checkpoint_embedding,
)

# model_type -> (qk_norm, attention_bias default); other Llama-family types refuse to load
_FAMILY = {"qwen3": (True, False), "qwen2": (False, True), "llama": (False, False)}
MODEL_TYPES = tuple(_FAMILY)


@dataclass(frozen=True)
class Qwen3Config:
    """The fields of an HF decoder config that the model reads (unknown keys are kept in `raw`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = True
    model_type: str = "qwen3"
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "Qwen3Config":
        """Parse an HF config dict (transformers 4.x `rope_theta` or 5.x `rope_parameters`)."""
        model_type = cfg.get("model_type", "qwen3")
        if model_type not in _FAMILY:
            raise ValueError(f"unsupported model_type {model_type!r} (supported: {sorted(_FAMILY)})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}")
        if cfg.get("use_sliding_window") or "sliding_attention" in cfg.get("layer_types", []):
            raise ValueError("sliding-window attention is not supported")
        qk_norm, default_bias = _FAMILY[model_type]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 1_000_000.0)))
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope or None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", default_bias)),
            qk_norm=qk_norm,
            model_type=model_type,
            eos_token_ids=eos_ids,
            raw=dict(cfg),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> "Qwen3Config":
        return cls.from_dict(json.loads(Path(path).read_text()))

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(self.num_key_value_heads, self.head_dim, self.head_dim)

    @property
    def layer_shape(self) -> LayerShape:
        return LayerShape(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            attention_bias=self.attention_bias,
            qk_norm=self.qk_norm,
            o_proj_bias=False if self.model_type == "qwen2" else None,
        )


@dataclass
class DecoderOutput:
    """Final (normed) hidden states and the raw outputs of the requested decoder layers."""

    hidden: torch.Tensor  # [B, T, H], after the final norm
    # layer id i -> [B, T, H], HF's hidden_states[i + 1]: layer i's output (the last layer's
    # after the final norm, as HF reports it)
    layer_hidden: dict[int, torch.Tensor]


class Qwen3Model(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        shape = config.layer_shape
        self.embed_tokens = checkpoint_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)


class CausalLM(nn.Module):
    """Decoder body plus LM head; `forward` returns hidden states, `logits` maps them to the vocabulary.

    Every target family shares this wrapper (HF layout: `model.` body, `lm_head`, optionally tied
    to `model.embed_tokens`); a family supplies its config and body module.
    """

    def __init__(self, config: Any, body: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.model = body
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        kv_store: KVStore | None = None,
        output_layer_ids: tuple[int, ...] = (),
    ) -> DecoderOutput:
        """Run the decoder over `input_ids [B, T]` at `positions [B, T]`.

        `mask [B or 1, T, S]` bool: True where a query may attend a key. Without `kv_store`,
        S = T (the tokens themselves; pass `causal_mask(T)` for training). With a store, the
        S columns are whatever `kv_store.update` returns (e.g. a cached prefix then the T new
        tokens). `output_layer_ids` names decoder layers (0-based) whose outputs to keep.
        """
        return run_decoder(self.model, input_ids, positions, mask, kv_store, output_layer_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., H]` -> `[..., V]` in the model dtype."""
        return self.lm_head(hidden)


class Qwen3ForCausalLM(CausalLM):
    """The Qwen3 / Qwen2 / Llama causal LM."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config, Qwen3Model(config))


def run_decoder(
    body: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    kv_store: KVStore | None,
    output_layer_ids: tuple[int, ...],
) -> DecoderOutput:
    """The decoder pass every target family shares: embed, rotate, run the layers, final norm.

    `body` is an HF-style `model.` module with `embed_tokens`, `rotary_emb` (positions ->
    cos, sin), `layers` (each called as `layer(h, cos, sin, mask, kv_store)`) and `norm`.
    """
    h = body.embed_tokens(input_ids)
    cos, sin = body.rotary_emb(positions, h.dtype)
    wanted = set(output_layer_ids)
    layer_hidden: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(body.layers):
        h = layer(h, cos, sin, mask, kv_store)
        if i in wanted:
            layer_hidden[i] = h
    hidden = body.norm(h)
    last = len(body.layers) - 1
    if last in wanted:  # HF's hidden_states[-1] is taken after the final norm
        layer_hidden[last] = hidden
    return DecoderOutput(hidden=hidden, layer_hidden=layer_hidden)


def context_features(output: DecoderOutput, target_layer_ids: tuple[int, ...]) -> torch.Tensor:
    """DFlash context features: the listed layers' outputs concatenated -> `[B, T, len(ids) * H]`.

    A layer id i is HF's `hidden_states[i + 1]` (the output of decoder layer i; for the last
    layer, after the final norm), the convention of z-lab DFlash configs' `target_layer_ids`.
    """
    if not target_layer_ids:
        return output.hidden.new_zeros(*output.hidden.shape[:-1], 0)
    return torch.cat([output.layer_hidden[i] for i in target_layer_ids], dim=-1)
