"""The sgl_kernel adapter's call convention, on CPU, against stand-ins for the kernels in the field.

sgl-kernel releases differ in their signature: older ones take a `draft_probs` buffer between
`target_probs` and the thresholds, newer ones do not. They also differ in their rule: before
SGLang's fix for issue #35771 the kernel accepted when `coin <= acc / threshold_acc` (no `q > 0`
guard; the oldest launchers did not clamp `threshold_acc` either), after it when
`q > 0 and coin < acc / max(threshold_acc, 1e-9)`. The stand-ins bind their arguments as Python
would and walk like the kernel (flat row indices out, int32 outputs, float32 arithmetic), so the
adapter's probe of the rule, its inputs for the old rule and its conversion back to local indices
are checked against the reference walk.
"""

import importlib
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from ddtree_serve.verify.backends import torch_walk
from tests.verify.boundary_cases import CASES, boundary_inputs
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


def _kernel_walk(args: dict[str, Any], half_open: bool) -> None:
    """What the kernel decides: flat rows b * N + i in `accept_index`, counts in `accept_token_num`.

    `half_open`: the rule after SGLang #35771; otherwise the oldest one (`<=`, no guard, no clamp).
    """
    accept_index, tokens, rows = args["accept_index"], args["candidates"], args["retrive_index"]
    first_child, next_sibling = args["retrive_next_token"], args["retrive_next_sibling"]
    coins, probs = args["uniform_samples"], args["target_probs"]
    for name in ("predicts", "accept_index", "accept_token_num"):
        assert args[name].dtype == torch.int32, name
    for name in ("candidates", "retrive_index", "retrive_next_token", "retrive_next_sibling"):
        assert args[name].dtype == torch.int64 and args[name].dim() == 2, name
    assert isinstance(args["threshold_single"], float) and isinstance(args["threshold_acc"], float)
    single = torch.tensor(args["threshold_single"])  # float32, as the kernel compares
    threshold_acc = max(args["threshold_acc"], 1e-9) if half_open else args["threshold_acc"]
    acc_limit = torch.tensor(threshold_acc)
    for b in range(tokens.shape[0]):
        current, accepted = 0, 0
        accept_index[b, 0] = rows[b, 0]
        for level in range(1, accept_index.shape[1]):
            coin, acc = coins[b, current], torch.tensor(0.0)
            child = int(first_child[b, current])
            while child != -1:
                q = probs[b, current, tokens[b, child]]
                acc = acc + q
                if half_open:
                    accept = q > 0 and (coin < acc / acc_limit or q >= single)
                else:
                    accept = coin <= acc / acc_limit or q >= single
                if accept:
                    break
                child = int(next_sibling[b, child])
            if child == -1:
                break
            current, accepted = child, accepted + 1
            accept_index[b, level] = rows[b, child]
        args["accept_token_num"][b] = accepted


def _fake_sgl_kernel(with_draft_probs: bool, half_open: bool) -> types.ModuleType:
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
        _kernel_walk(call.arguments, half_open)

    kernel.__signature__ = signature  # type: ignore[attr-defined]
    module = types.ModuleType("sgl_kernel")
    module.tree_speculative_sampling_target_only = kernel  # type: ignore[attr-defined]
    return module


KERNELS = [
    pytest.param(
        with_draft_probs, half_open, id=f"{'draft_probs' if with_draft_probs else 'target_only'}-{rule}"
    )
    for with_draft_probs in (True, False)
    for half_open, rule in ((True, "half_open"), (False, "inclusive"))
]


@pytest.fixture
def load_adapter(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[bool, bool], types.ModuleType]]:
    """Import a fresh adapter over a stand-in kernel (so its probe and signature check rerun)."""

    def load(with_draft_probs: bool, half_open: bool) -> types.ModuleType:
        monkeypatch.setitem(sys.modules, "sgl_kernel", _fake_sgl_kernel(with_draft_probs, half_open))
        monkeypatch.delitem(sys.modules, "ddtree_serve.verify.sgl_backend", raising=False)
        return importlib.import_module("ddtree_serve.verify.sgl_backend")

    yield load
    # Not through monkeypatch: its undo would put the stand-in's adapter back.
    sys.modules.pop("ddtree_serve.verify.sgl_backend", None)


@pytest.mark.parametrize(("with_draft_probs", "half_open"), KERNELS)
def test_adapter_calls_either_kernel_and_matches_the_reference(
    load_adapter: Callable[[bool, bool], types.ModuleType], with_draft_probs: bool, half_open: bool
) -> None:
    adapter = load_adapter(with_draft_probs, half_open)
    assert adapter._kernel_is_half_open(torch.device("cpu")) is half_open
    generator = torch.Generator().manual_seed(4)
    batch, probs, coins, _ = random_case(random_trees(generator, 16), generator)
    for thresholds in ((1.0, 1.0), (0.4, 0.7), (0.0, 0.0)):
        accept_index, accept_len = adapter.sgl_kernel_walk(batch, probs, coins, *thresholds)
        expected_index, expected_len = torch_walk(batch, probs, coins, *thresholds)
        assert torch.equal(accept_index, expected_index)
        assert torch.equal(accept_len, expected_len)


@pytest.mark.parametrize(("with_draft_probs", "half_open"), KERNELS)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_adapter_takes_the_rule_on_boundary_cases_from_either_kernel(
    load_adapter: Callable[[bool, bool], types.ModuleType], case, with_draft_probs: bool, half_open: bool
) -> None:
    adapter = load_adapter(with_draft_probs, half_open)
    batch, probs, coins, _ = boundary_inputs([case])
    thresholds = (case.threshold_single, case.threshold_acc)
    accept_index, accept_len = adapter.sgl_kernel_walk(batch, probs, coins, *thresholds)
    assert accept_index[0].tolist() == case.accept_index
    assert int(accept_len[0]) == sum(i >= 0 for i in case.accept_index) - 1
    # The kernel itself, given the coins and thresholds as they are, decides by its own rule.
    raw_index, _ = adapter._run_kernel(
        tokens=batch.tokens,
        retrieve_index=batch.retrieve_index,
        next_token=batch.retrieve_next_token,
        next_sibling=batch.retrieve_next_sibling,
        coins=coins,
        target_probs=probs,
        threshold_single=case.threshold_single,
        threshold_acc=case.threshold_acc,
        max_depth=batch.max_depth,
    )
    assert raw_index[0].tolist() == (case.accept_index if half_open else case.inclusive_accept_index)
