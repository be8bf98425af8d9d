"""Values with torch tensors inside, as one host byte buffer while they cross actor boundaries.

Ray serializes numpy arrays out of band but torch tensors through a slow generic path (one
actor call with eight small int64 tensors: ~9 ms against ~1.3 ms as numpy arrays on the CI
CPU), and each out-of-band array still costs its own share of every hop: on the CI CPU one
compiled-graph round trip carrying 12 small arrays took 0.98 ms against 0.36 ms for the same
bytes as one array (`bench/channel_cost.py`). A step sends a `VerifyBatch` (eight tensors),
sampling tensors and coins, and gets tensors back, so the worker adapters wrap each argument
and result with `to_wire`: every tensor inside it (walking lists, tuples and dataclasses) is
copied into one byte buffer and replaced by where it lies there; `from_wire` makes the tensors
again as views of that buffer.
"""

import copy as copying
import dataclasses
import functools
import math
import pickle
from typing import Any

import numpy as np
import ray
import torch

# Values with nothing inside to convert: returned at once, without walking them.
_ATOMS = (int, float, bool, str, type(None))
# Each tensor starts at a multiple of this many bytes, so a view of any dtype (complex128: 16
# bytes) can start there.
_ALIGN = 16


@dataclasses.dataclass(frozen=True)
class WireTensor:
    """Where one tensor lies in its `Wired` value's buffer."""

    offset: int  # bytes, a multiple of _ALIGN
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class Wired:
    """A value whose tensors were replaced by `WireTensor`s, and the one buffer holding them.

    The structure travels pickled by the standard library: Ray's serializer calls back into
    Python for every object it pickles, so a payload of many small dataclasses costs it far
    more than one bytes object."""

    structure: bytes  # the pickled value, each tensor a `WireTensor`
    buffer: np.ndarray  # uint8

    @property
    def value(self) -> Any:
        """The value with its `WireTensor` placeholders (no tensors)."""
        return pickle.loads(self.structure)


class _Packer:
    """Collects a value's tensors (on the host), each with its offset and size in the buffer."""

    def __init__(self) -> None:
        self.placed: list[tuple[torch.Tensor, int, int]] = []  # (tensor, offset, bytes)
        self.num_bytes = 0

    def replace(self, value: Any) -> Any:
        if type(value) in _ATOMS:
            return value
        if isinstance(value, ray.ObjectRef):
            # Pickled by the standard library it would travel without Ray's ownership bookkeeping.
            raise TypeError("an ObjectRef cannot travel inside a wired value: pass it as an argument")
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu()
            size = tensor.numel() * tensor.element_size()
            self.placed.append((tensor, self.num_bytes, size))
            placed = WireTensor(self.num_bytes, tuple(tensor.shape), tensor.dtype)
            self.num_bytes += -(-size // _ALIGN) * _ALIGN
            return placed
        return _map(value, self.replace)


def to_wire(value: Any) -> Any:
    """`value` as a `Wired` (its tensors moved to the host, into one buffer); a value without
    tensors as it is."""
    packer = _Packer()
    structure = packer.replace(value)
    if not packer.placed:
        return value
    buffer = torch.empty(packer.num_bytes, dtype=torch.uint8)
    for tensor, offset, size in packer.placed:
        if size:  # copied into a view of the buffer: any strides the source has
            buffer[offset : offset + size].view(tensor.dtype).copy_(tensor.reshape(-1))
    return Wired(pickle.dumps(structure, protocol=pickle.HIGHEST_PROTOCOL), buffer.numpy())


def from_wire(value: Any, copy: bool = False) -> Any:
    """Inverse of `to_wire`: the tensors again, views of the value's one buffer.

    `copy`: the tensors own their memory (values read from a compiled graph's channel are views
    of its buffer, which the writer waits on while they live). A read-only buffer (Ray's object
    store) is copied too: torch tensors must own writable memory."""
    if type(value) in _ATOMS:
        return value
    if not isinstance(value, Wired):
        return _map(value, lambda item: from_wire(item, copy))
    array = value.buffer.copy() if copy or not value.buffer.flags.writeable else value.buffer
    buffer = torch.from_numpy(array)

    def tensor_of(item: Any) -> Any:
        if type(item) in _ATOMS:
            return item
        if isinstance(item, WireTensor):
            size = _element_size(item.dtype) * math.prod(item.shape)  # np.prod: 30% of a from_wire
            if size == 0:  # an empty slice cannot be viewed as a wider dtype
                return torch.empty(item.shape, dtype=item.dtype)
            return buffer[item.offset : item.offset + size].view(item.dtype).reshape(item.shape)
        return _map(item, tensor_of)

    return tensor_of(value.value)


@dataclasses.dataclass(frozen=True)
class PackedFeatures:
    """A call's per-request context features as one host tensor: how a context crosses actors.

    One device -> host copy for the whole batch (not one synchronizing copy per request), one
    array on the wire, and one host -> device copy on the drafter's side: at batch 64 the
    per-request copies were most of what a served step's extra time grew with."""

    joined: torch.Tensor  # [sum of n_i, F] on the host
    lengths: tuple[int, ...]  # n_i: request i's rows

    def unpack(self) -> list[torch.Tensor]:
        """Request i's features `[n_i, F]`, views of `joined`."""
        return list(self.joined.split(self.lengths))


def pack_features(features: Any) -> PackedFeatures:
    """`features` (a sequence of `[n_i, F]` tensors, on one device) joined and moved to the host."""
    tensors = list(features)
    if not tensors:
        return PackedFeatures(torch.empty(0, 0), ())
    return PackedFeatures(torch.cat(tensors).cpu(), tuple(int(t.shape[0]) for t in tensors))


def _map(value: Any, convert: Any) -> Any:
    """`convert` applied inside lists, tuples and dataclasses; a part with nothing to convert is
    returned as it is, not rebuilt (a batch-64 draft input's 64 context slices were 1.4 ms of
    copies on the CI CPU when every dataclass was copied)."""
    if isinstance(value, list | tuple):
        items = [convert(item) for item in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        return type(value)(items)
    if isinstance(value, dict):
        converted_items = {key: convert(item) for key, item in value.items()}
        if all(converted_items[key] is item for key, item in value.items()):
            return value
        return converted_items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {}
        for name in _field_names(type(value)):
            old = getattr(value, name)
            new = convert(old)
            if new is not old:
                changed[name] = new
        if not changed:
            return value
        # Frozen dataclasses: copy, then set each field (no __init__, so derived fields survive).
        converted = copying.copy(value)
        for name, new in changed.items():
            object.__setattr__(converted, name, new)
        return converted
    return value


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(cls))


@functools.cache
def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
