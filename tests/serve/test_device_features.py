"""Features target -> drafter by CUDA IPC handle when both actors share one GPU; the host path else.

On CPU: when the group picks the device path, that the host path's bytes are what they were,
and the drafter's bookkeeping of taken deliveries. On CUDA (skipped without): two actors on one
GPU pass features by handle many times with the producer's memory bounded, a handle never
opened keeps its block, and greedy output through a served group on one GPU, features by handle
under both transports, is the in-process engine's.
"""

import shutil
import tempfile
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import ray
import torch
from pydantic import ValidationError

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.builder import target_dir
from ddtree_serve.engine.interfaces import DrafterUnavailableError
from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.models import load_tokenizer
from ddtree_serve.serve.compiled_graph import GraphTarget
from ddtree_serve.serve.config import PlacementConfig, ServeConfig
from ddtree_serve.serve.device_features import (
    DEVICE_FEATURES_MIN_BYTES,
    DeviceFeatures,
    FeaturesNotTakenError,
    TakenFeatures,
    cuda_device_uuid,
    same_gpu,
    wire_features,
)
from ddtree_serve.serve.group import _deliver_features, start_workers
from ddtree_serve.serve.wire import Wired, from_wire, pack_features, to_wire
from tests.serve.conftest import run_schedule

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_features_go_by_handle_only_between_models_on_one_gpu() -> None:
    assert same_gpu("GPU-a", "GPU-a")
    assert not same_gpu("GPU-a", "GPU-b")
    assert not same_gpu(None, None)  # both on the CPU
    assert not same_gpu("GPU-a", None)
    assert cuda_device_uuid(None) is None
    assert cuda_device_uuid(torch.device("cpu")) is None


class _Adapter(SimpleNamespace):
    """A `RayTarget` / `RayDrafter` stand-in: its GPU, and the taker it was told to use."""

    told: list[Any]

    def deliver_features_on_device(self, taker: Any, min_bytes: int = 0) -> None:
        self.told.append((taker, min_bytes))


@pytest.mark.parametrize(
    ("features", "transport", "drafter_gpu", "expected", "min_bytes"),
    [
        # actor calls: only `device` sends handles (the drafter takes each one by a call)
        ("auto", "actor_calls", "GPU-a", "host", 0),
        ("device", "actor_calls", "GPU-a", "drafter", 0),
        ("auto", "compiled_graph", "GPU-a", None, DEVICE_FEATURES_MIN_BYTES),  # the graph delivers
        ("device", "compiled_graph", "GPU-a", None, 0),
        ("auto", "sockets", "GPU-a", None, DEVICE_FEATURES_MIN_BYTES),  # the socket graph too
        ("auto", "compiled_graph", "GPU-b", "host", 0),  # two GPUs: no device path is built
        ("device", "actor_calls", "GPU-b", "host", 0),
        ("auto", "actor_calls", None, "host", 0),
        ("host", "actor_calls", "GPU-a", "host", 0),
    ],
)
def test_the_group_sends_features_by_handle_when_both_models_share_a_gpu(
    features: str, transport: str, drafter_gpu: str | None, expected: str | None, min_bytes: int
) -> None:
    config = ServeConfig.model_validate({"placement": {"features": features, "transport": transport}})
    target = _Adapter(device_uuid="GPU-a", told=[])
    drafter = _Adapter(device_uuid=drafter_gpu, told=[])
    _deliver_features(config, target, drafter)  # type: ignore[arg-type]
    taker = {"drafter": drafter, None: None}
    assert target.told == ([] if expected == "host" else [(taker[expected], min_bytes)])
    assert drafter.told == []


def test_placement_features_default_to_auto_and_accept_only_auto_device_or_host() -> None:
    assert PlacementConfig().features == "auto"
    assert PlacementConfig(features="host").features == "host"
    assert PlacementConfig(features="device").features == "device"
    with pytest.raises(ValidationError):
        PlacementConfig(features="nccl")  # type: ignore[arg-type]


