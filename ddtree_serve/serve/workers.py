"""Ray actors that own the models, and the adapters that make them look like the engine's seam.

`TargetWorker` / `DrafterWorker` hold the target's and the drafter's half of the step
(`TargetStep` / `DraftStep`, or any `Target` / `Drafter`) built by a factory, so tests inject
fakes and the engine decides how models load. `RayTarget` / `RayDrafter`
implement the same protocols in the Coordinator over the actor handles: the `SpecEngine` loop
runs unchanged, Ray only adds transport.

Context features never enter the Coordinator: `prefill` and `verify_and_commit` have
`num_returns=2`, the second return being the features, whose `ObjectRef` the engine forwards
untouched inside its `ContextSlice`s; `RayDrafter` hands each distinct ref to
`DrafterWorker.draft` as a top-level argument, so Ray resolves it into the drafter's process
before the call runs. (Ray inlines
return values under `max_direct_call_object_size`, 100 KiB by default, into the caller's
memory: a toy model's few-KiB features do pass through the Coordinator's memory; real models'
features, taps x hidden x accepted tokens, go through the object store target -> drafter.)
Values cross every actor boundary as `wire.py` packs them: one byte buffer of all their tensors
plus their structure pickled by the standard library (several times cheaper in Ray than torch
tensors, and cheaper than one numpy array per tensor).
When both workers' models lie on one GPU, the group has the target leave features there behind
a CUDA IPC handle instead (`device_features.py`): the ObjectRef then carries the handle, and
`RayTarget` has the drafter open it once the call's result is back (`DrafterWorker.take_features`).

Faults: a dead or restarting worker makes Ray raise `RayActorError`; the adapters turn it into
the seam's `DrafterUnavailableError` / `TargetUnavailableError`, so the engine's fallback and
the Coordinator's error mapping know nothing of Ray. `RayDrafter.is_available` probes a drafter
that Ray restarts (`max_restarts`, set by the group) without blocking the engine thread. A
target that Ray restarted holds no KV cache, so it refuses every step call
(`TargetRestartedError`, also a lost target to the engine) until `RayTarget.start_serving` says
that the engine calling it is a new one that knows it is empty: a call the old engine sent
cannot run on the new process's empty slots.
"""

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import ray
import torch
from ray.exceptions import ActorUnavailableError, RayActorError

from ddtree_serve.engine.interfaces import (
    ContextHandle,
    ContextSlice,
    Drafter,
    DrafterUnavailableError,
    DraftInput,
    DraftOutput,
    EncodeInput,
    Pending,
    PrefillInput,
    PrefillOutput,
    Target,
    TargetUnavailableError,
    VerifyInput,
    VerifyOutput,
)
from ddtree_serve.serve.call_trace import CallStamps, CallTrace, mark
from ddtree_serve.serve.device_features import DeviceFeatures, TakenFeatures, cuda_device_uuid
from ddtree_serve.serve.graph_calls import ContextDelivery, DrafterCall, TargetCall
from ddtree_serve.serve.step_sockets import ChannelAddress, DrafterChannelServer, TargetChannelServer
from ddtree_serve.serve.target_calls import TargetCallRunner
from ddtree_serve.serve.wire import from_wire, to_wire

TargetFactory = Callable[[], Target]
DrafterFactory = Callable[[], Drafter]

ResultT = TypeVar("ResultT")

Wired = Any
"""A value as `to_wire` left it (its tensors are `WireTensor`s): what an actor method receives."""

# How often a caller asks again for a worker that Ray is restarting (it fails the calls sent
# while the old process died with `ActorUnavailableError`).
_RESTART_POLL_S = 0.05


_RESTARTED = "the target worker restarted: its KV caches are gone"


class TargetRestartedError(TargetUnavailableError):
    """A target that Ray restarted was called before `start_serving`: the caller's engine
    expects KV caches that died with the old process."""


