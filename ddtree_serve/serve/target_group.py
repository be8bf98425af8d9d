"""The target as a tensor-parallel group of rank actors that the coordinator sees as one `Target`.

Each rank is a `TargetWorker` whose factory (`TargetRankFactory`) joins the group's
torch.distributed group (NCCL on CUDA, gloo on CPU) and loads its shard; ranks sit in the
speculation group's placement group after the drafter, in consecutive bundles (one per rank) or
all in one bundle (`PlacementConfig.target_in_one_bundle`: one node whatever the strategy). The
rendezvous address is picked on rank 0's node, by a task in rank 0's bundle.

`RayTargetGroup` fans every call out: all ranks get the same wired inputs (one object in the
object store), run the same forward (their collectives join the shards) and the same walk, and
commit their own caches. The result comes from rank 0; every other rank's small result is
fetched too and must equal it, so a divergence is caught the step it happens. Only rank 0
returns context features: the others are told `return_context=False`.

When a rank fails (its actor died, or its call raised), the ranks still inside a collective
would wait for it until the group's timeout, so the adapter kills the whole group at once and
raises `TargetGroupError` now and on every later call: the engine stops, the requests in flight
get the error, the Coordinator's health check fails and Serve replaces the replica, which
starts a new group.
"""

import dataclasses
import uuid
from typing import Any

import ray
import torch
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ddtree_serve.engine.builder import TargetRankFactory
from ddtree_serve.engine.interfaces import (
    ContextHandle,
    EncodeInput,
    PrefillInput,
    PrefillOutput,
    TargetUnavailableError,
    VerifyInput,
    VerifyOutput,
)
from ddtree_serve.models.parallel import RankSpec
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.ports import free_port
from ddtree_serve.serve.wire import from_wire, to_wire
from ddtree_serve.serve.workers import DescribedTarget, TargetWorker


class TargetGroupError(TargetUnavailableError):
    """A rank of the target group failed; the group is down and cannot serve again (the
    requests in flight end retriable, 503 / UNAVAILABLE, and Serve replaces the group)."""


@ray.remote(num_cpus=0)
def _rendezvous_address() -> str:
    """A free TCP port on this node, as a torch.distributed init method."""
    return f"tcp://{ray.util.get_node_ip_address()}:{free_port(host='')}"


def start_target_group(
    config: ServeConfig,
    placement_group: PlacementGroup | None,
    first_bundle: int,
) -> "RayTargetGroup":
    """Start `placement.tensor_parallel_size` rank actors in bundles `first_bundle ..` of the group.

    Without a placement group (a driver's tests) the ranks go anywhere on the cluster. Ranks are
    named `ddtree-target-<group id>-rank<r>`, so an operator (or a test) can find one.
    """
    placement = config.placement
    world_size = placement.tensor_parallel_size
    group_id = uuid.uuid4().hex[:8]

    def in_bundle(rank: int) -> dict[str, Any]:
        if placement_group is None:
            return {}
        bundle = first_bundle if placement.target_in_one_bundle else first_bundle + rank
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle
        )
        return {"scheduling_strategy": strategy}

    init_method = ray.get(_rendezvous_address.options(**in_bundle(0)).remote())
    resources = placement.target_rank_resources()
    actors = [
        TargetWorker.options(
            num_cpus=resources.num_cpus,
            num_gpus=resources.num_gpus,
            resources=dict(resources.resources),
            name=f"ddtree-target-{group_id}-rank{rank}",
            **in_bundle(rank),
        ).remote(TargetRankFactory(config.engine, RankSpec(rank, world_size, init_method)))
        for rank in range(world_size)
    ]
    return RayTargetGroup(actors)


