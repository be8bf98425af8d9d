"""Verification: target probabilities, greedy and lossless sampling walks of draft trees."""

from ddtree_serve.verify.backends import (
    backend_available,
    backend_names,
    get_backend,
    get_greedy_backend,
    greedy_backend_names,
)
from ddtree_serve.verify.greedy import verify_greedy
from ddtree_serve.verify.probs import target_probs
from ddtree_serve.verify.result import VerifyResult
from ddtree_serve.verify.sampling import verify_sampling

__all__ = [
    "VerifyResult",
    "backend_available",
    "backend_names",
    "get_backend",
    "get_greedy_backend",
    "greedy_backend_names",
    "target_probs",
    "verify_greedy",
    "verify_sampling",
]
