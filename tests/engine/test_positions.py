"""Positions have one owner: drafter context == target cache == the request's cached tokens.

A long mixed batch (requests joining and leaving, slots reused, an abort, greedy and sampled
requests) runs in chain and ddtree mode over the real models. The counts are read from the
models' own caches, not from what the engine was told, after every step and inside every
draft (where the drafter has just taken its new context).
"""

import pytest

from ddtree_serve.engine.draft_step import DraftStep
from ddtree_serve.engine.interfaces import DraftInput, DraftOutput
from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.engine.target_step import TargetStep


class CheckingDrafter:
    """Wraps the engine's `DraftStep`; after each draft, compares both models' caches per slot."""

    def __init__(self, inner: DraftStep, target: TargetStep) -> None:
        self.inner = inner
        self.target = target
        self.mismatches: list[tuple[int, int, int]] = []  # (slot, drafter context, target cache)
        self.num_checked = 0

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    def draft(self, inputs: DraftInput) -> DraftOutput:
        output = self.inner.draft(inputs)
        for slot in inputs.slots:
            context_len, cache_len = self.inner.drafter.context_len(slot), self.target.runner.seq_len(slot)
            self.num_checked += 1
            if context_len != cache_len:
                self.mismatches.append((slot, context_len, cache_len))
        return output

    def release(self, slot: int) -> None:
        self.inner.release(slot)


def pending_rows(request) -> int:
    """Rows of context the drafter has not taken yet (in process: a list of feature tensors)."""
    return sum(int(c.handle[c.index].shape[0]) for c in request.pending_contexts)


def check_after_step(engine: SpecEngine, drafter: CheckingDrafter) -> int:
    """Every running slot: target cache == request.num_cached_tokens == drafter context + pending."""
    checked = 0
    for request in engine.scheduler.running:
        if request.finished:
            continue
        slot = request.slot
        cache_len = engine.target.runner.seq_len(slot)
        context_len = drafter.inner.drafter.context_len(slot)
        assert cache_len == request.num_cached_tokens, (request.request_id, cache_len)
        assert context_len + pending_rows(request) == cache_len, (request.request_id, context_len)
        # The newest token is never cached: prompt + output - 1 tokens sit in the cache.
        assert cache_len == request.num_prompt_tokens + len(request.output_token_ids) - 1
        checked += 1
    return checked


@pytest.mark.parametrize(("mode", "budget"), [("chain", 1), ("ddtree", 6)])
def test_drafter_context_equals_target_cache_after_every_step(make_pair_config, prompt_ids, mode, budget):
    engine = build_local_engine(make_pair_config(mode=mode, budget=budget, max_num_seqs=3))
    drafter = CheckingDrafter(engine.drafter, engine.target)
    engine.drafter = drafter
    prompts = [p[: 3 + i] for i, p in enumerate(prompt_ids * 3)]  # 9 prompts of varied lengths
    joins = {0: [0, 1], 2: [2, 3, 4], 5: [5], 9: [6, 7], 14: [8]}  # step -> requests that join
    step, num_checked, aborted = 0, 0, False
    while step == 0 or engine.has_unfinished_requests() or step <= max(joins):
        for i in joins.get(step, []):
            sampled = i % 2 == 1
            params = SamplingParams(
                max_tokens=6 + 5 * (i % 4),
                temperature=0.8 if sampled else 0.0,
                seed=100 + i if sampled else None,
                ignore_eos=i % 3 != 0,
            )
            engine.add_request(str(i), prompts[i], params)
        engine.step()
        if step == 6 and not aborted and engine.num_running > 1:
            engine.abort_request(engine.scheduler.running[0].request_id)  # leaves mid-generation
            aborted = True
        num_checked += check_after_step(engine, drafter)
        step += 1
    assert aborted and num_checked > 3 * len(prompts)
    assert drafter.mismatches == [] and drafter.num_checked > 3 * len(prompts)
