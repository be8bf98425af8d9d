"""Every backend that runs here takes the exact accept indices and bonus of the boundary cases."""

import pytest
import torch

from ddtree_serve.verify import backend_available, verify_sampling
from tests.verify.boundary_cases import CASES, BoundaryCase, boundary_inputs

CUDA = torch.cuda.is_available()

BACKENDS = [
    pytest.param("torch", "cpu", id="torch-cpu"),
    pytest.param("torch", "cuda", id="torch-cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA")),
    pytest.param(
        "triton",
        "cuda",
        id="triton",
        marks=pytest.mark.skipif(not (CUDA and backend_available("triton")), reason="needs CUDA and triton"),
    ),
    pytest.param(
        "sgl_kernel",
        "cuda",
        id="sgl_kernel",
        marks=pytest.mark.skipif(
            not (CUDA and backend_available("sgl_kernel")), reason="needs CUDA and sgl_kernel"
        ),
    ),
]


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_boundary_case(case: BoundaryCase, backend: str, device: str) -> None:
    batch, probs, coins, coin_final = boundary_inputs([case], device)
    result = verify_sampling(
        batch, probs, coins, coin_final, case.threshold_single, case.threshold_acc, backend=backend
    )
    assert result.accept_index[0].tolist() == case.accept_index
    assert int(result.accept_len[0]) == sum(i >= 0 for i in case.accept_index) - 1
    assert int(result.bonus_token[0]) == case.bonus_token


@pytest.mark.parametrize(("backend", "device"), BACKENDS)
def test_boundary_cases_batched_per_threshold(backend: str, device: str) -> None:
    """The cases that share thresholds, walked as one batch, decide as they do alone."""
    by_thresholds: dict[tuple[float, float], list[BoundaryCase]] = {}
    for case in CASES:
        by_thresholds.setdefault((case.threshold_single, case.threshold_acc), []).append(case)
    assert len(by_thresholds[(1.0, 1.0)]) > 1
    for (threshold_single, threshold_acc), cases in by_thresholds.items():
        inputs = boundary_inputs(cases, device)
        result = verify_sampling(*inputs, threshold_single, threshold_acc, backend=backend)
        assert result.accept_index.tolist() == [case.accept_index for case in cases]
        assert result.bonus_token.tolist() == [case.bonus_token for case in cases]
