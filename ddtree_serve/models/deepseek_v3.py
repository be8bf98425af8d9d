"""The DeepseekV3 family (DeepSeek-V3, Kimi K2.x): MLA attention, DeepSeek MoE, YaRN RoPE.

Three directory layouts load here: `deepseek_v3` and `kimi_k2` (the decoder config at the top
level, keys `model.*` / `lm_head.*`) and Kimi K2.5 / K2.6 as Moonshot ships them, `kimi_k25`
(`KimiK25ForConditionalGeneration`: the decoder config under `text_config`, the language model's
keys under `language_model.`, a MoonViT `vision_config` whose `vision_tower.*` and
`mm_projector.*` tensors are never read; `has_vision_tower` tells the serving layer to refuse
images). A compressed-tensors `pack-quantized` INT4 `quantization_config` (Kimi's routed
experts) builds `Int4Experts`, which keep the packed weights; other schemes are refused.

Module names and the forward contract mirror `qwen3.py` (HF's `model.embed_tokens`,
`model.layers.N.self_attn.kv_b_proj`, `model.layers.N.mlp.experts.E.up_proj`, ...), so the same
`TargetRunner` serves it: prefill, tree verify over a cached prefix, commit and context features
need nothing family-specific beyond the cache entry shape (`DeepseekV3Config.kv_layout` or
`latent_kv_layout`).

Multi-head latent attention (MLA), as implemented here: keys/values come from a compressed
latent (`kv_lora_rank` wide, RMS-normed) expanded per head by `kv_b_proj` into a no-RoPE key part
(`qk_nope_head_dim`) and a value (`v_head_dim`); a decoupled RoPE key part (`qk_rope_head_dim`)
is computed once per token and shared by all heads. Queries come from `q_proj`, or, when
`q_lora_rank` is set, through a normed low-rank bottleneck (`q_a_proj` -> `q_a_layernorm` ->
`q_b_proj`). Two caches serve it, chosen by the runner (`mla_cache`), each through its own
attention arithmetic:
  - latent (the default): per token and layer the normed latent and the rotated RoPE key,
    `kv_lora_rank + qk_rope` numbers shared by all heads (576 for Kimi K2.6: 1152 bytes in bf16),
    with `kv_b_proj` absorbed into the query (W_UK) and the output (W_UV), so attention runs over
    the latent itself, as production MLA kernels do (`MultiHeadLatentAttention._attend_latent`);
  - decompressed (the reference): every head's key (nope + rope dims) and value,
    `num_heads * (qk_nope + qk_rope + v)` numbers (64 * 320 = 20480 for K2.6: 40 KiB in bf16,
    about 36x the latent).
Without a store (context features, training) the decompressed arithmetic runs.

What was checked (tests/models/test_deepseek_v3.py, float32, CPU, random tiny configs with dense
first layers, grouped routing, `q_lora_rank` set and null, YaRN and plain RoPE): logits and
context features equal transformers' `DeepseekV3ForCausalLM` through the runner's prefill and
decode, and tree verify equals decoding each node's path, with either cache;
tests/models/test_mla_latent.py checks the latent cache against the decompressed one through
prefill and rounds of tree verify + commit. Not done for real Kimi K2.6 checkpoints (none was
loaded here): quantized weights other than pack-quantized INT4 experts (e.g.
FP8 block scales) are refused at config parsing; no multi-token-prediction (MTP) layers (their
checkpoint keys are skipped). Tensor parallelism (MLA heads split after the latent, so each
rank caches the whole latent and absorbs its own heads; experts split across the ranks, INT4
included) is `parallel.py`'s, tested against TP=1 in tests/models/test_tensor_parallel.py.
tests/models/test_kimi_k25.py checks a tiny `kimi_k25` directory with INT4 experts against
transformers' DeepseekV3 on the dequantized weights.
"""

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ddtree_serve.models.int4_experts import stack_int4_expert_tensors
from ddtree_serve.models.kv_cache import KVLayout
from ddtree_serve.models.layers import MLP, PreNormBlock, RMSNorm, apply_rope, checkpoint_embedding
from ddtree_serve.models.moe import MoE, MoEShape
from ddtree_serve.models.quantization import (
    PackedInt4Scheme,
    UnsupportedQuantizationError,
    parse_quantization_config,
)
from ddtree_serve.models.qwen3 import CausalLM
from ddtree_serve.models.rope import rotary_embedding, yarn_softmax_factor

