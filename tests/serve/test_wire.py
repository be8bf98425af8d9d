"""Tensors survive the one-buffer transport inside nested dataclasses, lists and tuples."""

import dataclasses
import pickle

import numpy as np
import pytest
import ray
import torch

from ddtree_serve.engine.interfaces import ContextSlice, SamplingBatch
from ddtree_serve.serve.wire import Wired, WireTensor, from_wire, pack_features, to_wire
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
    assert isinstance(wired, Wired) and wired.buffer.dtype == np.uint8
    structure = wired.value
    assert not any(isinstance(v, torch.Tensor) for v in dataclasses.asdict(structure[0]).values())
    assert isinstance(structure[2][0], WireTensor)
    restored = from_wire(pickle.loads(pickle.dumps(wired, protocol=5)))

    for field in dataclasses.fields(batch):
        before, after = getattr(batch, field.name), getattr(restored[0], field.name)
        assert torch.equal(before, after) if isinstance(before, torch.Tensor) else before == after
    assert restored[0].batch_size == 2 and restored[0].attn_mask.dtype == torch.bool
    assert torch.equal(restored[1].top_k, sampling.top_k) and restored[1].all_greedy is False
    assert all(
        torch.equal(a, b) and b.dtype == torch.bfloat16 for a, b in zip(features, restored[2], strict=True)
    )
    assert restored[3:] == (ContextSlice("not-a-tensor", 1), None, 3)


def test_read_only_buffers_from_the_object_store_become_writable_tensors() -> None:
    wired = to_wire((torch.arange(4), torch.tensor([True, False, True])))
    wired.buffer.flags.writeable = False
    counts, mask = from_wire(wired)
    counts += 1  # would fail on memory shared with a read-only buffer
    assert counts.tolist() == [1, 2, 3, 4] and mask.tolist() == [True, False, True]
    assert from_wire(wired)[0].tolist() == [0, 1, 2, 3]


def test_tensors_of_every_dtype_and_shape_share_one_aligned_buffer() -> None:
    values = [
        torch.tensor(7),
        torch.zeros(0, 3),
        torch.tensor([1.5, -2.0], dtype=torch.float16),
        torch.arange(6, dtype=torch.int32).reshape(2, 3)[:, 1:],  # not contiguous
        torch.tensor([[True], [False], [True]]),
        torch.randn(3, 5, dtype=torch.float64),
    ]
    wired = to_wire(values)
    assert all(w.offset % 8 == 0 for w in wired.value)
    restored = from_wire(wired, copy=True)
    for before, after in zip(values, restored, strict=True):
        assert after.dtype == before.dtype and torch.equal(after, before)
    assert to_wire((1, "a", None)) == (1, "a", None)  # nothing to pack: the value as it is


def test_packed_features_cross_as_one_array_and_unpack_to_each_requests_rows() -> None:
    features = [torch.randn(n, 6, dtype=torch.bfloat16) for n in (3, 1, 5)]
    wired = to_wire(pack_features(features))
    assert wired.value.joined.shape == (9, 6) and wired.buffer.nbytes == 112  # 108, aligned
    restored = from_wire(pickle.loads(pickle.dumps(wired, protocol=5)), copy=True).unpack()
    assert [r.shape[0] for r in restored] == [3, 1, 5]
    for before, after in zip(features, restored, strict=True):
        assert torch.equal(before, after) and after.dtype == torch.bfloat16
    assert from_wire(to_wire(pack_features([]))).unpack() == []


def test_dicts_and_sixteen_byte_dtypes_after_odd_sizes_round_trip() -> None:
    value = {"mask": torch.tensor([True, False, True]), "z": torch.ones(2, dtype=torch.complex128)}
    restored = from_wire(to_wire(value))
    assert restored.keys() == value.keys()
    assert all(torch.equal(restored[key], value[key]) for key in value)


def test_an_object_ref_inside_a_wired_value_is_refused() -> None:
    with pytest.raises(TypeError, match="ObjectRef"):
        to_wire((torch.zeros(1), ray.ObjectRef(b"\x01" * 28)))