@ray.remote
class TargetWorker:
    """Holds the target model and every slot's KV cache on its device(s)."""

    def __init__(self, build_target: TargetFactory) -> None:
        self._target = build_target()
        # A restarted process serves no step until its Coordinator has a new engine over it.
        self._serving = not ray.get_runtime_context().was_current_actor_reconstructed
        self._trace = CallTrace()
        # The step graph's calls, and how context features leave (see `deliver_features_on_device`).
        self._graph_calls = TargetCallRunner(self._target, wired=True, trace=self._trace)
        # Transport 'sockets': the thread serving graph calls, and the lock it holds per call.
        self._model_lock = threading.Lock()
        self._step_channel: TargetChannelServer | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "vocab_size": self._target.vocab_size,
            "eos_token_ids": tuple(self._target.eos_token_ids),
            "max_seq_len": self._target.max_seq_len,
            "verify_token_buckets": self._target.verify_token_buckets,
            "serving": self._serving,
            "device_uuid": _device_uuid(self._target),
            "features_on_device": self._graph_calls.features_on_device,
        }

    def deliver_features_on_device(self, min_bytes: int = 0) -> None:
        """From now on, send context features as CUDA IPC handles (`device_features.py`): the
        group found the drafter's model on this target's GPU. A handle must be opened once, and
        at once (the target's block lives until then). `min_bytes`: a call's features below it
        go through host memory (`placement.features: auto`)."""
        self._graph_calls.deliver_features_on_device(min_bytes)

    def trace_calls(self, enabled: bool) -> None:
        """Stamp each step call's parts from now on (or stop); see `call_trace.py`."""
        self._trace.enabled = enabled

    def take_call_trace(self) -> list[CallStamps]:
        return self._trace.take()

    def start_serving(self, num_slots: int) -> None:
        """Empty slots `0 .. num_slots - 1` and accept step calls from a new engine.

        Also for a worker that was not restarted: a loss reported for a live target (a transient
        `ActorUnavailableError`) leaves the old engine's KV caches here, and a prefill on a
        non-empty slot would extend them instead of starting afresh.
        """
        for slot in range(num_slots):
            self._target.release(slot)
        self._serving = True

    @ray.method(num_returns=2)
    def prefill(self, inputs: Wired) -> tuple[Wired, Wired]:
        """`inputs`: a wired `PrefillInput` -> (wired `PrefillOutput` without context, wired context)."""
        self._check_serving()
        with self._trace.call("prefill") as stamps:
            return self._run_wired(self._target.prefill, inputs, stamps)

    @ray.method(num_returns=2)
    def verify_and_commit(self, inputs: Wired) -> tuple[Wired, Wired]:
        """`inputs`: a wired `VerifyInput` -> (wired `VerifyOutput` without context, wired context)."""
        self._check_serving()
        with self._trace.call("verify_and_commit") as stamps:
            return self._run_wired(self._target.verify_and_commit, inputs, stamps)

    def _run_wired(self, method: Any, inputs: Wired, stamps: CallStamps | None) -> tuple[Wired, Wired]:
        unwired = from_wire(inputs)
        mark(stamps, "unwire")
        output = method(unwired)
        mark(stamps, "model")
        wired = to_wire(dataclasses.replace(output, context=None))
        context = None if output.context is None else self._wire_features(output.context)
        mark(stamps, "wire")
        return wired, context

    def encode_context(self, inputs: Wired) -> Wired:
        """`inputs`: a wired `EncodeInput` -> the wired context (what a drafter's `draft` resolves)."""
        self._check_serving()
        return self._wire_features(self._target.encode_context(from_wire(inputs)))

    def _wire_features(self, features: Any) -> Wired:
        return self._graph_calls.wire_features(features)

    def release(self, slot: int) -> None:
        if self._serving:  # a restarted process holds nothing to release
            self._target.release(slot)

    def _check_serving(self) -> None:
        if not self._serving:
            raise TargetRestartedError(_RESTARTED)

    # -------------------------------------------------------------- compiled step graph side

    @ray.method(num_returns=2)
    def graph_call(self, call: TargetCall | None) -> tuple[Wired, ContextDelivery | None]:
        """One graph execution's target call -> (wired output without context, the features for
        the drafter). The last result is kept for `replay_graph_call`."""
        return self._graph_call(call, deliver=True)

    def _graph_call(self, call: TargetCall | None, deliver: bool) -> tuple[Wired, ContextDelivery | None]:
        """`graph_call`; `deliver` False: no features (`TargetCallRunner.run`)."""
        if call is None:
            return None, None
        self._check_serving()
        return self._graph_calls.run(call, deliver)

    def replay_graph_call(self, call: TargetCall) -> Wired:
        """The output of `call` without the graph (its drafter is lost): kept if it ran (the
        execution that broke), else run now, without features.

        Called with the graph torn down, so no graph call runs at the same time."""
        with self._model_lock:  # a socket graph's call still running finishes first
            self._check_serving()
            return self._graph_calls.replay(call)

    def open_step_channel(self, drafter_address: ChannelAddress | None) -> ChannelAddress:
        """Transport 'sockets': serve graph calls from the Coordinator that connects to the
        address returned, sending deliveries to the drafter at `drafter_address` (a previous
        channel closes first)."""
        self.close_step_channel()
        self._step_channel = TargetChannelServer(self._graph_call, self._model_lock, drafter_address)
        return self._step_channel.address

    def close_step_channel(self) -> None:
        """End the socket graph's channel once its call in progress returned (`StepGraph` teardown)."""
        if self._step_channel is not None:
            self._step_channel.close()
            self._step_channel = None


