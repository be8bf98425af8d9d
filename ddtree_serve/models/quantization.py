"""Compressed-tensors `pack-quantized` INT4 weights, as Kimi K2.x ships its routed experts.

On disk (compressed-tensors' `PackedQuantizationCompressor`), one quantized Linear `W [out, in]`
is three tensors:
  - `weight_packed [out, in / 8]` int32: eight 4-bit values per word, value j of a word in bits
    `4j .. 4j + 3` (little end first), each stored as `q + 8` so the nibble is unsigned;
  - `weight_scale [out, in / group_size]`: one scale per row and group of `group_size` columns;
  - `weight_shape [2]`: `(out, in)`.
Symmetric INT4 means no zero point: `W[o, i] = q[o, i] * scale[o, i // group_size]`, q in [-8, 7].

Only that scheme is accepted (4 bits, integer, symmetric, group strategy, group size 32, weights
only): anything else in a `quantization_config` is refused with `UnsupportedQuantizationError`,
one line naming the scheme, rather than run with the wrong arithmetic.
"""

from dataclasses import dataclass
from typing import Any

import torch

INT4_GROUP_SIZE = 32
INT4_PER_WORD = 8  # 4-bit values per int32 word
_INT4_OFFSET = 8  # stored nibble = q + 8


class UnsupportedQuantizationError(ValueError):
    """A checkpoint's quantization scheme is not one this package computes with."""


@dataclass(frozen=True)
class PackedInt4Scheme:
    """Weight-only symmetric INT4 with one scale per `group_size` input columns."""

    group_size: int = INT4_GROUP_SIZE


def parse_quantization_config(quantization_config: dict[str, Any] | None) -> PackedInt4Scheme | None:
    """The scheme of an HF `quantization_config` (None: not quantized); refuses every other scheme."""
    if not quantization_config:
        return None
    method = quantization_config.get("quant_method", "?")
    if method != "compressed-tensors":
        raise UnsupportedQuantizationError(
            f"unsupported quantization {method!r} (supported: compressed-tensors pack-quantized "
            f"INT4 symmetric, group {INT4_GROUP_SIZE}, weights only)"
        )
    groups = quantization_config.get("config_groups") or {}
    if not groups:
        raise UnsupportedQuantizationError("unsupported compressed-tensors config: no config_groups")
    for name, group in groups.items():
        _check_group(name, group, quantization_config.get("format"))
    if quantization_config.get("kv_cache_scheme"):
        raise UnsupportedQuantizationError("quantized KV cache (kv_cache_scheme) is not supported")
    return PackedInt4Scheme()


def _check_group(name: str, group: dict[str, Any], default_format: str | None) -> None:
    weights = group.get("weights") or {}
    format_name = group.get("format") or default_format
    scheme = (
        f"{format_name} {weights.get('type', '?')}{weights.get('num_bits', '?')} "
        f"{'symmetric' if weights.get('symmetric', True) else 'asymmetric'} "
        f"{weights.get('strategy', '?')} group_size={weights.get('group_size')}"
    )
    problems = []
    if format_name != "pack-quantized":
        problems.append(f"format {format_name!r}")
    if weights.get("num_bits") != 4 or weights.get("type") != "int":
        problems.append("not 4-bit integer weights")
    if not weights.get("symmetric", True):
        problems.append("asymmetric (zero points)")
    if weights.get("strategy") != "group" or weights.get("group_size") != INT4_GROUP_SIZE:
        problems.append(f"not group-{INT4_GROUP_SIZE} scales")
    if group.get("input_activations") or group.get("output_activations"):
        problems.append("activation quantization")
    if weights.get("dynamic"):
        problems.append("dynamic weight scales")
    if problems:
        raise UnsupportedQuantizationError(
            f"unsupported quantization scheme in config group {name!r}: {scheme} ({', '.join(problems)}); "
            f"supported: pack-quantized int4 symmetric group group_size={INT4_GROUP_SIZE}, weights only"
        )


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """`packed [..., out, in / 8]` int32 -> the signed values `[..., out, in]` int8 in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)  # [8]
    nibbles = (packed[..., None] >> shifts) & 0xF  # [..., out, in / 8, 8]; & drops sign extension
    return (nibbles.flatten(-2)[..., :in_features] - _INT4_OFFSET).to(torch.int8)


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, *, group_size: int = INT4_GROUP_SIZE
) -> torch.Tensor:
    """`packed [..., out, in / 8]` int32 and `scale [..., out, in / group]` -> `W [..., out, in]`.

    The product is formed in float32 (exact: a 4-bit integer times a bf16 or float32 scale) and
    returned in the scale's dtype.
    """
    in_features = scale.shape[-1] * group_size
    values = unpack_int4(packed, in_features).float()
    weight = values * scale.float().repeat_interleave(group_size, dim=-1)
    return weight.to(scale.dtype)
