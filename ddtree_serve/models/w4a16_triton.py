"""W4A16 routed experts on CUDA: a Triton grouped GEMM that dequantizes packed INT4 tiles in-kernel.

Same signature and result as `int4_experts.routed_experts_reference` (the spec). The steps:
  1. `plan_routes`: sort the (token, choice) pairs by expert and give each expert a run of slots
     padded to `block_m`, so every M-block of slots belongs to one expert. `block_m` comes from
     the shapes alone (`block_m_for`: the mean pairs per expert), as does the slot count
     (`ceil(P / block_m) + min(E, P)` blocks for P pairs), so no step reads a data-dependent size
     back to the host (CUDA-graph friendly); unused blocks carry expert -1 and exit at once.
  2. gate/up GEMM over the slots (rows gathered from the tokens), SwiGLU, down GEMM.
  3. each token sums its k slot outputs, weighted by the router.

Weight traffic, which is the cost of a memory-bound MoE step: an expert's run of slots fits one
M-block whenever it holds at most `block_m` pairs, and then each weight tile of that expert is
read once per call. Programs are numbered M-block first, so the M-blocks of a hot expert's run
are neighbours in launch order, run together and share its weight tiles through L2.

Inside a program, each step over K reads `BLOCK_K / 8` int32 words per output column, contiguous
in memory (the checkpoint's `[N, K / 8]` layout), once. Nibble j of word w is column `8 w + j`,
so the step is eight small dots: for each j, the activation columns `8 w + j` against the
nibble-j values times their group scales, dequantized to the activation dtype in registers: the
bf16 weight matrix never exists in memory. The activations are handed over in nibble-major order
(`nibble_major`: within each K step, column `16 j + w` holds column `8 w + j`), so the
activation tile of each small dot is a contiguous load.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ddtree_serve.models.int4_experts import Int4Experts
from ddtree_serve.models.quantization import INT4_PER_WORD

BLOCK_M_CHOICES = (16, 32, 64)  # slots per program; 16 is tl.dot's minimum
BLOCK_K = 128  # 16 words per output column per step (tl.dot's minimum inner size per nibble)


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of one grouped GEMM for a given `block_m`."""

    block_n: int
    num_warps: int
    num_stages: int


# small M (decode, small trees): memory-bound, narrow N tiles for many programs in flight;
# large M: wider N tiles for tensor-core work per weight byte
# (the best of a small sweep on the H200 at K2.6 widths, bench/kimi_slice.py's token counts)
TILE_CONFIGS = {
    16: TileConfig(block_n=128, num_warps=4, num_stages=4),
    32: TileConfig(block_n=128, num_warps=4, num_stages=3),
    64: TileConfig(block_n=128, num_warps=4, num_stages=3),
}


