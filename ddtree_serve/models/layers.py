"""Decoder building blocks of the Qwen3/Llama family, shared by the target and the DFlash drafter.

Every forward here is stateless and batched: it takes explicit positions and an explicit
boolean attention mask (True = may attend), so the same modules serve training (full
sequences, any mask), the target's tree verification (ancestor masks on top of a cached
prefix) and the drafter's non-causal blocks. Caching is the caller's business: attention
hands its fresh keys/values to an optional `KVStore`, which returns the keys/values to
attend over (the cached prefix followed by the fresh entries, in mask column order).

Parameter names follow Hugging Face checkpoints (`q_proj`, `k_norm`, `gate_proj`,
`input_layernorm`, ...) so a checkpoint's safetensors keys load without renaming.
"""

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LayerShape:
    """The sizes one decoder layer needs; `qk_norm` is Qwen3's per-head RMSNorm on q and k.

    `attention_bias` puts biases on q/k/v; `o_proj_bias` on the output projection (None: same as
    `attention_bias`, as in Llama and Qwen3; Qwen2 has q/k/v biases and none on o_proj).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool = False
    qk_norm: bool = True
    o_proj_bias: bool | None = None


class KVStore(Protocol):
    """Where a layer's keys/values live between calls (the runners' slot caches).

    `update` receives the fresh post-RoPE keys/values `[B, T, kv_heads, head_dim]` of
    `layer_idx` and returns the keys/values to attend over, `[B, S, kv_heads, head_dim]`,
    whose S columns must line up with the attention mask's last dimension.
    """

    def update(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def checkpoint_embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """An embedding whose weight a checkpoint fills, built without its random init.

    Models are built on the meta device and then assigned their loaded tensors; there the
    default `normal_` init runs through `torch._refs`, which imports `torch._dynamo`: about
    1.3 s of every worker start (and of every in-place target restart) for values never used.
    """
    return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(num_embeddings, embedding_dim))


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32 and cast back, as the HF Qwen3/Llama models do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse RoPE frequencies `[head_dim // 2]` (float32) for default and Llama-3 scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling or {})
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, llama3)")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, a smooth band between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Turns integer positions of any shape into the (cos, sin) pair that `apply_rope` uses.

    The inverse frequencies are a float32 tensor kept outside the module's buffers, one copy
    per device: `.to(bfloat16)` on a model must not round them, and building a model on the
    meta device must not leave them empty.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self._inv_freq_cpu = rope_inv_freq(head_dim, theta, scaling).to("cpu")
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq_by_device:
            self._inv_freq_by_device[device] = self._inv_freq_cpu.to(device)
        return self._inv_freq_by_device[device]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [...] int64 -> cos, sin [..., head_dim], angles computed in float32
        freqs = positions[..., None].float() * self._inv_freq(positions.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [B, T, heads, head_dim]` by `cos/sin [B, T, head_dim]` (half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, expand_kv: bool
) -> torch.Tensor:
    """Masked GQA: `q [B, T, h, d]`, `k/v [B, S, kv_h, d]`, `mask [B, T, S]` -> `[B, T, h, d]`.

    With a mask, CUDA's fused SDPA kernels reject `enable_gqa` and fall back to the math
    kernel (which materialises the scores), so on CUDA the K/V heads are repeated instead
    (`expand_kv`) and the memory-efficient kernel runs. On CPU `enable_gqa` avoids the copy.
    """
    num_groups = q.shape[2] // k.shape[2]
    if expand_kv and num_groups > 1:
        k = k.repeat_interleave(num_groups, dim=2)
        v = v.repeat_interleave(num_groups, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None],
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


class Attention(nn.Module):
    """Grouped-query attention with optional Qwen3 q/k norms and an explicit boolean mask.

    Split into `project_q`, `project_kv` and `attend` so the DFlash drafter can build keys
    from a second source (the projected target context) with the same weights.
    """

    def __init__(self, shape: LayerShape, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = shape.num_attention_heads
        self.num_kv_heads = shape.num_key_value_heads
        self.head_dim = shape.head_dim
        bias = shape.attention_bias
        self.q_proj = nn.Linear(shape.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(shape.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(shape.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        o_bias = bias if shape.o_proj_bias is None else shape.o_proj_bias
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, shape.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, shape.rms_norm_eps) if shape.qk_norm else None

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`x [B, T, H]` -> post-norm, post-RoPE queries `[B, T, heads, head_dim]`."""
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`x [B, T, H]` -> post-RoPE keys and values, each `[B, T, kv_heads, head_dim]`."""
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Queries `[B, T, h, d]` over keys/values `[B, S, kv_h, d]` where `mask [B, T, S]` -> `[B, T, H]`.

        Every mask row must allow at least one column, or that row's output is NaN.
        """
        out = grouped_attention(q, k, v, mask, expand_kv=q.device.type == "cuda")
        return self.o_proj(out.flatten(2))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        kv_store: KVStore | None = None,
    ) -> torch.Tensor:
        q = self.project_q(x, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        if kv_store is not None:
            k, v = kv_store.update(self.layer_idx, k, v)
        return self.attend(q, k, v, mask)


class MLP(nn.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PreNormBlock(nn.Module):
    """Pre-norm residual block: `self_attn` then `mlp`, each behind an RMSNorm.

    Subclasses only choose the modules (HF names: `self_attn`, `mlp`, `input_layernorm`,
    `post_attention_layernorm`); the residual wiring is the same for every family.
    """

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        kv_store: KVStore | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_store)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderLayer(PreNormBlock):
    """Qwen3/Llama block: grouped-query attention and a SwiGLU MLP."""

    def __init__(self, shape: LayerShape, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(shape, layer_idx)
        self.mlp = MLP(shape.hidden_size, shape.intermediate_size)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


def causal_mask(num_tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`[1, T, T]` lower-triangular boolean mask for plain left-to-right sequences."""
    return torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril()[None]


def avoid_per_shape_attention_plans(device: torch.device) -> None:
    """Turn off cuDNN attention on CUDA (process-wide): it builds a plan per new sequence length.

    Decoding grows the length every step, so every step met a new shape: on the H200 the bench
    measured 46 ms per batch-16 plain decode step with cuDNN attention and 5.9 ms without. The
    memory-efficient kernel takes the same masks with no per-shape setup. Both runners call this
    when they are built on a CUDA device.
    """
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
