"""The DFlash block-diffusion drafter, laid out like z-lab's DFlash checkpoints.

Parameters (checkpoint keys): `layers.N.*` (Qwen3 decoder layers), `fc` (Linear from the
concatenated target features `len(target_layer_ids) * target_hidden` to `hidden`),
`hidden_norm` (RMSNorm after `fc`) and `norm` (final RMSNorm). The token embedding and
the LM head are the target's, borrowed at call time and never part of this module.

Attention of one drafter layer (as in z-lab's `Qwen3DFlashAttention`):
  - queries come from the block hidden states (after `input_layernorm`);
  - keys/values come from [context, block]: the context is `hidden_norm(fc(features))`
    projected by the *same* layer's `k_proj`/`v_proj` (+ `k_norm`, RoPE at the context
    tokens' positions), with no norm, residual or MLP of its own; the block's keys/values
    are projected from the same normed block states as the queries;
  - the block is non-causal: every block position sees the whole block.

The Kimi K2.6 drafter is this layout with 6 layers (taps at target layers 1, 12, 24, 35, 47, 58),
block size 8 and DeepSeek-YaRN rope (`models/rope.py`), all read from its `config.json`.

Training use (stateless, batched, any mask): embed the block tokens with the target's
embedding, then `draft_model(noise_embeds [B, Q, H], positions [B, Q], mask [B, Q, C + Q],
context_features [B, C, F], context_positions [B, C])` returns hidden states `[B, Q, H]`; map
them to logits with the target's LM head. Many blocks of one sequence can share a row: put
them side by side in Q and let `mask` give each block its own context prefix (columns
< C, strictly before its anchor) and its own block columns (>= C).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddtree_serve.models.layers import DecoderLayer, RMSNorm
from ddtree_serve.models.qwen3 import Qwen3Config
from ddtree_serve.models.rope import rotary_embedding


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's spread of feature layers when a config names none: evenly from 1 to n - 3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    span = last - first
    return tuple(round(first + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter config: decoder sizes plus the block-drafting fields.

    Fields are read from `dflash_config` first and the top level second, as z-lab's loader
    does (older checkpoints keep `block_size` at the top level).
    """

    decoder: Qwen3Config
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    input_embedding_scale: float = 1.0

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "DFlashConfig":
        extra = cfg.get("dflash_config") or {}
        read = lambda name, default=None: extra.get(name, cfg.get(name, default))
        # DFlash layers are Qwen3 layers (q/k norms) whatever family the target is from
        decoder = Qwen3Config.from_dict({**cfg, "model_type": "qwen3"})
        mask_token_id = read("mask_token_id")
        if mask_token_id is None:
            raise ValueError("DFlash config must define dflash_config.mask_token_id")
        num_target_layers = int(read("num_target_layers"))
        layer_ids = read("target_layer_ids")
        if layer_ids is None:
            layer_ids = default_target_layer_ids(num_target_layers, decoder.num_hidden_layers)
        block_size = int(read("block_size", 16))
        if block_size < 2:  # the block's first position is the last committed token
            raise ValueError(f"DFlash config: block_size must be >= 2, got {block_size}")
        return cls(
            decoder=decoder,
            block_size=block_size,
            mask_token_id=int(mask_token_id),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            num_target_layers=num_target_layers,
            input_embedding_scale=float(read("input_embedding_scale", 1.0)),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> "DFlashConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    @property
    def feature_dim(self) -> int:
        """Width of the concatenated target features (the drafter shares the target's hidden size)."""
        return len(self.target_layer_ids) * self.decoder.hidden_size


class DFlashDraftModel(nn.Module):
    """The drafter's own weights and forward; see the module docstring for the layout."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        dec = config.decoder
        self.config = config
        self.layers = nn.ModuleList(DecoderLayer(dec.layer_shape, i) for i in range(dec.num_hidden_layers))
        self.fc = nn.Linear(config.feature_dim, dec.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(dec.hidden_size, dec.rms_norm_eps)
        self.norm = RMSNorm(dec.hidden_size, dec.rms_norm_eps)
        # plain, Llama-3 or DeepSeek-YaRN (the Kimi K2.6 drafter: theta 50000, factor 64); the
        # softmax scale stays 1/sqrt(head_dim), as in z-lab's Qwen3-layer DFlash attention
        self.rotary_emb = rotary_embedding(
            dec.head_dim, dec.rope_theta, dec.rope_scaling, dec.max_position_embeddings
        )

    def context_key_values(
        self, context_features: torch.Tensor, context_positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer keys/values of the context, each `[B, C, kv_heads, head_dim]`.

        `context_features [B, C, F]` are target features at `context_positions [B, C]`.
        These depend only on the context, never on the block: a runner computes them once
        per committed token and caches them.
        """
        context = self.hidden_norm(self.fc(context_features))
        cos, sin = self.rotary_emb(context_positions, context.dtype)
        return [layer.self_attn.project_kv(context, cos, sin) for layer in self.layers]

    def forward_with_context_kv(
        self,
        noise_embeds: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Block hidden states `[B, Q, H]` given per-layer context keys/values `[B, C, kv, d]`.

        `mask [B or 1, Q, C + Q]`: columns are the C context entries then the Q block entries.
        """
        h = noise_embeds
        cos, sin = self.rotary_emb(positions, h.dtype)
        for layer, (ctx_k, ctx_v) in zip(self.layers, context_kv, strict=True):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.project_q(x, cos, sin)
            k, v = attn.project_kv(x, cos, sin)
            k = torch.cat([ctx_k, k], dim=1)
            v = torch.cat([ctx_v, v], dim=1)
            h = h + attn.attend(q, k, v, mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def forward(
        self,
        noise_embeds: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        context_features: torch.Tensor,
        context_positions: torch.Tensor,
    ) -> torch.Tensor:
        """Stateless drafter forward (training): hidden states of the block positions `[B, Q, H]`.

        `noise_embeds [B, Q, H]`: the target's embedding of the block tokens
        (`[anchor, MASK, ...]`) times `config.input_embedding_scale`.
        """
        context_kv = self.context_key_values(context_features, context_positions)
        return self.forward_with_context_kv(noise_embeds, positions, mask, context_kv)
