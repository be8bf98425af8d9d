"""`DraftStep`: the drafter's half of a decoding step, whichever transport calls it.

It owns a `DFlashDrafter`: appends each slot's new context features, drafts the next block
and returns its top-K on the host in one copy. In process the engine calls it directly; over
Ray a `DrafterWorker` holds one and adds only transport. It reads context handles made by
`TargetStep` (lists of tensors, one per request).
"""

import torch

from ddtree_serve.engine.interfaces import DraftInput, DraftOutput
from ddtree_serve.engine.timing import Stage, StageTimer
from ddtree_serve.models import DFlashDrafter
from ddtree_serve.tree import draft_topk


class DraftStep:
    """`Drafter` over a `DFlashDrafter` in this process; returns top-K on the host."""

    def __init__(self, drafter: DFlashDrafter, timer: StageTimer | None = None) -> None:
        self.drafter = drafter
        self.timer = timer or StageTimer()

    @property
    def block_size(self) -> int:
        return int(self.drafter.block_size)

    def draft(self, inputs: DraftInput) -> DraftOutput:
        slots = list(inputs.slots)
        new_context = [context.handle[context.index] for context in inputs.contexts]  # each [n_b, F]
        with self.timer.stage(Stage.DRAFT_FORWARD):
            logits = self.drafter.draft(slots, inputs.bonus_tokens, new_context)  # [B, L, V]
        logp, ids = draft_topk(logits, inputs.top_k)  # [B, L, K]
        packed = torch.cat([logp, ids.to(logp.dtype)], dim=-1).cpu()  # one copy; ids < 2^24 exact
        k = logp.shape[-1]
        return DraftOutput(
            logp=packed[..., :k].contiguous(),
            ids=packed[..., k:].long(),
            num_context_tokens=tuple(self.drafter.context_len(slot) for slot in slots),
        )

    def is_available(self) -> bool:
        return True  # in this process: it never goes away alone

    def release(self, slot: int) -> None:
        self.drafter.release(slot)