# decoder configs, and the Kimi K2.5 / K2.6 wrapper that nests one under `text_config`
DECODER_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
KIMI_K25_MODEL_TYPE = "kimi_k25"
MODEL_TYPES = (*DECODER_MODEL_TYPES, KIMI_K25_MODEL_TYPE)
KIMI_K25_WEIGHT_PREFIX = "language_model."
# DeepSeek's latent norms use a fixed epsilon, not the config's rms_norm_eps
_LATENT_NORM_EPS = 1e-6
_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
_INT4_PACKED_SUFFIX = ".weight_packed"
_INT4_SHAPE_SUFFIX = ".weight_shape"
# the router stays float32 in every model dtype (HF keeps these two in float32 as well)
_FLOAT32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


@dataclass(frozen=True)
class DeepseekV3Config:
    """The fields of a DeepseekV3 / Kimi K2 `config.json` that the model reads (the rest in `raw`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense layers' MLP
    moe_intermediate_size: int  # one routed or shared expert
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    # defaults below are transformers' (the DeepSeek-V3 values), so an omitted key means what
    # it means to HF; a null group count means no grouping
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    n_shared_experts: int = 1
    first_k_dense_replace: int = 3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: dict | None = None  # YaRN parameters; None = plain RoPE
    rope_interleave: bool = True  # DeepSeek checkpoints store RoPE dims as (x0, x1) pairs
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    model_type: str = "deepseek_v3"
    eos_token_ids: tuple[int, ...] = ()
    quantization: PackedInt4Scheme | None = None  # INT4 routed experts; None = unquantized
    weight_prefix: str = ""  # the language model's key prefix ("language_model." for kimi_k25)
    has_vision_tower: bool = False  # the checkpoint carries a vision encoder this model does not run
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "DeepseekV3Config":
        """Parse an HF config dict (4.x `rope_scaling` + `rope_theta` or 5.x `rope_parameters`).

        A `kimi_k25` wrapper is parsed through its `text_config` (a `quantization_config` may sit
        at either level). Refuses what the model would silently get wrong: quantization schemes
        other than pack-quantized INT4, other activations, softmax routing (DeepSeek-V2), MoE
        layers at a stride, non-YaRN scaling.
        """
        model_type = cfg.get("model_type", "deepseek_v3")
        if model_type == KIMI_K25_MODEL_TYPE:
            return cls._from_kimi_k25(cfg)
        if model_type not in DECODER_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r} (supported: {list(MODEL_TYPES)})")
        quantization = parse_quantization_config(cfg.get("quantization_config"))
        expected = {"hidden_act": "silu", "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
        for key, value in expected.items():
            if cfg.get(key, value) != value:
                raise ValueError(f"unsupported {key} {cfg[key]!r} (supported: {value!r})")
        if cfg.get("moe_layer_freq", 1) != 1:
            raise ValueError("MoE layers at a stride (moe_layer_freq != 1) are not supported")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10_000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, yarn)")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"],
            n_routed_experts=cfg["n_routed_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            n_group=cfg.get("n_group", 8) or 1,
            topk_group=cfg.get("topk_group", 4) or 1,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
            n_shared_experts=cfg.get("n_shared_experts", 1) or 0,
            first_k_dense_replace=cfg.get("first_k_dense_replace", 3) or 0,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type == "yarn" else None,
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            model_type=model_type,
            eos_token_ids=eos_ids,
            quantization=quantization,
            raw=dict(cfg),
        )

    @classmethod
    def _from_kimi_k25(cls, cfg: dict[str, Any]) -> "DeepseekV3Config":
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("kimi_k25 config without a text_config")
        text = {**text, "model_type": text.get("model_type") or "kimi_k2"}
        if text["model_type"] not in DECODER_MODEL_TYPES:
            raise ValueError(
                f"unsupported kimi_k25 text_config model_type {text['model_type']!r} "
                f"(supported: {list(DECODER_MODEL_TYPES)})"
            )
        if "quantization_config" not in text and cfg.get("quantization_config"):
            text["quantization_config"] = cfg["quantization_config"]
        if "eos_token_id" not in text and cfg.get("eos_token_id") is not None:
            text["eos_token_id"] = cfg["eos_token_id"]
        decoder = cls.from_dict(text)
        return dataclasses.replace(
            decoder,
            weight_prefix=KIMI_K25_WEIGHT_PREFIX,
            has_vision_tower=bool(cfg.get("vision_config")),
            raw=dict(cfg),
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_layout(self) -> KVLayout:
        """Decompressed MLA entries: every head's key (nope + rope dims) and value."""
        return KVLayout(self.num_attention_heads, self.qk_head_dim, self.v_head_dim)

    @property
    def latent_kv_layout(self) -> KVLayout:
        """Latent MLA entries: the normed latent and the rotated RoPE key, one vector for all heads."""
        return KVLayout(1, self.kv_lora_rank + self.qk_rope_head_dim, 0, replicated=True)

    def moe_shape(self) -> MoEShape:
        return MoEShape(
            hidden_size=self.hidden_size,
            intermediate_size=self.moe_intermediate_size,
            num_experts=self.n_routed_experts,
            num_shared_experts=self.n_shared_experts,
            top_k=self.num_experts_per_tok,
            num_groups=self.n_group,
            top_groups=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )


