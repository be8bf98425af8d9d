"""The sgl_kernel adapter's call convention, on CPU, against stand-ins for both kernel signatures.

sgl-kernel releases differ: older ones take a `draft_probs` buffer between `target_probs` and the
thresholds, newer ones do not. The stand-ins bind their arguments as Python would and walk like
the kernel (flat row indices out, int32 outputs), so the adapter's conversion back to local
indices is checked against the reference walk.
"""

import importlib
import inspect
import sys
import types
from typing import Any

import pytest
import torch

from ddtree_serve.verify.backends import torch_walk
from tests.verify.test_backends import random_case, random_trees

_TENSOR_ARGS = (
    "predicts",
    "accept_index",
    "accept_token_num",
    "candidates",
    "retrive_index",
    "retrive_next_token",
    "retrive_next_sibling",
    "uniform_samples",
    "uniform_samples_for_final_sampling",
    "target_probs",
)


def _kernel_walk(args: dict[str, Any]) -> None:
    """What the kernel decides: flat rows b * N + i in `accept_index`, counts in `accept_token_num`."""
    accept_index, tokens, rows = args["accept_index"], args["candidates"], args["retrive_index"]
    first_child, next_sibling = args["retrive_next_token"], args["retrive_next_sibling"]
    coins, probs = args["uniform_samples"], args["target_probs"]
    for name in ("predicts", "accept_index", "accept_token_num"):
        assert args[name].dtype == torch.int32, name
    for name in ("candidates", "retrive_index", "retrive_next_token", "retrive_next_sibling"):
        assert args[name].dtype == torch.int64 and args[name].dim() == 2, name
    assert isinstance(args["threshold_single"], float) and isinstance(args["threshold_acc"], float)
    single = torch.tensor(args["threshold_single"])  # float32, as the kernel compares
    acc_limit = torch.tensor(args["threshold_acc"])
    for b in range(tokens.shape[0]):
        current, accepted = 0, 0
        accept_index[b, 0] = rows[b, 0]
        for level in range(1, accept_index.shape[1]):
            coin, acc = coins[b, current], torch.tensor(0.0)
            child = int(first_child[b, current])
            while child != -1:
                q = probs[b, current, tokens[b, child]]
                acc = acc + q
                if coin <= acc / acc_limit or q >= single:
                    break
                child = int(next_sibling[b, child])
            if child == -1:
                break
            current, accepted = child, accepted + 1
            accept_index[b, level] = rows[b, child]
        args["accept_token_num"][b] = accepted


def _fake_sgl_kernel(with_draft_probs: bool) -> types.ModuleType:
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    names = [*_TENSOR_ARGS, *(["draft_probs"] if with_draft_probs else [])]
    signature = inspect.Signature(
        [inspect.Parameter(name, kind) for name in names]
        + [
            inspect.Parameter("threshold_single", kind, default=1.0),
            inspect.Parameter("threshold_acc", kind, default=1.0),
            inspect.Parameter("deterministic", kind, default=True),
        ]
    )

    def kernel(*args: Any, **kwargs: Any) -> None:
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        if with_draft_probs:
            draft_probs = call.arguments["draft_probs"]
            assert isinstance(draft_probs, torch.Tensor), "draft_probs must be a tensor"
            assert draft_probs.shape == call.arguments["target_probs"].shape and not draft_probs.any()
        _kernel_walk(call.arguments)

    kernel.__signature__ = signature  # type: ignore[attr-defined]
    module = types.ModuleType("sgl_kernel")
    module.tree_speculative_sampling_target_only = kernel  # type: ignore[attr-defined]
    return module


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_adapter_calls_either_kernel_signature_and_matches_the_reference(
    monkeypatch: pytest.MonkeyPatch, with_draft_probs: bool
) -> None:
    monkeypatch.setitem(sys.modules, "sgl_kernel", _fake_sgl_kernel(with_draft_probs))
    monkeypatch.delitem(sys.modules, "ddtree_serve.verify.sgl_backend", raising=False)
    adapter = importlib.import_module("ddtree_serve.verify.sgl_backend")
    generator = torch.Generator().manual_seed(4)
    batch, probs, coins, _ = random_case(random_trees(generator, 16), generator)
    for thresholds in ((1.0, 1.0), (0.4, 0.7)):
        accept_index, accept_len = adapter.sgl_kernel_walk(batch, probs, coins, *thresholds)
        expected_index, expected_len = torch_walk(batch, probs, coins, *thresholds)
        assert torch.equal(accept_index, expected_index)
        assert torch.equal(accept_len, expected_len)
    monkeypatch.delitem(sys.modules, "ddtree_serve.verify.sgl_backend")