@ray.remote
class DrafterWorker:
    """Holds the DFlash drafter and every slot's context features on its device."""

    def __init__(self, build_drafter: DrafterFactory) -> None:
        self._drafter = build_drafter()
        # Compiled step graph only: each slot's features delivered since its last draft.
        self._delivered: dict[int, list[Any]] = {}
        # Actor calls with features on the device: the copies taken, until drafts use them.
        self._taken = TakenFeatures()
        self._trace = CallTrace()
        # Transport 'sockets': the thread serving graph calls, and the lock it holds per call.
        self._model_lock = threading.Lock()
        self._step_channel: DrafterChannelServer | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "block_size": self._drafter.block_size,
            "device_uuid": _device_uuid(self._drafter),
            "taken_deliveries": len(self._taken),  # device features kept for drafts to come
        }

    def trace_calls(self, enabled: bool) -> None:
        """Stamp each step call's parts from now on (or stop); see `call_trace.py`."""
        self._trace.enabled = enabled

    def take_call_trace(self) -> list[CallStamps]:
        return self._trace.take()

    def draft(self, inputs: Wired, *handles: Wired) -> Wired:
        """`inputs`: a wired `DraftInput` whose `ContextSlice.handle`s are positions in `handles`.

        `handles` are the target calls' context results, resolved by Ray from the ObjectRefs
        the coordinator passed (one per distinct producing call)."""
        with self._trace.call("draft") as stamps:
            features = [self._features_of(handle) for handle in handles]
            draft_input: DraftInput = from_wire(inputs)
            contexts = [
                [ContextSlice(features[c.handle], c.index) for c in slices] for slices in draft_input.contexts
            ]
            for slices in draft_input.contexts:
                for c in slices:
                    if isinstance(handles[c.handle], DeviceFeatures):
                        self._taken.used(handles[c.handle].delivery_id, c.index)
            return self._draft_wired(dataclasses.replace(draft_input, contexts=contexts), stamps)

    def take_features(self, features: Wired, slots: tuple[int, ...]) -> None:
        """Actor calls: a target call's context, once its result is back (`RayTarget` sends it).

        A device handle (`DeviceFeatures`) is opened now and its copies kept for the drafts that
        name it (the target's block is free again); host features wait in Ray for the draft."""
        if isinstance(features, DeviceFeatures):
            self._taken.take(features.delivery_id, features.unpack(), slots)

    def _features_of(self, handle: Wired) -> list[torch.Tensor]:
        if isinstance(handle, DeviceFeatures):
            return self._taken.features(handle.delivery_id)
        return from_wire(handle).unpack()

    def _draft_wired(self, draft_input: DraftInput, stamps: CallStamps | None) -> Wired:
        mark(stamps, "unwire")
        output = self._drafter.draft(draft_input)
        mark(stamps, "model")
        wired = to_wire(output)
        mark(stamps, "wire")
        return wired

    def release(self, slot: int) -> None:
        self._drafter.release(slot)
        self._delivered.pop(slot, None)
        self._taken.release(slot)

    # -------------------------------------------------------------- compiled step graph side

    def open_step_channel(self, overlap: bool) -> ChannelAddress:
        """Transport 'sockets': serve the graph's drafter nodes (`overlap`: its shape) to the
        Coordinator and the target that connect to the address returned."""
        self.close_step_channel()
        self._step_channel = DrafterChannelServer(
            self.graph_draft, self.graph_take_context, self._model_lock, overlap
        )
        return self._step_channel.address

    def close_step_channel(self) -> None:
        """End the socket graph's channel once its call in progress returned."""
        if self._step_channel is not None:
            self._step_channel.close()
            self._step_channel = None

    def graph_draft(self, call: DrafterCall | None) -> Wired:
        """One graph execution's drafter call: releases, then the draft from delivered features."""
        if call is None:
            return None
        for slot in call.releases:
            self.release(slot)
        return self._run_draft_call(call, None)

    def graph_take_context(self, delivery: ContextDelivery | None, call: DrafterCall | None) -> Wired:
        """The serial graph's drafter node: releases, then keeps a target call's features per slot
        in commit order, then runs the execution's draft, if any (a chained one from the delivered
        verdict's bonus tokens). The overlapped graph passes no call: its drafts run in
        `graph_draft`.

        Values read from a graph channel are views of its buffer, and the target cannot write
        the next execution while one is held: each tensor is copied out."""
        for slot in () if call is None else call.releases:
            self.release(slot)
        if delivery is not None:
            features = from_wire(delivery.features, copy=True).unpack()
            for slot, tensor in zip(delivery.slots, features, strict=True):
                self._delivered.setdefault(slot, []).append(tensor)
        return None if call is None else self._run_draft_call(call, delivery)

    def _run_draft_call(self, call: DrafterCall, delivery: ContextDelivery | None) -> Wired:
        """The call's draft from the delivered features, if it has one; a chained draft's roots
        are the bonus tokens of `delivery` (its execution's verify)."""
        if call.inputs is None:
            return None
        if not call.chained:
            with self._trace.call("graph_draft") as stamps:
                return self._draft_delivered(from_wire(call.inputs), call.context_counts, stamps)
        with self._trace.call("graph_chained_draft") as stamps:
            draft_input: DraftInput = from_wire(call.inputs)
            if (
                delivery is None
                or delivery.bonus_tokens is None
                or delivery.slots != tuple(draft_input.slots)
            ):
                raise RuntimeError("a chained draft follows the verify of its own slots")
            bonus_tokens = torch.tensor(delivery.bonus_tokens, dtype=torch.int64)
            draft_input = dataclasses.replace(draft_input, bonus_tokens=bonus_tokens)
            return self._draft_delivered(draft_input, call.context_counts, stamps)

    def _draft_delivered(
        self, draft_input: DraftInput, context_counts: tuple[int, ...], stamps: CallStamps | None
    ) -> Wired:
        """`draft_input`'s draft from each slot's delivered features, `context_counts[i]` of them."""
        contexts = []
        for slot, count in zip(draft_input.slots, context_counts, strict=True):
            features = self._delivered.pop(slot, [])
            if len(features) != count:
                raise RuntimeError(f"slot {slot}: {len(features)} context deliveries for {count} slices")
            contexts.append([ContextSlice(features, i) for i in range(len(features))])
        return self._draft_wired(dataclasses.replace(draft_input, contexts=contexts), stamps)