class RayTargetGroup(DescribedTarget):
    """`Target` over the rank actors of one tensor-parallel group; rank 0's results are the group's."""

    def __init__(self, actors: list[Any]) -> None:
        self._actors = actors
        self._failure: TargetGroupError | None = None
        infos = self._gather([actor.describe.remote() for actor in actors], "start-up")
        super().__init__(infos[0])

    @property
    def ranks(self) -> list[Any]:
        """The rank actors' handles, rank 0 first."""
        return list(self._actors)

    @property
    def world_size(self) -> int:
        return len(self._actors)

    def prefill(self, inputs: PrefillInput) -> PrefillOutput:
        self._check_up()
        wired = ray.put(to_wire(inputs))
        calls = [actor.prefill.remote(wired) for actor in self._actors]  # (output, context) refs
        outputs = self._gather([output_ref for output_ref, _ in calls], "prefill")
        output: PrefillOutput = from_wire(outputs[0])
        return dataclasses.replace(output, context=calls[0][1])

    def verify_and_commit(self, inputs: VerifyInput) -> VerifyOutput:
        self._check_up()
        wired = ray.put(to_wire(inputs))
        without_context = wired
        if inputs.return_context and self.world_size > 1:
            without_context = ray.put(to_wire(dataclasses.replace(inputs, return_context=False)))
        calls = [
            actor.verify_and_commit.remote(wired if rank == 0 else without_context)
            for rank, actor in enumerate(self._actors)
        ]
        outputs = self._gather([output_ref for output_ref, _ in calls], "verify")
        output: VerifyOutput = from_wire(outputs[0])
        return dataclasses.replace(output, context=calls[0][1] if inputs.return_context else None)

    def encode_context(self, inputs: EncodeInput) -> ContextHandle:
        """Every rank runs the features-only forward (its collectives need all of them); rank
        0's features are the handle, as in `prefill`."""
        self._check_up()
        wired = ray.put(to_wire(inputs))
        handles = [actor.encode_context.remote(wired) for actor in self._actors]
        return handles[0]

    async def check_alive(self) -> None:
        """Raises `TargetGroupError` when any rank is gone (health checks)."""
        self._check_up()
        try:
            for actor in self._actors:
                await actor.describe.remote()
        except RayError as error:
            failure = TargetGroupError(f"a target rank is gone: {error}")
            self._take_down(failure)
            raise failure from error

    def release(self, slot: int) -> None:
        # Fire and forget, as `RayTarget.release`: each rank runs its calls in submission order.
        if self._failure is None:
            for actor in self._actors:
                actor.release.remote(slot)

    def shutdown(self) -> None:
        """Kill every rank (idempotent); later calls raise `TargetGroupError`."""
        self._take_down(TargetGroupError("the target group was shut down"))

    def _gather(self, refs: list[Any], call: str) -> list[Any]:
        """Every rank's result of one call, in rank order, all equal to rank 0's.

        Waits for whichever rank answers first, so a failed rank is seen at once even while the
        others are blocked in a collective waiting for it.
        """
        self._check_up()
        results: list[Any] = [None] * len(refs)
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            (ready,), pending = ray.wait(pending, num_returns=1)
            rank = rank_of[ready]
            try:
                results[rank] = ray.get(ready)
            except RayError as error:
                failure = TargetGroupError(
                    f"target rank {rank} of {len(refs)} failed during {call} "
                    f"({type(error).__name__}: {_first_line(error)}); the target group is down"
                )
                self._take_down(failure)
                raise failure from error
        for rank, result in enumerate(results[1:], start=1):
            if not _same(from_wire(result), from_wire(results[0])):
                failure = TargetGroupError(
                    f"target rank {rank} disagrees with rank 0 after {call}; the target group is down"
                )
                self._take_down(failure)
                raise failure
        return results

    def _check_up(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _take_down(self, failure: TargetGroupError) -> None:
        if self._failure is None:
            self._failure = failure
            for actor in self._actors:
                ray.kill(actor, no_restart=True)


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else ""


def _same(a: Any, b: Any) -> bool:
    """Equal results: tensors element for element, dataclasses field by field, the rest by `==`."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            _same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
