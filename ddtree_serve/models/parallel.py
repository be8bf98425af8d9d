"""Tensor parallelism for the target: the rank's group, the parallel layers, and the shard plan.

A target of N ranks runs the same forward on every rank with the same inputs; each rank holds
a slice of the weights and one collective joins the slices where a layer needs the whole
(Megatron's split, as vLLM and SGLang shard Llama and DeepSeek):

  - attention by heads: q/k/v column-parallel (each rank its heads), o_proj row-parallel with an
    all-reduce. For MLA the latent projections (`q_a_proj`, `kv_a_proj_with_mqa`, their norms)
    are replicated and the per-head expansions (`q_proj` / `q_b_proj`, `kv_b_proj`) split by head.
    Each rank caches its own heads (`local_kv_layout`), or, for MLA's latent cache, the whole
    latent (the same on every rank), over which it absorbs its own heads' `kv_b_proj` rows.
  - dense MLP: gate/up column-parallel, down row-parallel with an all-reduce.
  - MoE: the router is replicated; routed experts are split across ranks (expert parallel inside
    the group: rank r holds a contiguous block of experts), shared experts column/row split, and
    the routed and shared partial sums are reduced in one all-reduce.
  - vocabulary-parallel embedding (each rank its rows; the others contribute zeros to the
    all-reduce) and LM head (each rank its logits columns, all-gathered).

Every hidden state between layers is therefore replicated, so routing, the context features at
the tapped layers and the logits are the same on every rank, and each rank runs the step's walk
itself and commits its own cache identically.

`shard_target_model` swaps a meta-device model's modules for their local shapes and returns the
`ShardPlan` that says, per checkpoint key, which slice this rank reads (`loading.load_tensors`
reads only that slice, through safetensors' `get_slice`).
"""

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddtree_serve.models.deepseek_v3 import MultiHeadLatentAttention
from ddtree_serve.models.int4_experts import Int4Experts
from ddtree_serve.models.kv_cache import KVLayout
from ddtree_serve.models.layers import MLP, Attention
from ddtree_serve.models.moe import DenseExperts, MoE, TopKRouter
from ddtree_serve.models.quantization import PackedInt4Scheme

_EXPERT_KEY = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<rest>.+)$")


@dataclass(frozen=True)
class RankSpec:
    """How one rank joins its group (picklable: it travels to the rank's process)."""

    rank: int
    world_size: int
    init_method: str  # torch.distributed rendezvous, e.g. "tcp://10.0.0.5:29512"
    timeout_s: float = 300.0  # a collective waiting longer than this raises instead of hanging


