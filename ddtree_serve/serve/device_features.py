"""Context features target -> drafter through GPU memory, when both actors share one GPU.

On the host path (`wire.pack_features`) a call's features are joined, copied to the host, and
cross through Ray (object store or a graph channel) to be copied back to the drafter's device.
When the drafter's and the target's models lie on the same physical GPU (fractional `num_gpus`,
as `bench/serve_load.py --device cuda` deploys them) the target instead joins them on its device
and sends a CUDA IPC handle to that tensor (`DeviceFeatures`, a few hundred bytes); the drafter
opens it, copies it into memory it owns and splits it. Features of actors on different GPUs
(an NCCL channel) are not built: they take the host path, as do CPU actors and a
tensor-parallel target.

Lifetime (torch's CUDA IPC reference counting, `torch/multiprocessing/reductions.py`): sharing a
block gives it a counter in shared host memory, set to 1; the consumer's opened tensor drops it
to 0 when it dies. A block the target no longer references but whose counter is above 0 waits in
torch's "limbo" list; `torch.cuda.ipc_collect()` frees the ones that reached 0, so the target
calls it before each delivery and its memory stays bounded by the deliveries not yet opened. A
handle that is never opened keeps its block until the target process ends: every handle must be
opened exactly once, and soon. The compiled graph does (`DrafterWorker.graph_take_context` runs
in the delivery's own execution); under actor calls the engine drafts from a context steps later,
or never (every request of the call ended), so `RayTarget` has the drafter take each call's
handle once the call's result is back (`DrafterWorker.take_features`) and the drafter keeps the
copies (`TakenFeatures`) until drafts or releases used them. A drafter that dies between a
delivery and its opening leaves that block behind, and under actor calls so does every call
the target answers while the drafter restarts (the engine still asks for the prefills'
context, and the take sent to a restarting actor fails): `placement.features: auto` therefore
sends handles under the compiled graph only, actor calls only under `device`.

Ordering: the target's `torch.cat` runs on its stream, and sharing records an event there that
the drafter's stream waits on before its copy; the drafter waits for its copy before it drops
the opened tensor, which lets the target reuse the block.
"""

import functools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from ddtree_serve.engine.interfaces import DrafterUnavailableError
from ddtree_serve.serve.wire import pack_features, to_wire

DEVICE_FEATURES_MIN_BYTES = 1 << 20
"""Features of one call below this size cross through host memory under `placement.features:
auto`: on the H200 the bundled pair's (a few KiB a step) took 0.34x the in-process rate served
over the compiled graph by handle, 0.43x through host memory, in one call; a Kimi-K2.6-like
call's (7168 x 5 wide, 16 rows a request) took 1.2-3.7 ms by handle against 3-157 ms through host
memory from 1 MiB (batch 1) up (`bench/feature_delivery.py`)."""

# Position of the device index among `reduce_tensor`'s rebuild arguments (torch 2.x:
# tensor class, size, stride, offset, storage class, dtype, device, handle, ...).
_DEVICE_ARG = 6


@dataclass(frozen=True)
class DeviceFeatures:
    """A call's per-request features left on the target's GPU: a handle to one joined tensor.

    `unpack()` on the drafter's side gives what `PackedFeatures.unpack()` gives (request i's
    `[n_i, F]`), on the GPU and in memory the drafter owns. Open it once only: the target may
    reuse the block as soon as the first opening is done."""

    delivery_id: str  # unique per delivery: the key of the drafter's taken copies
    device_uuid: str  # the GPU, as `torch.cuda.get_device_properties(...).uuid` names it
    rebuild: Callable[..., torch.Tensor]  # torch's `rebuild_cuda_tensor`
    rebuild_args: tuple[Any, ...]
    lengths: tuple[int, ...]  # n_i: request i's rows

    def unpack(self) -> list[torch.Tensor]:
        """Request i's features `[n_i, F]`, views of the drafter's own copy of the joined tensor."""
        args = list(self.rebuild_args)
        # The index the target's process gave the GPU need not be this process's index for it.
        args[_DEVICE_ARG] = _local_index(self.device_uuid)
        shared = self.rebuild(*args)  # this stream waits for the target's writes
        owned = shared.clone()
        torch.cuda.current_stream(owned.device).synchronize()  # read before the target reuses it
        del shared
        return list(owned.split(self.lengths))


