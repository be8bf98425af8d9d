"""Ray actors that own the models, and the adapters that make them look like the engine's seam.

`TargetWorker` / `DrafterWorker` hold the target's and the drafter's half of the step
(`TargetStep` / `DraftStep`, or any `Target` / `Drafter`) built by a factory, so tests inject
fakes and the engine decides how models load. `RayTarget` / `RayDrafter`
implement the same protocols in the Coordinator over the actor handles: the `SpecEngine` loop
runs unchanged, Ray only adds transport.

Context features never enter the Coordinator: `prefill` and `verify` have `num_returns=2`, the
second return being the features, whose `ObjectRef` the engine forwards untouched inside its
`ContextSlice`s; `RayDrafter` hands each distinct ref to `DrafterWorker.draft` as a top-level
argument, so Ray resolves it into the drafter's process before the call runs. (Ray inlines
return values under `max_direct_call_object_size`, 100 KiB by default, into the caller's
memory: a toy model's few-KiB features do pass through the Coordinator's memory; real models'
features, taps x hidden x accepted tokens, go through the object store target -> drafter.)
Tensors cross every actor boundary as numpy arrays (`wire.py`: several times cheaper in Ray).
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray
import torch

from ddtree_serve.engine.interfaces import (
    ContextSlice,
    Drafter,
    DraftOutput,
    PrefillOutput,
    SamplingBatch,
    Target,
    VerifyOutput,
)
from ddtree_serve.serve.wire import from_wire, to_wire

if TYPE_CHECKING:
    from ddtree_serve.tree import VerifyBatch

TargetFactory = Callable[[], Target]
DrafterFactory = Callable[[], Drafter]


@ray.remote
class TargetWorker:
    """Holds the target model and every slot's KV cache on its device(s)."""

    def __init__(self, build_target: TargetFactory) -> None:
        self._target = build_target()

    def describe(self) -> dict[str, Any]:
        return {
            "vocab_size": self._target.vocab_size,
            "eos_token_ids": tuple(self._target.eos_token_ids),
            "max_seq_len": self._target.max_seq_len,
        }

    @ray.method(num_returns=2)
    def prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: SamplingBatch,
        coins: torch.Tensor | None,
    ) -> tuple[Any, Any]:
        output = self._target.prefill(slots, prompts, from_wire(sampling), from_wire(coins))
        return to_wire(output.first_tokens), to_wire(output.context)

    @ray.method(num_returns=2)
    def verify(
        self,
        slots: Sequence[int],
        batch: "VerifyBatch",
        sampling: SamplingBatch,
        coins: torch.Tensor | None,
        coin_final: torch.Tensor | None,
        return_context: bool,
    ) -> tuple[Any, Any]:
        output = self._target.verify(
            slots,
            from_wire(batch),
            from_wire(sampling),
            from_wire(coins),
            from_wire(coin_final),
            return_context,
        )
        return to_wire(dataclasses.replace(output, context=None)), to_wire(output.context)

    def release(self, slot: int) -> None:
        self._target.release(slot)


@ray.remote
class DrafterWorker:
    """Holds the DFlash drafter and every slot's context features on its device."""

    def __init__(self, build_drafter: DrafterFactory) -> None:
        self._drafter = build_drafter()

    def describe(self) -> dict[str, Any]:
        return {"block_size": self._drafter.block_size}

    def draft(
        self,
        slots: Sequence[int],
        bonus_tokens: Any,
        pointers: Sequence[tuple[int, int]],
        top_k: int,
        *handles: Any,
    ) -> Any:
        """`pointers[i] = (h, j)`: request i's context is entry j of `handles[h]`.

        `handles` are the target calls' context results, resolved by Ray from the ObjectRefs
        the coordinator passed (one per distinct producing call)."""
        features = [from_wire(handle) for handle in handles]
        contexts = [ContextSlice(features[h], j) for h, j in pointers]
        return to_wire(self._drafter.draft(slots, from_wire(bonus_tokens), contexts, top_k))

    def release(self, slot: int) -> None:
        self._drafter.release(slot)


class RayTarget:
    """`Target` over a `TargetWorker` handle; blocks the engine thread on each step's result."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor
        info = ray.get(actor.describe.remote())
        self._vocab_size: int = info["vocab_size"]
        self._eos_token_ids: tuple[int, ...] = info["eos_token_ids"]
        self._max_seq_len: int = info["max_seq_len"]

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    def prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: SamplingBatch,
        coins: torch.Tensor | None,
    ) -> PrefillOutput:
        first_tokens_ref, context_ref = self._actor.prefill.remote(
            list(slots), prompts, to_wire(sampling), to_wire(coins)
        )
        return PrefillOutput(first_tokens=from_wire(ray.get(first_tokens_ref)), context=context_ref)

    def verify(
        self,
        slots: Sequence[int],
        batch: "VerifyBatch",
        sampling: SamplingBatch,
        coins: torch.Tensor | None,
        coin_final: torch.Tensor | None,
        return_context: bool,
    ) -> VerifyOutput:
        output_ref, context_ref = self._actor.verify.remote(
            list(slots),
            to_wire(batch),
            to_wire(sampling),
            to_wire(coins),
            to_wire(coin_final),
            return_context,
        )
        output: VerifyOutput = from_wire(ray.get(output_ref))
        return dataclasses.replace(output, context=context_ref if return_context else None)

    def release(self, slot: int) -> None:
        # Fire and forget: calls from one caller run in submission order on the actor, so a
        # later prefill into this slot always sees it released.
        self._actor.release.remote(slot)


class RayDrafter:
    """`Drafter` over a `DrafterWorker` handle; forwards context ObjectRefs without fetching them."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor
        self._block_size: int = ray.get(actor.describe.remote())["block_size"]

    @property
    def block_size(self) -> int:
        return self._block_size

    def draft(
        self,
        slots: Sequence[int],
        bonus_tokens: torch.Tensor,
        contexts: Sequence[ContextSlice],
        top_k: int,
    ) -> DraftOutput:
        # Distinct producing calls in order (ObjectRefs hash and compare by object id).
        position: dict[Any, int] = {}
        for context in contexts:
            position.setdefault(context.handle, len(position))
        pointers = [(position[context.handle], context.index) for context in contexts]
        handles = list(position)
        draft_ref = self._actor.draft.remote(list(slots), to_wire(bonus_tokens), pointers, top_k, *handles)
        return from_wire(ray.get(draft_ref))

    def release(self, slot: int) -> None:
        self._actor.release.remote(slot)
