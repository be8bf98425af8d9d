"""W4A16 routed experts on CUDA: a Triton grouped GEMM that dequantizes packed INT4 tiles in-kernel.

Same signature and result as `int4_experts.routed_experts_reference` (the spec). The steps:
  1. `plan_routes`: sort the (token, choice) pairs by expert and give each expert a run of slots
     padded to `BLOCK_M`, so every M-block of slots belongs to one expert. The slot count is a
     bound known from the shapes alone (`ceil(P / BLOCK_M) + min(E, P)` blocks for P pairs), so
     no step reads a data-dependent size back to the host (CUDA-graph friendly); unused blocks
     carry expert -1 and exit at once.
  2. gate/up GEMM over the slots (rows gathered from the tokens), SwiGLU, down GEMM.
  3. each token sums its k slot outputs, weighted by the router.
The kernel reads each weight tile as int32 words, shifts out the nibbles, multiplies by the group
scales and feeds `tl.dot` in the activation dtype: the bf16 weight matrix never exists in memory.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ddtree_serve.models.int4_experts import Int4Experts

BLOCK_M = 16  # slots per program (tl.dot's minimum); each expert's run is padded to a multiple
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _w4a16_grouped_gemm_kernel(
    a_ptr,  # [rows, K] activations
    a_row_ptr,  # [num_slots] int32: the activation row each slot reads, -1 = padding
    packed_ptr,  # [E, N, K / 8] int32
    scale_ptr,  # [E, N, K / GROUP_SIZE]
    out_ptr,  # [num_slots, N]
    block_expert_ptr,  # [num_blocks] int32: the expert of each BLOCK_M slots, -1 = unused
    stride_am,
    stride_pe,
    stride_pn,
    stride_se,
    stride_sn,
    stride_om,
    N: tl.constexpr,  # the model's widths: one compile per layer shape
    K: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[slot, n] = sum_k a[a_row[slot], k] * q_e[n, k] * scale_e[n, k // GROUP_SIZE]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    a_rows = tl.load(a_row_ptr + slots).to(tl.int64)
    row_ok = a_rows >= 0
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    packed_base = packed_ptr + expert * stride_pe + cols[None, :] * stride_pn  # [1, BLOCK_N]
    scale_base = scale_ptr + expert * stride_se + cols[None, :] * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w_mask = k_ok[:, None] & col_ok[None, :]
        words = tl.load(packed_base + (ks[:, None] // 8), mask=w_mask, other=0)  # [BLOCK_K, BLOCK_N]
        nibbles = (words >> ((ks[:, None] % 8) * 4)) & 0xF  # the mask drops the sign extension
        scales = tl.load(scale_base + (ks[:, None] // GROUP_SIZE), mask=w_mask, other=0.0)
        w = ((nibbles - 8).to(tl.float32) * scales.to(tl.float32)).to(a.dtype)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    tl.store(
        out_ptr + slots[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=col_ok[None, :],
    )


@dataclass(frozen=True)
class RoutePlan:
    """Slots of the (token, choice) pairs, grouped by expert in runs padded to `BLOCK_M`."""

    token_rows: torch.Tensor  # [num_slots] int32: the token a slot reads, -1 = padding
    slot_rows: torch.Tensor  # [num_slots] int32: the slot itself, -1 = padding
    pair_slot: torch.Tensor  # [P] int64: the slot of pair p = token * k + choice
    block_expert: torch.Tensor  # [num_blocks] int32: expert of each block, -1 = unused


def plan_routes(expert_ids: torch.Tensor, num_experts: int) -> RoutePlan:
    """`expert_ids [N, k]` -> the slot plan; device ops only, sizes from the shapes alone."""
    device = expert_ids.device
    top_k = expert_ids.shape[1]
    pairs = expert_ids.flatten()  # [P]
    num_pairs = pairs.numel()
    num_blocks = triton.cdiv(num_pairs, BLOCK_M) + min(num_experts, num_pairs)
    num_slots = num_blocks * BLOCK_M
    order = pairs.argsort(stable=True)  # [P] pair indices, by expert
    sorted_experts = pairs[order]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, pairs, torch.ones_like(pairs))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = padded.cumsum(0)
    first_pair = counts.cumsum(0) - counts  # [E] rank of each expert's first pair in `order`
    rank = torch.arange(num_pairs, device=device) - first_pair[sorted_experts]
    slot = (padded_end - padded)[sorted_experts] + rank  # [P], in `order`
    token_rows = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
    token_rows[slot] = (order // top_k).to(torch.int32)
    slot_rows = torch.full((num_slots,), -1, dtype=torch.int32, device=device)
    slot_rows[slot] = slot.to(torch.int32)
    pair_slot = torch.empty(num_pairs, dtype=torch.int64, device=device)
    pair_slot[order] = slot
    block_start = torch.arange(num_blocks, device=device) * BLOCK_M
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # first run ending after it
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return RoutePlan(token_rows, slot_rows, pair_slot, block_expert)


def grouped_w4a16_gemm(
    a: torch.Tensor,
    a_rows: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    block_expert: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """`out[slot] = a[a_rows[slot]] @ W_{expert(slot)}^T` -> `[num_slots, N]` (a's dtype).

    `a [rows, K]`, `packed [E, N, K / 8]` int32, `scale [E, N, K / group_size]`; padding slots
    (row -1) come out as zeros, unused blocks are left unwritten.
    """
    a = a.contiguous()
    n = packed.shape[1]
    k = a.shape[1]
    out = torch.zeros(a_rows.shape[0], n, dtype=a.dtype, device=a.device)
    grid = (block_expert.shape[0], triton.cdiv(n, BLOCK_N))
    _w4a16_grouped_gemm_kernel[grid](
        a,
        a_rows,
        packed,
        scale,
        out,
        block_expert,
        a.stride(0),
        packed.stride(0),
        packed.stride(1),
        scale.stride(0),
        scale.stride(1),
        out.stride(0),
        N=n,
        K=k,
        GROUP_SIZE=group_size,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )
    return out


def routed_experts_triton(
    x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, experts: Int4Experts
) -> torch.Tensor:
    """`routed_experts_reference` as two grouped W4A16 GEMMs: `x [N, H]`, `weights/expert_ids [N, k]`."""
    num_tokens, top_k = expert_ids.shape
    plan = plan_routes(expert_ids, experts.num_experts)
    group = experts.group_size
    gate_up = grouped_w4a16_gemm(
        x, plan.token_rows, experts.gate_up_packed, experts.gate_up_scale, plan.block_expert, group
    )  # [slots, 2I]
    gate, up = gate_up.split(experts.intermediate_size, dim=-1)
    hidden = F.silu(gate) * up  # [slots, I]; padding slots stay zero
    down = grouped_w4a16_gemm(
        hidden, plan.slot_rows, experts.down_packed, experts.down_scale, plan.block_expert, group
    )  # [slots, H]
    per_choice = down[plan.pair_slot].view(num_tokens, top_k, -1)  # [N, k, H]
    return (per_choice.float() * weights[..., None]).sum(dim=1).to(x.dtype)
