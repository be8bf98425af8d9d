"""RoPE variants picked from a config's scaling dict: plain / Llama-3 (`layers.RotaryEmbedding`)
and DeepSeek-YaRN (`YarnRotaryEmbedding`), shared by the DeepseekV3 target and the DFlash drafter.

DeepSeek-YaRN, as DeepSeek-V3 / Kimi K2.x configs state it (`rope_scaling.type: yarn` with
`factor`, `original_max_position_embeddings`, `beta_fast`, `beta_slow`, `mscale`,
`mscale_all_dim`): frequencies whose wavelength fits the original context more than `beta_fast`
times are kept, those with fewer than `beta_slow` rotations are divided by `factor`, a linear ramp
blends the band between; cos/sin are multiplied by `mscale(factor, mscale) /
mscale(factor, mscale_all_dim)` (YaRN's attention factor), with `mscale(s, m) = 0.1 m ln s + 1`.
DeepseekV3's attention further multiplies its softmax scale by `mscale(factor, mscale_all_dim)^2`
(`yarn_softmax_factor`); for Kimi K2.x (`mscale = mscale_all_dim = 1`, factor 64) the cos/sin
factor is 1 and the softmax factor is about 2.005.
"""

import math

import torch

from ddtree_serve.models.layers import RotaryEmbedding


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def is_yarn(scaling: dict | None) -> bool:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type")) == "yarn"


def yarn_frequencies(dim: int, theta: float, scaling: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies `[dim // 2]` (float32) and the cos/sin attention factor."""
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / original)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(num_rotations: float) -> float:  # the dimension that turns num_rotations times
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    # on the CPU even when the model is built on the meta device (see `RotaryEmbedding`)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    inv_freq = (1.0 / (factor * base)) * ramp + (1.0 / base) * (1 - ramp)
    return inv_freq, float(attention_factor)


def yarn_softmax_factor(scaling: dict | None) -> float:
    """DeepseekV3's softmax-scale multiplier: `mscale(factor, mscale_all_dim)^2` (1 without it)."""
    mscale_all_dim = (scaling or {}).get("mscale_all_dim")
    if not is_yarn(scaling) or not mscale_all_dim:
        return 1.0
    return yarn_mscale(float(scaling["factor"]), float(mscale_all_dim)) ** 2


class YarnRotaryEmbedding(RotaryEmbedding):
    """`RotaryEmbedding` with YaRN frequencies and cos/sin scaled by YaRN's attention factor."""

    def __init__(self, head_dim: int, theta: float, scaling: dict, max_positions: int) -> None:
        super().__init__(head_dim, theta)
        # replaces the plain frequencies before any device copy of them is made
        self._inv_freq_cpu, self.attention_factor = yarn_frequencies(head_dim, theta, scaling, max_positions)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super().forward(positions, torch.float32)
        return (cos * self.attention_factor).to(dtype), (sin * self.attention_factor).to(dtype)


def rotary_embedding(
    head_dim: int, theta: float, scaling: dict | None, max_positions: int
) -> RotaryEmbedding:
    """The rotary embedding a config's scaling dict asks for (None: plain RoPE)."""
    if is_yarn(scaling):
        return YarnRotaryEmbedding(head_dim, theta, scaling or {}, max_positions)
    return RotaryEmbedding(head_dim, theta, scaling)