@pytest.mark.parametrize("on_device", [False, True])
def test_features_on_the_cpu_take_the_host_path_byte_for_byte(on_device: bool) -> None:
    """Asked for the device path, CPU tensors still go as the wired `PackedFeatures`, unchanged."""
    features = [torch.randn(3, 5, dtype=torch.bfloat16), torch.randn(0, 5, dtype=torch.bfloat16)]
    wired = wire_features(features, on_device)
    reference = to_wire(pack_features(features))
    assert isinstance(wired, Wired)
    assert wired.structure == reference.structure
    num_bytes = 3 * 5 * 2  # the rows' bytes (the buffer's alignment padding is left unwritten)
    assert wired.buffer.shape == reference.buffer.shape
    assert np.array_equal(wired.buffer[:num_bytes], reference.buffer[:num_bytes])
    unpacked = from_wire(wired).unpack()
    assert [t.shape for t in unpacked] == [(3, 5), (0, 5)]
    assert torch.equal(unpacked[0], features[0])
    assert from_wire(wire_features([], on_device)).unpack() == []


def test_taken_deliveries_go_once_every_entry_was_drafted_or_released() -> None:
    taken = TakenFeatures()
    first, second = [torch.ones(2, 4), torch.zeros(1, 4)], [torch.ones(3, 4)]
    taken.take("a", first, (5, 7))
    taken.take("b", second, (7,))
    assert taken.features("a") is first and len(taken) == 2
    taken.used("a", 0)  # slot 5 drafted from entry 0
    assert len(taken) == 2
    taken.release(7)  # slot 7's request ended: entry 1 of "a" and all of "b" go unused
    assert len(taken) == 0
    taken.used("a", 1)  # a late mark for a delivery already gone is a no-op
    with pytest.raises(FeaturesNotTakenError) as error:
        taken.features("a")
    # A draft naming a delivery this drafter never took finds its context lost, as after a death.
    assert isinstance(error.value, DrafterUnavailableError)
    with pytest.raises(ValueError, match="2 feature entries for 1 slots"):
        taken.take("c", first, (1,))


def test_a_slot_reused_after_its_release_keeps_its_new_delivery() -> None:
    taken = TakenFeatures()
    taken.take("old", [torch.ones(1, 2)], (3,))
    taken.release(3)
    taken.take("new", [torch.ones(1, 2)], (3,))  # the slot's next request
    assert len(taken) == 1 and taken.features("new")[0].shape == (1, 2)


# ------------------------------------------------------------------------------------- CUDA


@pytest.fixture(scope="module")
def gpu_ray_cluster() -> Iterator[None]:
    temp_dir = tempfile.mkdtemp(prefix="ddtree-device-features-")
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, _temp_dir=temp_dir)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@ray.remote(num_cpus=0, num_gpus=0.5)
class _Producer:
    """The target's side: random features on the GPU, sent by handle."""

    def send(self, lengths: list[int], hidden: int, seed: int) -> tuple[Any, np.ndarray, int]:
        """(the handle, the joined features on the host as float32, bytes allocated after sending)."""
        generator = torch.Generator(device="cuda").manual_seed(seed)
        features = [
            torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, generator=generator) for n in lengths
        ]
        handle = wire_features(features, on_device=True)
        expected = torch.cat(features).float().cpu().numpy()
        return handle, expected, torch.cuda.memory_allocated()

    def allocated_after_collect(self) -> int:
        torch.cuda.ipc_collect()
        return torch.cuda.memory_allocated()


@ray.remote(num_cpus=0, num_gpus=0.5)
class _Consumer:
    """The drafter's side: opens a handle, gives the features back on the host."""

    def take(self, handle: DeviceFeatures) -> list[np.ndarray]:
        return [t.float().cpu().numpy() for t in handle.unpack()]


@cuda_only
@pytest.mark.gpu
def test_two_actors_on_one_gpu_pass_features_by_handle_with_bounded_memory(gpu_ray_cluster: None) -> None:
    producer, consumer = _Producer.remote(), _Consumer.remote()
    lengths, hidden = [16, 3, 0, 9], 7168 * 5 // 8  # a Kimi-like row width, scaled down
    allocated = []
    try:
        for seed in range(200):
            handle, expected, after_send = ray.get(producer.send.remote(lengths, hidden, seed))
            assert isinstance(handle, DeviceFeatures)
            received = ray.get(consumer.take.remote(handle))
            assert [r.shape[0] for r in received] == lengths
            assert np.array_equal(np.concatenate(received), expected)
            allocated.append(after_send)
    finally:
        _kill(producer, consumer)  # their GPU shares go back to the module's cluster
    # Each block is freed at the next send (its counter reached 0): no growth after warm-up.
    assert max(allocated[20:]) <= max(allocated[:20])