@triton.jit
def _w4a16_grouped_gemm_kernel(
    a_ptr,  # [rows, >= K] activations, nibble-major (`nibble_major`)
    a_row_ptr,  # [num_slots] int32: the activation row each slot reads, -1 = padding
    packed_ptr,  # [E, N, K / 8] int32
    scale_ptr,  # [E, N, K / GROUP_SIZE]
    out_ptr,  # [num_slots, N]
    block_expert_ptr,  # [num_blocks] int32: the expert of each BLOCK_M slots, -1 = unused
    num_blocks,
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
    pid = tl.program_id(0)
    pid_m = pid % num_blocks  # M-blocks first: a hot expert's blocks run side by side
    pid_n = pid // num_blocks
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    WORDS: tl.constexpr = BLOCK_K // 8
    EVEN_K: tl.constexpr = K % BLOCK_K == 0
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    a_rows = tl.load(a_row_ptr + slots).to(tl.int64)
    row_ok = a_rows >= 0
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    words = tl.arange(0, WORDS)  # [W]: word w of a step holds columns 8 w .. 8 w + 7
    a_base = a_ptr + a_rows[:, None] * stride_am + words[None, :]  # [BLOCK_M, W]
    word_base = packed_ptr + expert * stride_pe + cols[:, None].to(tl.int64) * stride_pn + words[None, :]
    scale_base = scale_ptr + expert * stride_se + cols[:, None].to(tl.int64) * stride_sn
    scale_base += (words * 8 // GROUP_SIZE)[None, :]  # [BLOCK_N, W]: the group of each word
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:  # noqa: SIM108 (a constexpr branch: no mask along K when K is whole steps)
            w_mask = col_ok[:, None]
        else:  # the activations' padding is zero; the weights' would be out of bounds
            w_mask = col_ok[:, None] & (k0 + words * 8 < K)[None, :]
        packed = tl.load(word_base + k0 // 8, mask=w_mask, other=0)  # [BLOCK_N, W] int32
        scales = tl.load(scale_base + k0 // GROUP_SIZE, mask=w_mask, other=0.0).to(tl.float32)
        for j in tl.static_range(8):
            # [BLOCK_M, W]: the activation columns 8 w + j, contiguous in nibble-major order
            a = tl.load(a_base + (k0 + j * WORDS), mask=row_ok[:, None], other=0.0)
            nibbles = (packed >> (4 * j)) & 0xF  # the mask drops the sign extension
            w = ((nibbles - 8).to(tl.float32) * scales).to(a.dtype)  # [BLOCK_N, W]
            acc += tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
    tl.store(
        out_ptr + slots[:, None].to(tl.int64) * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=col_ok[None, :],
    )


@dataclass(frozen=True)
class RoutePlan:
    """Slots of the (token, choice) pairs, grouped by expert in runs padded to `block_m`."""

    block_m: int
    token_rows: torch.Tensor  # [num_slots] int32: the token a slot reads, -1 = padding
    slot_rows: torch.Tensor  # [num_slots] int32: the slot itself, -1 = padding
    pair_slot: torch.Tensor  # [P] int64: the slot of pair p = token * k + choice
    block_expert: torch.Tensor  # [num_blocks] int32: expert of each block, -1 = unused


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Slots per M-block: the smallest choice that holds an expert's mean share of the pairs.

    Decode and small trees (a few pairs per expert) get 16, the least padding a dot allows; a
    batch of large trees gets blocks wide enough that a typical expert's run is one block, so
    its weights are read once. Shapes only: the same call always picks the same size.
    """
    mean_pairs = triton.cdiv(num_pairs, num_experts)
    return next((b for b in BLOCK_M_CHOICES if b >= mean_pairs), BLOCK_M_CHOICES[-1])


def plan_routes(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> RoutePlan:
    """`expert_ids [N, k]` -> the slot plan; device ops only, sizes from the shapes alone."""
    device = expert_ids.device
    top_k = expert_ids.shape[1]
    pairs = expert_ids.flatten()  # [P]
    num_pairs = pairs.numel()
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    num_slots = num_blocks * block_m
    order = pairs.argsort(stable=True)  # [P] pair indices, by expert
    sorted_experts = pairs[order]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, pairs, torch.ones_like(pairs))
    padded = (counts + block_m - 1) // block_m * block_m
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
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # first run ending after it
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return RoutePlan(block_m, token_rows, slot_rows, pair_slot, block_expert)


def nibble_major(a: torch.Tensor) -> torch.Tensor:
    """`a [rows, K]` -> `[rows, K padded to BLOCK_K]`: within each K step, column `16 j + w` is `8 w + j`.

    One copy of the activations (zero padding past K), so the kernel's eight dots per step each
    read a contiguous activation tile.
    """
    rows, k = a.shape
    padded = triton.cdiv(k, BLOCK_K) * BLOCK_K
    words = BLOCK_K // INT4_PER_WORD
    if padded != k:
        a = F.pad(a, (0, padded - k))
    return a.reshape(rows, padded // BLOCK_K, words, INT4_PER_WORD).transpose(2, 3).reshape(rows, padded)


def grouped_w4a16_gemm(
    a: torch.Tensor,
    a_rows: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    block_expert: torch.Tensor,
    group_size: int,
    block_m: int,
) -> torch.Tensor:
    """`out[slot] = a[a_rows[slot]] @ W_{expert(slot)}^T` -> `[num_slots, N]` (a's dtype).

    `a [rows, K]`, `packed [E, N, K / 8]` int32, `scale [E, N, K / group_size]`; padding slots
    (row -1) come out as zeros; slots of unused blocks are left unwritten (no pair maps to them,
    so nothing reads them).
    """
    n = packed.shape[1]
    k = a.shape[1]
    if packed.shape[2] * INT4_PER_WORD != k or BLOCK_K % group_size:
        raise ValueError(f"W4A16 GEMM: activations of width {k} against packed words {tuple(packed.shape)}")
    tile = TILE_CONFIGS[block_m]
    num_blocks = block_expert.shape[0]
    out = torch.empty(a_rows.shape[0], n, dtype=a.dtype, device=a.device)
    grid = (num_blocks * triton.cdiv(n, tile.block_n),)
    a = nibble_major(a)
    _w4a16_grouped_gemm_kernel[grid](
        a,
        a_rows,
        packed,
        scale,
        out,
        block_expert,
        num_blocks,
        a.stride(0),
        packed.stride(0),
        packed.stride(1),
        scale.stride(0),
        scale.stride(1),
        out.stride(0),
        N=n,
        K=k,
        GROUP_SIZE=group_size,
        BLOCK_M=block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out


def routed_experts_triton(
    x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, experts: Int4Experts
) -> torch.Tensor:
    """`routed_experts_reference` as two grouped W4A16 GEMMs: `x [N, H]`, `weights/expert_ids [N, k]`."""
    num_tokens, top_k = expert_ids.shape
    block_m = block_m_for(expert_ids.numel(), experts.num_experts)
    plan = plan_routes(expert_ids, experts.num_experts, block_m)
    group = experts.group_size
    gate_up = grouped_w4a16_gemm(
        x, plan.token_rows, experts.gate_up_packed, experts.gate_up_scale, plan.block_expert, group, block_m
    )  # [slots, 2I]
    gate, up = gate_up.split(experts.intermediate_size, dim=-1)
    hidden = F.silu(gate) * up  # [slots, I]; padding slots stay zero
    down = grouped_w4a16_gemm(
        hidden, plan.slot_rows, experts.down_packed, experts.down_scale, plan.block_expert, group, block_m
    )  # [slots, H]
    per_choice = down[plan.pair_slot].view(num_tokens, top_k, -1)  # [N, k, H]
    return (per_choice.float() * weights[..., None]).sum(dim=1).to(x.dtype)
