"""The W4A16 Triton grouped GEMM against its PyTorch reference at every shape the Kimi slice uses.

CUDA only (skipped on CPU): K2.6's expert widths (hidden 7168, expert 2048, 384 experts, top-8)
with the token counts of bench/kimi_slice.py (tree tokens x batch), bf16 activations, random
INT4 words and scales. The reference dequantizes each touched expert then matmuls; the kernel
dequantizes inside the GEMM, so the two differ only by bf16 rounding and summation order.
"""

import pytest
import torch

from bench.kimi_slice import SLICE_BATCHES, SLICE_TREE_TOKENS, k26_slice_config
from ddtree_serve.models.int4_experts import Int4Experts, routed_experts_backend, routed_experts_reference
from ddtree_serve.models.quantization import PackedInt4Scheme

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the W4A16 Triton kernel needs CUDA"),
]
SLICE_NUM_TOKENS = sorted({n * b for n in SLICE_TREE_TOKENS for b in SLICE_BATCHES})
MAX_RELATIVE_ERROR = 2e-2


@pytest.fixture(scope="module")
def k26_experts() -> Int4Experts:
    config = k26_slice_config()
    with torch.device("cuda"):
        experts = Int4Experts(
            config["n_routed_experts"],
            config["hidden_size"],
            config["moe_intermediate_size"],
            PackedInt4Scheme(),
        )
    torch.manual_seed(0)
    for packed in (experts.gate_up_packed, experts.down_packed):
        packed.view(torch.uint8).random_(0, 256)
    for scale in (experts.gate_up_scale, experts.down_scale):
        scale.uniform_(0.5, 1.5).mul_(0.25 * (scale.shape[-1] * experts.group_size) ** -0.5)
    return experts.to(torch.bfloat16)


def test_cuda_picks_the_triton_kernel() -> None:
    assert routed_experts_backend("cuda").__name__ == "routed_experts_triton"
    assert routed_experts_backend("cpu") is routed_experts_reference


@pytest.mark.parametrize("num_tokens", SLICE_NUM_TOKENS)
def test_triton_matches_reference_at_slice_shapes(k26_experts: Int4Experts, num_tokens: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, k26_experts.hidden_size, device="cuda", generator=generator).to(
        torch.bfloat16
    )
    scores = torch.rand(num_tokens, k26_experts.num_experts, device="cuda", generator=generator)
    weights, expert_ids = scores.topk(8, dim=-1)
    expected = routed_experts_reference(x, weights, expert_ids, k26_experts).float()
    got = routed_experts_backend("cuda")(x, weights, expert_ids, k26_experts).float()
    relative = (got - expected).norm() / expected.norm()
    assert relative < MAX_RELATIVE_ERROR, (num_tokens, float(relative))