def checkpoint_tensor_dtype(config: DeepseekV3Config, key: str, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype to load checkpoint tensor `key` in, or None to skip it.

    Skipped: keys outside `weight_prefix` (a kimi_k25 vision tower and projector), and layers past
    `num_hidden_layers` (DeepSeek-V3's MTP module is stored as layer 61). Router weights and
    correction biases load in float32 (see `_FLOAT32_SUFFIXES`); packed INT4 words stay int32.
    """
    if not key.startswith(config.weight_prefix):
        return None
    key = key.removeprefix(config.weight_prefix)
    match = _LAYER_KEY.match(key)
    if match is not None and int(match.group(1)) >= config.num_hidden_layers:
        return None
    if key.endswith(_INT4_PACKED_SUFFIX):
        return torch.int32
    if key.endswith(_INT4_SHAPE_SUFFIX):
        return torch.int64
    return torch.float32 if key.endswith(_FLOAT32_SUFFIXES) else dtype


def prepare_checkpoint_tensors(
    config: DeepseekV3Config, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (already filtered by `checkpoint_tensor_dtype`) -> the model's state dict.

    Strips `weight_prefix` and stacks packed INT4 experts into `Int4Experts` buffers; a packed
    tensor anywhere but the routed experts is refused (only they are INT4 in Kimi checkpoints).
    """
    prefix = config.weight_prefix
    renamed = {key.removeprefix(prefix): tensors.pop(key) for key in list(tensors)}
    if config.quantization is None:
        if any(key.endswith(_INT4_PACKED_SUFFIX) for key in renamed):
            raise UnsupportedQuantizationError("packed INT4 tensors but no quantization_config")
        return renamed
    stacked = stack_int4_expert_tensors(renamed, config.hidden_size, config.moe_intermediate_size)
    leftover = sorted(key for key in stacked if key.endswith((_INT4_PACKED_SUFFIX, _INT4_SHAPE_SUFFIX)))
    if leftover:
        raise UnsupportedQuantizationError(
            f"packed INT4 weights outside the routed experts are not supported (e.g. {prefix}{leftover[0]})"
        )
    return stacked


def checkpoint_prefix(config: DeepseekV3Config) -> str:
    return config.weight_prefix


def softmax_scale(config: DeepseekV3Config) -> float:
    """`1/sqrt(qk_head_dim)`, times YaRN's `mscale(factor, mscale_all_dim)` squared when set."""
    return config.qk_head_dim**-0.5 * yarn_softmax_factor(config.rope_scaling)


class MLAKVStore(Protocol):
    """The `KVStore` an MLA layer writes to; `keys_only` says which entry it caches.

    Decompressed (`keys_only` False): per-head keys `[B, T, h, nope + rope]` and values
    `[B, T, h, v]`, as `KVStore`. Latent (`keys_only` True): keys `[B, T, 1, kv_lora_rank + rope]`,
    the normed latent then the rotated RoPE key, and no values (None in, None out).
    """

    keys_only: bool

    def update(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class MultiHeadLatentAttention(nn.Module):
    """MLA with an explicit boolean mask, over a latent or a decompressed cache (`MLAKVStore`)."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_interleave = config.rope_interleave
        self.low_rank_q = config.q_lora_rank is not None
        self.scale = softmax_scale(config)
        hidden, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        q_out = heads * config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, config.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the RoPE part `[B, T, heads, rope_dim]`.

        Interleaved checkpoints pair dims (0, 1), (2, 3), ...; gathering evens then odds turns
        that into the half-split layout `apply_rope` rotates. Queries and keys both come out
        in that order, so their dot products are unchanged.
        """
        if self.rope_interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rope(x, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        kv_store: MLAKVStore | None = None,
    ) -> torch.Tensor:
        """`x [B, T, H]`, `cos/sin [B, T, rope_dim]`, `mask [B or 1, T, S]` -> `[B, T, H]`.

        A keys-only store caches the latent entry and attention runs over it with absorbed
        weights; any other store (or none) gets the decompressed per-head keys and values.
        """
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.low_rank_q else self.q_proj(x)
        q = q.unflatten(-1, (self.num_heads, self.nope_dim + self.rope_dim))  # [B, T, h, nope + rope]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = self._rope(q_rope, cos, sin)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [B, T, kv_lora_rank]
        k_rope = self._rope(k_rope[:, :, None], cos, sin)  # [B, T, 1, rope], shared by all heads
        if kv_store is not None and kv_store.keys_only:
            entry = torch.cat((latent[:, :, None], k_rope), dim=-1)  # [B, T, 1, kv_lora_rank + rope]
            cached, _ = kv_store.update(self.layer_idx, entry, None)  # [B, S, 1, kv_lora_rank + rope]
            out = self._attend_latent(q_nope, q_rope, cached[:, :, 0], mask)
        else:
            out = self._attend_decompressed(q_nope, q_rope, latent, k_rope, mask, kv_store)
        return self.o_proj(out.flatten(2))

    def _head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`kv_b_proj` per head as views: W_UK `[h, nope, kv_lora_rank]`, W_UV `[h, v, kv_lora_rank]`."""
        per_head = self.kv_b_proj.weight.unflatten(0, (self.num_heads, self.nope_dim + self.v_dim))
        w_uk, w_uv = per_head.split([self.nope_dim, self.v_dim], dim=1)
        return w_uk, w_uv

    def _attend_decompressed(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        mask: torch.Tensor,
        kv_store: MLAKVStore | None,
    ) -> torch.Tensor:
        """Expand the latent into per-head keys and values, cache those, attend -> `[B, T, h, v]`."""
        kv = self.kv_b_proj(latent)  # [B, T, h * (nope + v)]
        k_nope, v = kv.unflatten(-1, (self.num_heads, self.nope_dim + self.v_dim)).split(
            [self.nope_dim, self.v_dim], dim=-1
        )
        q = torch.cat((q_nope, q_rope), dim=-1)  # [B, T, h, nope + rope]
        k = torch.cat((k_nope, k_rope.expand(-1, -1, self.num_heads, -1)), dim=-1)  # [B, T, h, nope + rope]
        if kv_store is not None:
            k, v = kv_store.update(self.layer_idx, k, v)  # [B, S, h, nope + rope], [B, S, h, v]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None], scale=self.scale
        )  # [B, h, T, v]
        return out.transpose(1, 2)

    def _attend_latent(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, cached: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention over cached latent entries `[B, S, kv_lora_rank + rope]` -> `[B, T, h, v]`.

        Absorbed weights (DeepSeek-V2's trick): head h's nope score `q_nope . (W_UK[h] c)` equals
        `(q_nope W_UK[h]) . c`, so W_UK folds into the query, and its output
        `sum_s p_s W_UV[h] c_s` equals `W_UV[h] sum_s p_s c_s`, so W_UV applies after attention.
        Every head then attends one shared key (latent + RoPE part) and value (the latent), so the
        heads run as query rows of a single attention head: no per-head key or value is built
        for the cached rows, and the cache is read once for all heads.
        """
        batch, num_tokens = q_nope.shape[:2]
        num_rows = self.num_heads * num_tokens
        w_uk, w_uv = self._head_weights()
        q_latent = torch.einsum("bthn,hnr->bhtr", q_nope, w_uk)  # [B, h, T, kv_lora_rank]
        q = torch.cat((q_latent, q_rope.transpose(1, 2)), dim=-1)  # [B, h, T, kv_lora_rank + rope]
        keys = cached[:, None]  # [B, 1, S, kv_lora_rank + rope]
        values = keys[..., : self.kv_lora_rank]  # [B, 1, S, kv_lora_rank], a view
        head_mask = mask[:, None].expand(-1, self.num_heads, -1, -1).reshape(mask.shape[0], 1, num_rows, -1)
        out = F.scaled_dot_product_attention(
            q.reshape(batch, 1, num_rows, -1), keys, values, attn_mask=head_mask, scale=self.scale
        )  # [B, 1, h * T, kv_lora_rank]
        per_head = out.view(batch, self.num_heads, num_tokens, -1)  # [B, h, T, kv_lora_rank]
        return torch.einsum("bhtr,hvr->bthv", per_head, w_uv)  # [B, T, h, v]


class DeepseekV3DecoderLayer(PreNormBlock):
    """MLA, then a dense SwiGLU (first `first_k_dense_replace` layers) or MoE."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MultiHeadLatentAttention(config, layer_idx)
        if layer_idx < config.first_k_dense_replace:
            self.mlp: nn.Module = MLP(config.hidden_size, config.intermediate_size)
        else:
            self.mlp = MoE(config.moe_shape(), config.quantization)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3Model(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.embed_tokens = checkpoint_embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary_embedding(
            config.qk_rope_head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )


class DeepseekV3ForCausalLM(CausalLM):
    """Decoder plus LM head, with the same `forward` / `logits` contract as `Qwen3ForCausalLM`."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__(config, DeepseekV3Model(config))

    @property
    def has_vision_tower(self) -> bool:
        """The checkpoint is multimodal; only its text path is loaded, so images must be refused."""
        return self.config.has_vision_tower
