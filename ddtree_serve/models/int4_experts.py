"""Routed MoE experts kept as packed INT4 (W4A16): the weights never exist in bf16 as a whole.

`Int4Experts` holds every routed expert of one MoE layer stacked, in the packed layout of
`quantization.py`, with gate and up fused along the output dimension (SwiGLU):
  - `gate_up_packed [E, 2I, H / 8]` int32, `gate_up_scale [E, 2I, H / 32]`
  - `down_packed [E, H, I / 8]` int32, `down_scale [E, H, I / 32]`
(the checkpoint's per-expert `experts.E.{gate,up,down}_proj.weight_packed/_scale` keys are stacked
into these by `stack_int4_expert_tensors`).

Two implementations share one signature, `(x, weights, expert_ids, experts) -> [N, H]`:
`routed_experts_reference` (dequantize the experts a batch hits, then matmul: the spec and the
CPU path) and `ddtree_serve.models.w4a16_triton.routed_experts_triton` (a grouped GEMM that
dequantizes inside the kernel, CUDA). `routed_experts_backend` picks one per device type, once.
"""

import functools
import logging
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ddtree_serve.models.quantization import INT4_PER_WORD, PackedInt4Scheme, dequantize_int4

logger = logging.getLogger(__name__)

RoutedExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "Int4Experts"], torch.Tensor]
_EXPERT_KEY = re.compile(
    r"^(?P<layer>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.(?P<part>.+)$"
)
_QUANTIZED_PARTS = ("weight_packed", "weight_scale", "weight_shape")


class Int4Experts(nn.Module):
    """Stacked packed-INT4 SwiGLU experts; `forward(x [N, H], weights [N, k], expert_ids [N, k])`."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, scheme: PackedInt4Scheme
    ) -> None:
        super().__init__()
        group = scheme.group_size
        for width in (hidden_size, intermediate_size):
            if width % group:
                raise ValueError(f"INT4 experts need widths divisible by the group size {group}, got {width}")
        self.group_size = group
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        two_i = 2 * intermediate_size
        self.register_buffer(
            "gate_up_packed", torch.empty(num_experts, two_i, hidden_size // INT4_PER_WORD, dtype=torch.int32)
        )
        self.register_buffer("gate_up_scale", torch.empty(num_experts, two_i, hidden_size // group))
        self.register_buffer(
            "down_packed",
            torch.empty(num_experts, hidden_size, intermediate_size // INT4_PER_WORD, dtype=torch.int32),
        )
        self.register_buffer("down_scale", torch.empty(num_experts, hidden_size, intermediate_size // group))

    @property
    def num_experts(self) -> int:
        return self.gate_up_packed.shape[0]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Weighted sum of each token's routed experts `[N, H]` (x's dtype)."""
        return routed_experts_backend(x.device.type)(x, weights, expert_ids, self)


def routed_experts_reference(
    x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, experts: Int4Experts
) -> torch.Tensor:
    """The spec: for each expert a batch hits, dequantize its weights and run SwiGLU on its tokens.

    `x [N, H]`, `weights [N, k]` float32 router weights, `expert_ids [N, k]` -> `[N, H]`.
    """
    out = torch.zeros_like(x)
    inter = experts.intermediate_size
    for expert_id in expert_ids.unique().tolist():  # a host sync: fine for the reference path
        token_idx, choice = (expert_ids == expert_id).nonzero(as_tuple=True)  # [M] each
        gate_up = dequantize_int4(
            experts.gate_up_packed[expert_id], experts.gate_up_scale[expert_id], group_size=experts.group_size
        ).to(x.dtype)  # [2I, H]
        down = dequantize_int4(
            experts.down_packed[expert_id], experts.down_scale[expert_id], group_size=experts.group_size
        ).to(x.dtype)  # [H, I]
        gate, up = F.linear(x[token_idx], gate_up).split(inter, dim=-1)  # [M, I] each
        expert_out = F.linear(F.silu(gate) * up, down) * weights[token_idx, choice, None]
        out.index_add_(0, token_idx, expert_out.to(out.dtype))
    return out


@functools.cache
def routed_experts_backend(device_type: str) -> RoutedExpertsFn:
    """The W4A16 routed-experts implementation for a device type, chosen once and logged.

    CUDA with Triton installed: the grouped-GEMM kernel. Anything else: the PyTorch reference.
    """
    if device_type == "cuda":
        try:
            from ddtree_serve.models.w4a16_triton import routed_experts_triton
        except ImportError as error:
            logger.warning("W4A16 MoE: Triton unavailable (%s); using the PyTorch reference on CUDA", error)
        else:
            logger.info("W4A16 MoE: Triton grouped GEMM on %s", device_type)
            return routed_experts_triton
    logger.info("W4A16 MoE: PyTorch reference (dequantize, then matmul) on %s", device_type)
    return routed_experts_reference


def stack_int4_expert_tensors(
    tensors: dict[str, torch.Tensor], hidden_size: int, intermediate_size: int
) -> dict[str, torch.Tensor]:
    """Replace (in place) per-expert packed checkpoint tensors by the stacked `Int4Experts` buffers.

    `...mlp.experts.E.{gate,up,down}_proj.weight_{packed,scale,shape}` become
    `...mlp.experts.{gate_up,down}_{packed,scale}`; every `weight_shape` must be the expert shape
    the config declares, and every layer must list experts 0..E-1 with all three projections.
    Tensors of other modules stay. Each layer's per-expert tensors leave the dict as its stack is
    built, so the peak holds one layer's experts twice, not the model's.
    """
    expected = {"gate": (intermediate_size, hidden_size), "up": (intermediate_size, hidden_size)}
    expected["down"] = (hidden_size, intermediate_size)
    by_layer: dict[str, dict[tuple[int, str, str], str]] = {}
    for key in tensors:
        match = _EXPERT_KEY.match(key)
        if match is not None and match["part"] in _QUANTIZED_PARTS:
            parts = by_layer.setdefault(match["layer"], {})
            parts[(int(match["expert"]), match["proj"], match["part"])] = key
    out = tensors
    for layer, parts in by_layer.items():
        num_experts = 1 + max(expert for expert, _, _ in parts)
        stacked: dict[str, list[torch.Tensor]] = {"packed": [], "scale": []}
        stacked_down: dict[str, list[torch.Tensor]] = {"packed": [], "scale": []}
        for expert in range(num_experts):
            for proj in ("gate", "up", "down"):
                names = [parts.get((expert, proj, part)) for part in _QUANTIZED_PARTS]
                if None in names:
                    raise ValueError(f"{layer}.{expert}.{proj}_proj: incomplete packed INT4 tensors")
                shape = tuple(int(v) for v in out.pop(names[2]).tolist())
                if shape != expected[proj]:
                    raise ValueError(
                        f"{layer}.{expert}.{proj}_proj: weight_shape {shape} != expected {expected[proj]}"
                    )
                target = stacked_down if proj == "down" else stacked
                target["packed"].append(out.pop(names[0]))
                target["scale"].append(out.pop(names[1]))
        # gate rows then up rows per expert (the order `routed_experts_*` split them in)
        for kind in ("packed", "scale"):
            gate_up = [torch.cat(stacked[kind][2 * e : 2 * e + 2]) for e in range(num_experts)]
            out[f"{layer}.gate_up_{kind}"] = torch.stack(gate_up)
            out[f"{layer}.down_{kind}"] = torch.stack(stacked_down[kind])
    return out