def cuda_device_uuid(device: torch.device | None) -> str | None:
    """The physical GPU behind `device` (same in every process that sees it), None off CUDA."""
    if device is None or device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def same_gpu(target_uuid: str | None, drafter_uuid: str | None) -> bool:
    """Whether features can go by handle: both models on CUDA, on one physical GPU."""
    return target_uuid is not None and target_uuid == drafter_uuid


def wire_features(features: Sequence[torch.Tensor], on_device: bool, min_bytes: int = 0) -> Any:
    """`features` (request i's `[n_i, F]`, on one device) as they cross to the drafter: a
    `DeviceFeatures` handle when `on_device`, they lie on a GPU and hold at least `min_bytes`,
    else the wired `PackedFeatures` of the host path (also for no rows: nothing worth a handle)."""
    tensors = list(features)
    num_bytes = sum(t.numel() * t.element_size() for t in tensors)
    if not on_device or num_bytes == 0 or num_bytes < min_bytes or tensors[0].device.type != "cuda":
        return to_wire(pack_features(tensors))
    joined = torch.cat(tensors)  # [sum of n_i, F]
    lengths = tuple(int(t.shape[0]) for t in tensors)
    torch.cuda.ipc_collect()  # frees the blocks of earlier deliveries that the drafter opened
    rebuild, args = reduce_tensor(joined)
    uuid_of_gpu = cuda_device_uuid(joined.device)
    assert uuid_of_gpu is not None
    return DeviceFeatures(uuid.uuid4().hex, uuid_of_gpu, rebuild, tuple(args), lengths)


class FeaturesNotTakenError(DrafterUnavailableError):
    """A draft names a device delivery this drafter never took (it restarted since): its
    context is gone, as when it dies."""


class TakenFeatures:
    """The drafter's copies of device deliveries under actor calls, by delivery id.

    Entry i of a delivery belongs to slot `slots[i]`; a delivery goes once each of its entries
    was drafted from or its slot released (a request that ended never drafts from it)."""

    def __init__(self) -> None:
        # delivery id -> (request i's features, {i: slot} of the entries not used yet)
        self._deliveries: dict[str, tuple[list[torch.Tensor], dict[int, int]]] = {}

    def __len__(self) -> int:
        return len(self._deliveries)

    def take(self, delivery_id: str, features: list[torch.Tensor], slots: Sequence[int]) -> None:
        if len(features) != len(slots):
            raise ValueError(f"{len(features)} feature entries for {len(slots)} slots")
        self._deliveries[delivery_id] = (features, dict(enumerate(slots)))

    def features(self, delivery_id: str) -> list[torch.Tensor]:
        if delivery_id not in self._deliveries:
            raise FeaturesNotTakenError(f"device features {delivery_id} were not taken here")
        return self._deliveries[delivery_id][0]

    def used(self, delivery_id: str, index: int) -> None:
        """Entry `index` went into a draft."""
        entry = self._deliveries.get(delivery_id)
        if entry is not None:
            entry[1].pop(index, None)
            self._drop_if_used(delivery_id)

    def release(self, slot: int) -> None:
        """`slot`'s request ended: its entries will never be drafted from."""
        for delivery_id, (_, unused) in list(self._deliveries.items()):
            for index in [i for i, owner in unused.items() if owner == slot]:
                del unused[index]
            self._drop_if_used(delivery_id)

    def _drop_if_used(self, delivery_id: str) -> None:
        if not self._deliveries[delivery_id][1]:
            del self._deliveries[delivery_id]


@functools.cache
def _local_index(device_uuid: str) -> int:
    """This process's index of the GPU named `device_uuid`."""
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device_uuid:
            return index
    raise RuntimeError(f"GPU {device_uuid} is not visible to this process")