class TensorParallel:
    """This process's rank in the target's group and the two collectives the layers use."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def single(cls) -> "TensorParallel":
        """A group of one: no collective runs."""
        return cls(0, 1)

    def part(self, total: int) -> tuple[int, int]:
        """This rank's contiguous `[start, stop)` of `total` items (sizes differ by at most one)."""
        return self.rank * total // self.world_size, (self.rank + 1) * total // self.world_size

    def even_part(self, total: int, what: str) -> tuple[int, int]:
        """`part` for a count that must split evenly (attention heads)."""
        if total % self.world_size:
            raise ValueError(f"{what} = {total} does not split over {self.world_size} tensor-parallel ranks")
        return self.part(total)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; every rank gets the same result."""
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Concatenate every rank's `part(total)` slice of the last dimension -> `[..., total]`."""
        if self.world_size == 1:
            return x
        width = -(-total // self.world_size)  # the widest part; narrower ones are padded to it
        padded = F.pad(x, (0, width - x.shape[-1])).contiguous()
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        parts = [TensorParallel(rank, self.world_size).part(total) for rank in range(self.world_size)]
        return torch.cat(
            [g[..., : stop - start] for g, (start, stop) in zip(gathered, parts, strict=True)], -1
        )


def join_group(spec: RankSpec, device: str) -> TensorParallel:
    """Join the process group of `spec` (NCCL on CUDA, gloo on CPU); blocks until all ranks join."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=spec.init_method,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout_s),
    )
    return TensorParallel(spec.rank, spec.world_size)


def local_kv_layout(layout: KVLayout, tp: TensorParallel) -> KVLayout:
    """The cache entry of this rank: its share of the attention (or MLA) heads; a replicated
    entry (MLA's latent) whole."""
    if layout.replicated:
        return layout
    start, stop = tp.even_part(layout.num_heads, "cached heads")
    return KVLayout(stop - start, layout.key_dim, layout.value_dim)


# ----------------------------------------------------------------------------- parallel layers


class RowParallelLinear(nn.Module):
    """`nn.Linear` holding this rank's input columns; the partial products are all-reduced.

    The bias is whole on every rank and added once, after the reduce.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows `[start, stop)` of the token embedding; ids outside give zeros, the all-reduce fills them."""

    def __init__(self, start: int, stop: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.start = start
        self.weight = nn.Parameter(torch.empty(stop - start, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.start
        inside = (local_ids >= 0) & (local_ids < self.weight.shape[0])
        embedded = F.embedding(local_ids.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.tp.all_reduce(embedded * inside[..., None].to(embedded.dtype))


class VocabParallelLMHead(nn.Module):
    """Rows `[start, stop)` of the LM head: this rank's logits columns, all-gathered to `[..., V]`."""

    def __init__(self, start: int, stop: int, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(stop - start, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(hidden, self.weight), self.vocab_size)


class ExpertParallelMoE(nn.Module):
    """`MoE` with this rank's block of routed experts and its slice of the shared experts.

    Same module names as `MoE` (`gate`, `experts`, `shared_experts`), so checkpoint keys load
    as they are (expert E as local expert E - first_expert). The router runs on every rank over
    the same replicated input, so every rank picks the same experts; each rank runs the pairs
    routed to its own experts, adds its shared-expert partial sum, and one all-reduce joins them.
    """

    def __init__(
        self,
        gate: TopKRouter,
        experts: nn.Module,
        shared_experts: MLP | None,
        first_expert: int,
        num_local_experts: int,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts
        self.first_expert = first_expert
        self.num_local_experts = num_local_experts
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        weights, expert_ids = self.gate(flat)  # [N, k] each, the same on every rank
        local_ids = expert_ids - self.first_expert
        is_local = (local_ids >= 0) & (local_ids < self.num_local_experts)
        token_idx, choice = is_local.nonzero(as_tuple=True)  # [M] each: this rank's (token, choice) pairs
        out = torch.zeros_like(flat)
        if token_idx.numel():
            # each pair as a one-expert token, so any experts module (dense loop, INT4 kernel) runs it
            routed = self.experts(
                flat[token_idx], weights[token_idx, choice, None], local_ids[token_idx, choice, None]
            )  # [M, H]
            out.index_add_(0, token_idx, routed)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)  # this rank's partial sum (down_proj not reduced)
        return self.tp.all_reduce(out).view_as(x)


# -------------------------------------------------------------------------------- shard plan


@dataclass(frozen=True)
class TensorSlice:
    """Rows or columns `[start, stop)` of a checkpoint tensor along `dim`."""

    dim: int
    start: int
    stop: int


@dataclass
class ShardPlan:
    """Which part of every checkpoint tensor this rank reads, and under what name.

    Keys are the model's (without the checkpoint prefix). Sliced tensors are listed in `slices`;
    routed experts are kept per layer when they fall in this rank's block and renumbered from 0;
    every other tensor is read whole (norms, routers, the MLA latent projections, biases of
    row-parallel layers).
    """

    slices: dict[str, TensorSlice] = field(default_factory=dict)
    # "model.layers.N.mlp.experts" -> this rank's experts [first, stop)
    expert_blocks: dict[str, tuple[int, int]] = field(default_factory=dict)

    def resolve(self, key: str) -> tuple[str, TensorSlice | None] | None:
        """(local key, slice or None = whole) of model key `key`, or None: another rank's expert."""
        match = _EXPERT_KEY.match(key)
        if match is not None and match["experts"] in self.expert_blocks:
            first, stop = self.expert_blocks[match["experts"]]
            expert = int(match["expert"])
            if not first <= expert < stop:
                return None
            return f"{match['experts']}.{expert - first}.{match['rest']}", None
        return key, self.slices.get(key)

    def with_prefix(self, prefix: str) -> Callable[[str], tuple[str, TensorSlice | None] | None]:
        """`resolve` for checkpoint keys that carry `prefix` (the local key keeps it)."""

        def resolve(key: str) -> tuple[str, TensorSlice | None] | None:
            resolved = self.resolve(key.removeprefix(prefix))
            return None if resolved is None else (prefix + resolved[0], resolved[1])

        return resolve


def shard_target_model(model: nn.Module, tp: TensorParallel) -> ShardPlan:
    """Swap the modules of a meta-device target (`CausalLM`) for this rank's shards; the plan to load them.

    Must run before any weight is assigned: the new modules are empty, on the meta device.
    """
    plan = ShardPlan()
    body = model.model
    with torch.device("meta"):
        for i, layer in enumerate(body.layers):
            prefix = f"model.layers.{i}"
            layer.self_attn = _shard_attention(layer.self_attn, tp, plan, f"{prefix}.self_attn")
            layer.mlp = _shard_feed_forward(layer.mlp, tp, plan, f"{prefix}.mlp")
        vocab_size, hidden_size = body.embed_tokens.weight.shape
        start, stop = tp.part(vocab_size)
        body.embed_tokens = VocabParallelEmbedding(start, stop, hidden_size, tp)
        model.lm_head = VocabParallelLMHead(start, stop, hidden_size, vocab_size, tp)
    plan.slices["model.embed_tokens.weight"] = TensorSlice(0, start, stop)
    plan.slices["lm_head.weight"] = TensorSlice(0, start, stop)
    return plan


def _column(linear: nn.Linear, start: int, stop: int, plan: ShardPlan, name: str) -> nn.Linear:
    """Output features `[start, stop)` of `linear` (no communication: the next layer reads them)."""
    bias = linear.bias is not None
    plan.slices[f"{name}.weight"] = TensorSlice(0, start, stop)
    if bias:
        plan.slices[f"{name}.bias"] = TensorSlice(0, start, stop)
    return nn.Linear(linear.in_features, stop - start, bias=bias)


def _row(
    linear: nn.Linear, start: int, stop: int, tp: TensorParallel, plan: ShardPlan, name: str
) -> RowParallelLinear:
    """Input features `[start, stop)` of `linear`, reduced over the ranks (bias read whole)."""
    plan.slices[f"{name}.weight"] = TensorSlice(1, start, stop)
    return RowParallelLinear(stop - start, linear.out_features, linear.bias is not None, tp)


def _shard_attention(attn: nn.Module, tp: TensorParallel, plan: ShardPlan, name: str) -> nn.Module:
    if isinstance(attn, Attention):
        h0, h1 = tp.even_part(attn.num_heads, "num_attention_heads")
        g0, g1 = tp.even_part(attn.num_kv_heads, "num_key_value_heads")
        d = attn.head_dim
        attn.q_proj = _column(attn.q_proj, h0 * d, h1 * d, plan, f"{name}.q_proj")
        attn.k_proj = _column(attn.k_proj, g0 * d, g1 * d, plan, f"{name}.k_proj")
        attn.v_proj = _column(attn.v_proj, g0 * d, g1 * d, plan, f"{name}.v_proj")
        attn.o_proj = _row(attn.o_proj, h0 * d, h1 * d, tp, plan, f"{name}.o_proj")
        attn.num_heads, attn.num_kv_heads = h1 - h0, g1 - g0
        return attn
    if isinstance(attn, MultiHeadLatentAttention):
        h0, h1 = tp.even_part(attn.num_heads, "num_attention_heads")
        qk, kv, v = attn.nope_dim + attn.rope_dim, attn.nope_dim + attn.v_dim, attn.v_dim
        if attn.low_rank_q:
            attn.q_b_proj = _column(attn.q_b_proj, h0 * qk, h1 * qk, plan, f"{name}.q_b_proj")
        else:
            attn.q_proj = _column(attn.q_proj, h0 * qk, h1 * qk, plan, f"{name}.q_proj")
        attn.kv_b_proj = _column(attn.kv_b_proj, h0 * kv, h1 * kv, plan, f"{name}.kv_b_proj")
        attn.o_proj = _row(attn.o_proj, h0 * v, h1 * v, tp, plan, f"{name}.o_proj")
        attn.num_heads = h1 - h0
        return attn
    raise TypeError(f"no tensor-parallel plan for attention module {type(attn).__name__}")


def _shard_mlp(mlp: MLP, tp: TensorParallel, plan: ShardPlan, name: str, *, reduce: bool) -> MLP:
    """Gate/up column-parallel, down row-parallel; `reduce=False` leaves down's partial sum."""
    i0, i1 = tp.part(mlp.gate_proj.out_features)
    mlp.gate_proj = _column(mlp.gate_proj, i0, i1, plan, f"{name}.gate_proj")
    mlp.up_proj = _column(mlp.up_proj, i0, i1, plan, f"{name}.up_proj")
    if reduce:
        mlp.down_proj = _row(mlp.down_proj, i0, i1, tp, plan, f"{name}.down_proj")
    else:
        plan.slices[f"{name}.down_proj.weight"] = TensorSlice(1, i0, i1)
        mlp.down_proj = nn.Linear(i1 - i0, mlp.down_proj.out_features, bias=False)
    return mlp


def _shard_feed_forward(mlp: nn.Module, tp: TensorParallel, plan: ShardPlan, name: str) -> nn.Module:
    if isinstance(mlp, MLP):
        return _shard_mlp(mlp, tp, plan, name, reduce=True)
    if isinstance(mlp, MoE):
        shape = mlp.gate.shape
        first, stop = tp.part(shape.num_experts)
        sizes = (stop - first, shape.hidden_size, shape.intermediate_size)
        if isinstance(mlp.experts, Int4Experts):
            experts: nn.Module = Int4Experts(*sizes, PackedInt4Scheme(group_size=mlp.experts.group_size))
        elif isinstance(mlp.experts, DenseExperts):
            experts = DenseExperts(*sizes)
        else:
            raise TypeError(f"no expert-parallel plan for experts module {type(mlp.experts).__name__}")
        plan.expert_blocks[f"{name}.experts"] = (first, stop)
        shared = mlp.shared_experts
        if shared is not None:
            shared = _shard_mlp(shared, tp, plan, f"{name}.shared_experts", reduce=False)
        return ExpertParallelMoE(mlp.gate, experts, shared, first, stop - first, tp)
    raise TypeError(f"no tensor-parallel plan for feed-forward module {type(mlp).__name__}")
