"""The target model inside the Coordinator replica, the drafter in its actor
(`placement.workers: target_in_coordinator`).

A served step over two worker actors pays two hops (verify, then draft) on top of the models;
the verify's round trip alone cost about as much as the bundled pair's whole verify on the
H200's host (README, Benchmarks). SGLang's scheduler runs in the process of its rank-0 model
worker, and vLLM's engine core drives a single-process executor in its own process, for the
same reason: the loop that decides each step lives where the big model runs. Here the
Coordinator's engine thread calls the target directly and only the draft crosses a process
boundary, over the socket step graph (`step_sockets.py`): the features of each target call go
to the drafter from this process, on the connection a target actor would use, so the drafter's
side and the graph's fault handling are those of the two-actor group. A lost drafter still
leaves the group decoding plainly; the target dies only with the replica, which Serve replaces.
"""

from typing import Any

from ddtree_serve.engine.interfaces import Target
from ddtree_serve.serve.device_features import cuda_device_uuid
from ddtree_serve.serve.step_sockets import LocalTargetEnd
from ddtree_serve.serve.target_calls import TargetCallRunner
from ddtree_serve.serve.workers import DescribedTarget


class LocalTarget(DescribedTarget):
    """The step graph's target when it is a model in this process: the `RayTarget` of the group
    without the actor (metadata, liveness, where features go)."""

    actor = None  # no worker actor: faults drills find only the drafter's

    def __init__(self, target: Target) -> None:
        super().__init__(
            {
                "vocab_size": target.vocab_size,
                "eos_token_ids": tuple(target.eos_token_ids),
                "max_seq_len": target.max_seq_len,
                "verify_token_buckets": target.verify_token_buckets,
            }
        )
        self.model = target
        self.calls = TargetCallRunner(target, wired=False)
        self.device_uuid: str | None = cuda_device_uuid(getattr(target, "device", None))

    async def check_alive(self) -> None:
        """Alive while this replica is: a target that failed ended the engine thread, which the
        Coordinator's health check reports."""

    def deliver_features_on_device(self, taker: Any, min_bytes: int = 0) -> None:
        """Features as CUDA IPC handles from `min_bytes` a call (the drafter shares this GPU);
        `taker` is for actor calls, which this placement does not use."""
        self.calls.deliver_features_on_device(min_bytes)

    def step_end(self, overlap: bool) -> LocalTargetEnd:
        """A fresh target end for a socket step graph of this shape (one per graph compiled)."""
        return LocalTargetEnd(self.calls.run, overlap)
