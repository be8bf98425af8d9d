"""Tensors survive the numpy transport inside nested dataclasses, lists and tuples."""

import dataclasses
import pickle

import numpy as np
import torch

from ddtree_serve.engine.interfaces import ContextSlice, SamplingBatch
from ddtree_serve.serve.wire import WireTensor, from_wire, pack_features, to_wire
from ddtree_serve.tree import build_chain, build_verify_batch


def test_verify_batch_sampling_and_bfloat16_features_round_trip() -> None:
    batch = build_verify_batch([build_chain(np.array([3, 4, 5]), 7), build_chain(np.array([9]), 2)])
    sampling = SamplingBatch(
        temperature=torch.tensor([0.0, 0.7]),
        top_k=torch.tensor([0, 5]),
        top_p=torch.tensor([1.0, 0.9]),
        all_greedy=False,
    )
    features = [torch.randn(2, 6, dtype=torch.bfloat16), torch.randn(1, 6, dtype=torch.bfloat16)]
    payload = (batch, sampling, features, ContextSlice("not-a-tensor", 1), None, 3)

    wired = to_wire(payload)
    assert not any(isinstance(v, torch.Tensor) for v in dataclasses.asdict(wired[0]).values())
    assert isinstance(wired[2][0], WireTensor)
    restored = from_wire(wired)

    for field in dataclasses.fields(batch):
        before, after = getattr(batch, field.name), getattr(restored[0], field.name)
        assert torch.equal(before, after) if isinstance(before, torch.Tensor) else before == after
    assert restored[0].batch_size == 2 and restored[0].attn_mask.dtype == torch.bool
    assert torch.equal(restored[1].top_k, sampling.top_k) and restored[1].all_greedy is False
    assert all(
        torch.equal(a, b) and b.dtype == torch.bfloat16 for a, b in zip(features, restored[2], strict=True)
    )
    assert restored[3:] == (ContextSlice("not-a-tensor", 1), None, 3)


def test_read_only_arrays_from_the_object_store_become_writable_tensors() -> None:
    array = np.arange(4, dtype=np.int64)
    array.flags.writeable = False
    tensor = from_wire(WireTensor(array, torch.int64))
    tensor += 1  # would fail on memory shared with a read-only buffer
    assert tensor.tolist() == [1, 2, 3, 4] and array.tolist() == [0, 1, 2, 3]


def test_packed_features_cross_as_one_array_and_unpack_to_each_requests_rows() -> None:
    features = [torch.randn(n, 6, dtype=torch.bfloat16) for n in (3, 1, 5)]
    wired = to_wire(pack_features(features))
    assert isinstance(wired.joined, WireTensor) and wired.joined.array.shape == (9, 6)
    restored = from_wire(pickle.loads(pickle.dumps(wired, protocol=5)), copy=True).unpack()
    assert [r.shape[0] for r in restored] == [3, 1, 5]
    for before, after in zip(features, restored, strict=True):
        assert torch.equal(before, after) and after.dtype == torch.bfloat16
    assert from_wire(to_wire(pack_features([]))).unpack() == []
