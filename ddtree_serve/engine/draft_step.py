"""`DraftStep`: the drafter's half of a decoding step, whichever transport calls it.

It owns a `DFlashDrafter`: appends each slot's new context features, drafts the next block
and returns its top-K where the drafter runs (no copy here: the engine's tree builder takes
it to the host in one copy or builds where it lies; over Ray the transport moves it). In
process the engine calls it directly; over Ray a `DrafterWorker` holds one and adds only
transport. It reads context handles made by
`TargetStep` (lists of tensors, one per request).
"""

from collections.abc import Sequence

import torch

from ddtree_serve.engine.interfaces import ContextSlice, DraftInput, DraftOutput
from ddtree_serve.engine.timing import Stage, StageTimer
from ddtree_serve.models import DFlashDrafter
from ddtree_serve.tree import draft_topk


class DraftStep:
    """`Drafter` over a `DFlashDrafter` in this process; returns top-K on the drafter's device."""

    def __init__(self, drafter: DFlashDrafter, timer: StageTimer | None = None) -> None:
        self.drafter = drafter
        self.timer = timer or StageTimer()

    @property
    def block_size(self) -> int:
        return int(self.drafter.block_size)

    @property
    def device(self) -> torch.device:
        """Where the drafter runs (a worker on the target's GPU takes features by handle)."""
        return self.drafter.device

    def draft(self, inputs: DraftInput) -> DraftOutput:
        slots = list(inputs.slots)
        new_context = [_joined(slices) for slices in inputs.contexts]  # each [n_b, F]
        with self.timer.stage(Stage.DRAFT_FORWARD):
            logits = self.drafter.draft(slots, inputs.bonus_tokens, new_context)  # [B, L, V]
        logp, ids = draft_topk(logits, inputs.top_k)  # [B, L, K]
        return DraftOutput(
            logp=logp,
            ids=ids,
            num_context_tokens=tuple(self.drafter.context_len(slot) for slot in slots),
        )

    def is_available(self) -> bool:
        return True  # in this process: it never goes away alone

    def release(self, slot: int) -> None:
        self.drafter.release(slot)


def _joined(slices: Sequence[ContextSlice]) -> torch.Tensor:
    """One request's new context features in commit order: `[n_b, F]` (no copy for one slice)."""
    features = [context.handle[context.index] for context in slices]
    return features[0] if len(features) == 1 else torch.cat(features)
