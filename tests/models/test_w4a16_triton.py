"""The W4A16 Triton grouped GEMM against its PyTorch reference, and the slot plan it runs on.

On CUDA: K2.6's expert widths (hidden 7168, expert 2048, 384 experts, top-8) with the token counts
of bench/kimi_slice.py (tree tokens x batch), bf16 activations, random INT4 words and scales, with
spread routing and with every token on the same 8 experts (hot experts: runs of many M-blocks).
The reference dequantizes each touched expert then matmuls; the kernel dequantizes inside the
GEMM, so the two differ only by bf16 rounding and summation order.

Without CUDA, `TRITON_INTERPRET=1 python -m pytest tests/models/test_w4a16_triton.py` runs the
kernel in Triton's interpreter on small shapes (every block size, a K that is not a multiple of
the K step); the slot-plan tests need only Triton installed.
"""

import os

import pytest
import torch

from bench.kimi_slice import SLICE_BATCHES, SLICE_TREE_TOKENS, k26_slice_config
from ddtree_serve.models.int4_experts import Int4Experts, routed_experts_backend, routed_experts_reference
from ddtree_serve.models.quantization import PackedInt4Scheme

pytest.importorskip("triton")
from ddtree_serve.models.w4a16_triton import (
    BLOCK_M_CHOICES,
    block_m_for,
    plan_routes,
    routed_experts_triton,
)

SLICE_NUM_TOKENS = sorted({n * b for n in SLICE_TREE_TOKENS for b in SLICE_BATCHES})
MAX_RELATIVE_ERROR = 2e-2
KERNEL_DEVICE = (
    "cuda" if torch.cuda.is_available() else "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the K2.6 shapes need CUDA")
needs_kernel = pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")


def random_experts(num_experts: int, hidden: int, inter: int, device: str, dtype: torch.dtype) -> Int4Experts:
    with torch.device(device):
        experts = Int4Experts(num_experts, hidden, inter, PackedInt4Scheme())
    generator = torch.Generator(device=device).manual_seed(0)
    for packed in (experts.gate_up_packed, experts.down_packed):
        packed.view(torch.uint8).random_(0, 256, generator=generator)
    for scale in (experts.gate_up_scale, experts.down_scale):
        scale.uniform_(0.5, 1.5, generator=generator).mul_(
            0.25 * (scale.shape[-1] * experts.group_size) ** -0.5
        )
    return experts.to(dtype)


def relative_error(
    x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, experts: Int4Experts
) -> float:
    expected = routed_experts_reference(x, weights, expert_ids, experts).float()
    got = routed_experts_triton(x, weights, expert_ids, experts).float()
    return float((got - expected).norm() / expected.norm())


@pytest.fixture(scope="module")
def k26_experts() -> Int4Experts:
    config = k26_slice_config()
    sizes = (config["n_routed_experts"], config["hidden_size"], config["moe_intermediate_size"])
    return random_experts(*sizes, "cuda", torch.bfloat16)


def test_block_m_covers_the_mean_pairs_per_expert() -> None:
    assert block_m_for(8, 384) == BLOCK_M_CHOICES[0]  # decode: one pair per expert
    assert block_m_for(16 * 64 * 8, 384) == 32  # 21.3 pairs per expert
    assert block_m_for(16 * 128 * 8, 384) == 64  # 42.7
    assert block_m_for(10**6, 384) == BLOCK_M_CHOICES[-1]


@pytest.mark.parametrize(("num_tokens", "num_experts", "block_m"), [(1, 16, 16), (37, 6, 16), (200, 4, 64)])
def test_plan_groups_each_expert_into_whole_blocks(num_tokens: int, num_experts: int, block_m: int) -> None:
    generator = torch.Generator().manual_seed(num_tokens)
    expert_ids = torch.rand(num_tokens, num_experts, generator=generator).topk(3, dim=-1).indices
    expert_ids[: num_tokens // 2, 0] = 0  # a hot expert: its run spans several blocks
    plan = plan_routes(expert_ids, num_experts, block_m)
    pairs = expert_ids.flatten()
    block_of_pair = plan.pair_slot // block_m
    assert torch.equal(plan.block_expert[block_of_pair].long(), pairs)  # each pair in its expert's block
    assert torch.equal(plan.token_rows[plan.pair_slot].long(), torch.arange(pairs.numel()) // 3)
    assert plan.pair_slot.unique().numel() == pairs.numel()  # one slot per pair
    used = plan.block_expert[plan.block_expert >= 0]
    counts = torch.bincount(pairs, minlength=num_experts)
    assert torch.equal(torch.bincount(used.long(), minlength=num_experts), (counts + block_m - 1) // block_m)
    assert torch.equal(used, used.sort().values)  # runs in expert order, one run per expert
    real = torch.zeros_like(plan.token_rows, dtype=torch.bool)
    real[plan.pair_slot] = True
    assert (plan.token_rows[~real] == -1).all() and (plan.slot_rows[~real] == -1).all()


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize(
    ("num_tokens", "hidden", "inter"),
    [(3, 256, 64), (100, 256, 64), (300, 128, 256)],  # block_m 16, 32, 64; K = 64 is a partial step
)
def test_kernel_matches_reference_on_small_shapes(num_tokens: int, hidden: int, inter: int) -> None:
    dtype = torch.float32 if KERNEL_DEVICE == "cpu" else torch.bfloat16
    experts = random_experts(8, hidden, inter, KERNEL_DEVICE, dtype)
    generator = torch.Generator(device=KERNEL_DEVICE).manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, device=KERNEL_DEVICE, generator=generator).to(dtype)
    scores = torch.rand(num_tokens, 8, device=KERNEL_DEVICE, generator=generator)
    weights, expert_ids = scores.topk(2, dim=-1)
    tolerance = 1e-5 if dtype == torch.float32 else MAX_RELATIVE_ERROR
    assert relative_error(x, weights, expert_ids, experts) < tolerance


@pytest.mark.gpu
@needs_cuda
def test_cuda_picks_the_triton_kernel() -> None:
    assert routed_experts_backend("cuda") is routed_experts_triton
    assert routed_experts_backend("cpu") is routed_experts_reference


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("routing", ["spread", "hot"])
@pytest.mark.parametrize("num_tokens", SLICE_NUM_TOKENS)
def test_triton_matches_reference_at_slice_shapes(
    k26_experts: Int4Experts, num_tokens: int, routing: str
) -> None:
    generator = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, k26_experts.hidden_size, device="cuda", generator=generator).to(
        torch.bfloat16
    )
    scores = torch.rand(num_tokens, k26_experts.num_experts, device="cuda", generator=generator)
    if routing == "hot":  # every token on experts 0..7, as an unfilled router routes
        scores[:, :8] += 1.0
    weights, expert_ids = scores.topk(8, dim=-1)
    relative = relative_error(x, weights, expert_ids, k26_experts)
    assert relative < MAX_RELATIVE_ERROR, (num_tokens, routing, relative)