@cuda_only
@pytest.mark.gpu
def test_a_handle_never_opened_keeps_its_block(gpu_ray_cluster: None) -> None:
    """What a drafter that dies before opening a delivery leaves behind (why every handle is
    opened at once)."""
    producer = _Producer.remote()
    try:
        before = ray.get(producer.allocated_after_collect.remote())
        for seed in range(4):
            ray.get(producer.send.remote([256], 4096, seed))  # sent, never opened
        held = ray.get(producer.allocated_after_collect.remote()) - before
    finally:
        _kill(producer)
    assert held >= 4 * 256 * 4096 * 2  # four bf16 blocks of [256, 4096]


@cuda_only
@pytest.mark.gpu
def test_features_below_the_threshold_cross_through_host_memory() -> None:
    """`placement.features: auto`: a call's features below `DEVICE_FEATURES_MIN_BYTES` take the
    host path (the same bytes as ever), from it up a handle."""
    small = [torch.randn(4, 768, device="cuda", dtype=torch.bfloat16)]  # 6 KiB: the bundled pair's
    large = [torch.randn(16, 7168 * 5, device="cuda", dtype=torch.bfloat16)]  # 1.1 MiB: Kimi-like
    wired = wire_features(small, True, DEVICE_FEATURES_MIN_BYTES)
    assert isinstance(wired, Wired)
    assert torch.equal(from_wire(wired).unpack()[0], small[0].cpu())
    assert isinstance(wire_features(large, True, DEVICE_FEATURES_MIN_BYTES), DeviceFeatures)
    assert isinstance(wire_features(small, True, 0), DeviceFeatures)


def _kill(*actors: Any) -> None:
    for actor in actors:
        ray.kill(actor)


GPU_ENGINE = EngineConfig(
    mode="ddtree", budget=8, max_num_seqs=4, max_queue_len=8, max_seq_len=256, device="cuda"
)
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n", "for i in range(10):", "def fib(n):"]


def _run_greedy(engine: SpecEngine, lengths: list[int]) -> dict[str, list[int]]:
    """Requests of `lengths` tokens joining two steps apart (more than fit at once); final tokens."""
    greedy = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    return run_schedule(
        engine, [(2 * i, f"g{i}", PROMPTS[i % len(PROMPTS)], params) for i, params in enumerate(greedy)]
    )


@cuda_only
@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["actor_calls", "compiled_graph", "sockets"])
def test_greedy_through_a_group_on_one_gpu_with_features_by_handle_equals_in_process(
    gpu_ray_cluster: None, transport: str
) -> None:
    share = {"num_cpus": 0.5, "num_gpus": 0.5}
    placement = {"transport": transport, "drafter": share, "target": share}
    placement["features"] = "device"  # the bundled pair's features are below auto's threshold
    config = ServeConfig(engine=GPU_ENGINE, placement=placement)  # type: ignore[arg-type]
    target, drafter = start_workers(config)
    try:
        assert ray.get(target.actor.describe.remote())["features_on_device"]  # type: ignore[attr-defined]
        tokenizer = load_tokenizer(target_dir(GPU_ENGINE))
        served = SpecEngine(GPU_ENGINE.to_settings(), target, drafter, tokenizer)
        lengths = [40, 9, 25, 3, 30, 17]
        assert _run_greedy(served, lengths) == _run_greedy(build_local_engine(GPU_ENGINE), lengths)
        if transport == "actor_calls":  # every request ended: the drafter keeps no delivery
            assert ray.get(drafter.actor.describe.remote())["taken_deliveries"] == 0  # type: ignore[union-attr]
    finally:
        if isinstance(target, GraphTarget):
            target.close()
        _kill(target.actor, drafter.actor)  # type: ignore[union-attr]