class DescribedTarget:
    """The `Target` metadata a `TargetWorker.describe` reported, read once at connection: the
    part the single-actor adapter and the tensor-parallel group adapter share."""

    def __init__(self, info: dict[str, Any]) -> None:
        self._vocab_size: int = info["vocab_size"]
        self._eos_token_ids: tuple[int, ...] = info["eos_token_ids"]
        self._max_seq_len: int = info["max_seq_len"]
        self._verify_token_buckets: tuple[int, ...] | None = info["verify_token_buckets"]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def verify_token_buckets(self) -> tuple[int, ...] | None:
        return self._verify_token_buckets

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len


class RayTarget(DescribedTarget):
    """`Target` over a `TargetWorker` handle; blocks the engine thread on each step's result."""

    def __init__(self, actor: Any) -> None:
        """Waits for the worker, through a restart Ray is running; `RayActorError` once it is
        dead for good."""
        self._actor = actor
        info = _describe_restarted(actor)
        super().__init__(info)
        self.device_uuid: str | None = info["device_uuid"]
        # `AsyncDeviceTarget`: the engine's host work while the worker verifies (the call is
        # milliseconds of round trip on top of the model, all of it idle time here).
        self.while_verifying: Callable[[], None] | None = None
        # Features on the device under actor calls: the drafter that opens each call's handle.
        self._feature_taker: RayDrafter | None = None

    @property
    def actor(self) -> Any:
        return self._actor

    def start_serving(self, num_slots: int) -> None:
        """Let a restarted worker take step calls, its first `num_slots` slots emptied: from now
        on they come from an engine that knows its slots are empty (the Coordinator's new one)."""
        ray.get(self._actor.start_serving.remote(num_slots))

    def deliver_features_on_device(self, taker: "RayDrafter | None", min_bytes: int = 0) -> None:
        """From now on the worker sends context features as CUDA IPC handles (the group found
        the drafter on its GPU), a call's below `min_bytes` through host memory. `taker`: under
        actor calls, the drafter that opens each call's handle once the call returned (a
        context the engine drafts from late, or never, would keep the target's block
        meanwhile); None: the compiled graph delivers them."""
        ray.get(self._actor.deliver_features_on_device.remote(min_bytes))
        self._feature_taker = taker

    def _send_features(self, context_ref: Any, slots: Any) -> None:
        """Under actor calls with features on the device: the drafter takes the call's handle.

        Sent once the call's result is back (the encode's at once: the draft that follows waits
        for it anyway), so the take never holds the drafter's queue behind a target call while
        it could draft another micro-batch."""
        if self._feature_taker is not None:
            self._feature_taker.take_features(context_ref, slots)

    def prefill(self, inputs: PrefillInput) -> PrefillOutput:
        output_ref, context_ref = self._actor.prefill.remote(to_wire(inputs))
        output: PrefillOutput = _PendingCall(output_ref, target_lost).result()
        self._send_features(context_ref, inputs.slots)
        return dataclasses.replace(output, context=context_ref)

    def verify_and_commit(self, inputs: VerifyInput) -> VerifyOutput:
        pending = self.submit_verify(inputs)
        if self.while_verifying is not None:
            self.while_verifying()  # the worker verifies meanwhile
        return pending.result()

    def submit_verify(self, inputs: VerifyInput) -> Pending[VerifyOutput]:
        """The verify call in flight: the drafter actor may run a draft meanwhile (overlap)."""
        output_ref, context_ref = self._actor.verify_and_commit.remote(to_wire(inputs))
        context = context_ref if inputs.return_context else None

        def finish(output: VerifyOutput) -> VerifyOutput:
            if context is not None:
                self._send_features(context, inputs.slots)
            return dataclasses.replace(output, context=context)

        return _PendingCall(output_ref, target_lost, finish)

    def encode_context(self, inputs: EncodeInput) -> ContextHandle:
        # The features go target -> drafter: the ObjectRef is the handle (a failure shows in
        # the draft that resolves it, and in the next target call).
        context_ref = self._actor.encode_context.remote(to_wire(inputs))
        self._send_features(context_ref, inputs.slots)
        return context_ref

    async def check_alive(self) -> None:
        """Raises `TargetUnavailableError` when the worker is gone, or restarted and waiting for
        a new engine (health checks; waits its turn behind the step in progress, and for a
        restart Ray is running)."""
        try:
            info = await self._actor.describe.remote()
        except RayActorError as error:
            raise target_lost(error) from error
        if not info["serving"]:
            raise TargetUnavailableError(_RESTARTED)

    def release(self, slot: int) -> None:
        # Fire and forget: calls from one caller run in submission order on the actor, so a
        # later prefill into this slot always sees it released.
        self._actor.release.remote(slot)


