"""The start-up cost calibration's probe against the served drafter's context contract.

A served target delivers each slot's context features to the drafter's worker with every call
that caches tokens (a prefill, a verify's commit), and the worker keeps them until a draft of
the slot takes them or the slot is released. The probe prefills scratch slots for every timed
call: it must leave no slot with features no draft will take, or the next draft of that slot
meets more deliveries than context slices (the served engine's calibration failed so).
"""

from collections import Counter

from ddtree_serve.engine.budget.measure import ModelCostProbe, measure_cost_curve
from ddtree_serve.engine.builder import build_draft_step, build_target_step
from ddtree_serve.engine.interfaces import DraftInput, DraftOutput, PrefillInput, PrefillOutput, VerifyInput


class DeliveringTarget:
    """The in-process target, counting each call's context deliveries per slot as a served one
    makes them."""

    def __init__(self, inner, delivered: Counter) -> None:
        self.inner, self.delivered = inner, delivered
        self.vocab_size, self.eos_token_ids = inner.vocab_size, inner.eos_token_ids
        self.max_seq_len, self.verify_token_buckets = inner.max_seq_len, inner.verify_token_buckets

    def prefill(self, inputs: PrefillInput) -> PrefillOutput:
        self.delivered.update(inputs.slots)
        return self.inner.prefill(inputs)

    def verify_and_commit(self, inputs: VerifyInput):
        self.delivered.update(inputs.slots)
        return self.inner.verify_and_commit(inputs)

    def release(self, slot: int) -> None:
        self.inner.release(slot)


class DeliveryCheckingDrafter:
    """The in-process drafter, taking each slot's deliveries at its draft, as `DrafterWorker`
    does: their count must be the draft's context slices for the slot; a release drops them."""

    def __init__(self, inner, delivered: Counter) -> None:
        self.inner, self.delivered = inner, delivered

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    def draft(self, inputs: DraftInput) -> DraftOutput:
        for slot, contexts in zip(inputs.slots, inputs.contexts, strict=True):
            deliveries = self.delivered.pop(slot, 0)
            assert deliveries == len(contexts), (
                f"slot {slot}: {deliveries} deliveries for {len(contexts)} slices"
            )
        return self.inner.draft(inputs)

    def release(self, slot: int) -> None:
        self.delivered.pop(slot, None)
        self.inner.release(slot)


def test_the_probe_leaves_no_delivered_context_behind(make_pair_config):
    config = make_pair_config(mode="ddtree", budget=8, max_num_seqs=4)
    delivered: Counter = Counter()
    target = DeliveringTarget(build_target_step(config), delivered)
    drafter = DeliveryCheckingDrafter(build_draft_step(config), delivered)
    probe = ModelCostProbe(target, drafter, top_k=8)
    curve = measure_cost_curve(probe, [1, 2, 4], [1, 4, 9], repeats=1)
    assert curve.draft_ms(4) > 0.0
    assert not +delivered  # every slot released on both sides
