"""One step graph's target call on the target model, wherever that model lives.

The target actor (`workers.TargetWorker`) runs each `TargetCall` of the step graph the same way
as a target inside the Coordinator replica (`placement.workers: target_in_coordinator`,
`local_target.py`) does: the slots released since the last call first, then the seam method,
then the drafter's `ContextDelivery` of its features. The one difference is the wire: an actor's
call arrives wired and its output leaves wired (`wire.py`), while a target in the Coordinator's
own process takes the engine's values as they are and hands its output back untouched; its
features still go to the drafter's process, so they are wired either way.
"""

import contextlib
import dataclasses
from typing import Any

from ddtree_serve.engine.interfaces import ContextHandle, Target
from ddtree_serve.serve.call_trace import CallTrace, mark
from ddtree_serve.serve.device_features import wire_features
from ddtree_serve.serve.graph_calls import ContextDelivery, TargetCall
from ddtree_serve.serve.wire import from_wire, to_wire


class TargetCallRunner:
    """Runs `TargetCall`s on one target and keeps the last output for a replay."""

    def __init__(self, target: Target, wired: bool, trace: CallTrace | None = None) -> None:
        """`wired`: calls arrive and outputs leave as `to_wire` values (the target actor);
        `trace`: the worker's call stamps (`call_trace.py`), if it keeps any."""
        self._target = target
        self._trace = trace
        self._wired = wired
        # (call id, output) of the last call, for `replay` after the graph broke.
        self._last_call: tuple[int | None, Any] = (None, None)
        # Context features stay on this GPU behind a handle (the drafter shares it), or go
        # through host memory (the default); a call's features below `_device_min_bytes` go
        # through host memory anyway.
        self._features_on_device = False
        self._device_min_bytes = 0

    def deliver_features_on_device(self, min_bytes: int = 0) -> None:
        """From now on, send context features as CUDA IPC handles (`device_features.py`): the
        drafter's model lies on this target's GPU. `min_bytes`: a call's features below it go
        through host memory (`placement.features: auto`)."""
        self._features_on_device = True
        self._device_min_bytes = min_bytes

    @property
    def features_on_device(self) -> bool:
        return self._features_on_device

    def wire_features(self, features: ContextHandle) -> Any:
        """A call's context features as they cross to the drafter's process."""
        return wire_features(features, self._features_on_device, self._device_min_bytes)

    def run(self, call: TargetCall | None, deliver: bool) -> tuple[Any, ContextDelivery | None]:
        """One execution's target call -> (output without context, the drafter's delivery).

        `deliver` False: no features (no drafter takes them, and a device handle never opened
        would keep its block)."""
        if call is None:
            return None, None
        trace = self._trace
        stamping = contextlib.nullcontext() if trace is None else trace.call(f"graph_call:{call.method}")
        with stamping as stamps:
            for slot in call.releases:
                self._target.release(slot)
            result: tuple[Any, ContextDelivery | None] = (None, None)
            if call.method is not None:
                inputs = from_wire(call.inputs) if self._wired else call.inputs
                mark(stamps, "unwire")
                output = getattr(self._target, call.method)(inputs)
                mark(stamps, "model")
                if call.method == "encode_context":
                    result = None, self._delivery(inputs.slots, output) if deliver else None
                else:
                    wants_context = deliver and (call.method == "prefill" or inputs.return_context)
                    bonus = output.bonus_token.tolist() if call.method == "verify_and_commit" else None
                    context = self._delivery(inputs.slots, output.context, bonus) if wants_context else None
                    bare = dataclasses.replace(output, context=None)
                    result = (to_wire(bare) if self._wired else bare), context
                mark(stamps, "wire")
            self._last_call = (call.call_id, result[0])
            return result

    def replay(self, call: TargetCall) -> Any:
        """The output of `call` without the graph (its drafter is lost): kept if it ran (the
        execution that broke), else run now, without features."""
        last_id, output = self._last_call
        if last_id == call.call_id:
            return output
        return self.run(call, deliver=False)[0]

    def _delivery(
        self, slots: Any, context: ContextHandle, bonus_tokens: list[int] | None = None
    ) -> ContextDelivery:
        bonus = None if bonus_tokens is None else tuple(bonus_tokens)
        return ContextDelivery(tuple(slots), self.wire_features(context), bonus)
