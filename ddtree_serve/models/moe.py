"""DeepSeek-V3 mixture of experts: group-limited sigmoid routing ("noaux_tc") and SwiGLU experts.

Routing, per token: sigmoid scores over the routed experts; a per-expert correction bias
(`e_score_correction_bias`, learned by DeepSeek's auxiliary-loss-free balancing) is added for
*selection only*. Experts are split into `num_groups` groups, each group is scored by the sum of
its two best biased scores, the `top_groups` best groups stay eligible, and the `top_k` best
eligible experts are chosen. Their weights are the unbiased scores, optionally renormalised to
sum to one, times `routed_scaling_factor`. Shared experts see every token.

Unquantized experts are `DenseExperts`: the `layers.MLP` SwiGLU block, one module per expert, so
the per-expert keys of HF checkpoints (`mlp.experts.E.gate_proj.weight`, `mlp.gate.weight`,
`mlp.shared_experts.*`) load as they are, dispatched by a plain loop over the experts a batch hits.
INT4 checkpoints (Kimi K2.x) get `int4_experts.Int4Experts` instead: packed weights, a grouped
W4A16 GEMM on CUDA. Both take `(x [N, H], weights [N, k], expert_ids [N, k])`.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddtree_serve.models.int4_experts import Int4Experts
from ddtree_serve.models.layers import MLP
from ddtree_serve.models.quantization import PackedInt4Scheme


@dataclass(frozen=True)
class MoEShape:
    """Sizes and routing switches of one MoE block."""

    hidden_size: int
    intermediate_size: int  # per routed expert (HF `moe_intermediate_size`)
    num_experts: int
    num_shared_experts: int
    top_k: int
    num_groups: int
    top_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float


class TopKRouter(nn.Module):
    """Picks `top_k` experts per token -> (weights `[N, k]` float32, expert ids `[N, k]`).

    Scores are computed in float32 whatever the model dtype: near-ties between experts are
    common, and a rounding difference would change which experts run.
    """

    def __init__(self, shape: MoEShape) -> None:
        super().__init__()
        if shape.num_experts % shape.num_groups:
            raise ValueError(f"{shape.num_experts} experts do not split into {shape.num_groups} groups")
        self.shape = shape
        self.weight = nn.Parameter(torch.empty(shape.num_experts, shape.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(shape.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = self.shape
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E]
        biased = scores + self.e_score_correction_bias.float()  # [N, E], for selection only
        per_group = shape.num_experts // shape.num_groups
        grouped = biased.unflatten(-1, (shape.num_groups, per_group))  # [N, G, E/G]
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # [N, G]
        best_groups = group_scores.topk(shape.top_groups, dim=-1).indices  # [N, top_groups]
        eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        eligible = eligible.repeat_interleave(per_group, dim=1)  # [N, E]
        expert_ids = biased.masked_fill(~eligible, float("-inf")).topk(shape.top_k, dim=-1).indices
        weights = scores.gather(1, expert_ids)  # [N, k], unbiased
        if shape.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * shape.routed_scaling_factor, expert_ids


class DenseExperts(nn.ModuleList):
    """Unquantized routed experts, one `MLP` each (HF keys `experts.E.{gate,up,down}_proj.weight`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(MLP(hidden_size, intermediate_size) for _ in range(num_experts))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Each token's routed experts, weighted: `x [N, H]`, `weights/expert_ids [N, k]` -> `[N, H]`."""
        out = torch.zeros_like(x)
        for expert_id in expert_ids.unique().tolist():  # a host sync: fine for the reference path
            token_idx, choice = (expert_ids == expert_id).nonzero(as_tuple=True)  # [M] each
            expert_out = self[expert_id](x[token_idx]) * weights[token_idx, choice, None]
            out.index_add_(0, token_idx, expert_out.to(out.dtype))
        return out


class MoE(nn.Module):
    """Routed experts (weighted by the router) plus shared experts, on `[..., H]` inputs.

    `quantization` set: the routed experts are packed INT4 (`Int4Experts`); the router and the
    shared experts stay unquantized, as in Kimi K2.x checkpoints. Tokens do not interact (no
    capacity limit), so padding rows in a batch never change the output of real rows.
    """

    def __init__(self, shape: MoEShape, quantization: PackedInt4Scheme | None = None) -> None:
        super().__init__()
        self.gate = TopKRouter(shape)
        sizes = (shape.num_experts, shape.hidden_size, shape.intermediate_size)
        self.experts: nn.Module = (
            DenseExperts(*sizes) if quantization is None else Int4Experts(*sizes, quantization)
        )
        shared_size = shape.intermediate_size * shape.num_shared_experts
        self.shared_experts = MLP(shape.hidden_size, shared_size) if shared_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        weights, expert_ids = self.gate(flat)  # [N, k] each
        out = self.experts(flat, weights, expert_ids).view_as(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