class RayDrafter:
    """`Drafter` over a `DrafterWorker` handle; forwards context ObjectRefs without fetching them."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor
        info = _describe_restarted(actor)
        self._block_size: int = info["block_size"]
        self.device_uuid: str | None = info["device_uuid"]
        self._probe: Any = None  # after a loss: the pending `describe` call that says it is back

    @property
    def actor(self) -> Any:
        return self._actor

    @property
    def block_size(self) -> int:
        return self._block_size

    def is_available(self) -> bool:
        """A `describe` call waits, unblocking, for the restarted actor; True once it answered."""
        if self._probe is None:
            self._probe = self._actor.describe.remote()
        ready, _ = ray.wait([self._probe], timeout=0)
        if not ready:
            return False
        probe, self._probe = self._probe, None
        try:
            ray.get(probe)
        except RayActorError:
            return False  # still restarting, or gone for good: ask again next step
        return True

    def draft(self, inputs: DraftInput) -> DraftOutput:
        return self.submit_draft(inputs).result()

    def submit_draft(self, inputs: DraftInput) -> Pending[DraftOutput]:
        # Distinct producing calls in order (ObjectRefs hash and compare by object id); each
        # slice travels as (position of its call's ref among the top-level arguments, index).
        position: dict[Any, int] = {}
        for slices in inputs.contexts:
            for context in slices:
                position.setdefault(context.handle, len(position))
        pointers = [[ContextSlice(position[c.handle], c.index) for c in slices] for slices in inputs.contexts]
        wired = to_wire(dataclasses.replace(inputs, contexts=pointers))
        handles = list(position)
        return _PendingCall(self._actor.draft.remote(wired, *handles), _drafter_lost)

    def take_features(self, context_ref: Any, slots: Any) -> None:
        """Fire and forget, like `release`: the worker runs it before any later draft of this
        caller, so every draft that names the context finds it taken."""
        self._actor.take_features.remote(context_ref, tuple(int(slot) for slot in slots))

    def release(self, slot: int) -> None:
        self._actor.release.remote(slot)

    def release_all(self, num_slots: int) -> None:
        """Release slots `0 .. num_slots - 1` and wait: a new engine starts with a drafter that
        holds no context."""
        # A drafter that died meanwhile holds nothing either; the engine finds it lost at its draft.
        with contextlib.suppress(RayActorError):
            ray.get([self._actor.release.remote(slot) for slot in range(num_slots)])


class _PendingCall(Generic[ResultT]):
    """One actor call in flight: `result()` waits for it, unwires it and maps a lost actor."""

    def __init__(
        self,
        ref: Any,
        lost: Callable[[Exception], Exception],
        finish: Callable[[Any], Any] = lambda output: output,
    ) -> None:
        self._ref = ref
        self._lost = lost
        self._finish = finish

    def result(self) -> ResultT:
        try:
            wired = ray.get(self._ref)
        except TargetRestartedError as error:  # also a drafter call fed by a restarted target's ref
            raise target_lost(error) from error
        except RayActorError as error:
            raise self._lost(error) from error
        return self._finish(from_wire(wired))


def _describe_restarted(actor: Any) -> dict[str, Any]:
    """The worker's `describe`, asked again while Ray restarts it (the calls sent meanwhile fail
    with `ActorUnavailableError`); `ActorDiedError` once it is dead for good."""
    while True:
        try:
            return ray.get(actor.describe.remote())
        except ActorUnavailableError:
            time.sleep(_RESTART_POLL_S)


def _device_uuid(model: Any) -> str | None:
    """The GPU of a worker's model: `TargetStep` and `DraftStep` say where they run; a model that
    does not (a test's fake) takes the host path."""
    return cuda_device_uuid(getattr(model, "device", None))


def _drafter_lost(error: Exception) -> DrafterUnavailableError:
    return DrafterUnavailableError(f"the drafter worker is lost ({type(error).__name__})")


def target_lost(error: Exception) -> TargetUnavailableError:
    """The seam's error for a target call that failed because its worker died or restarted."""
    # Ray's own text runs to many lines; the chained cause keeps it for the logs.
    if isinstance(error, TargetRestartedError):
        return TargetUnavailableError(_RESTARTED)
    return TargetUnavailableError(f"the target worker died ({type(error).__name__})")
