"""A lost drafter loses nothing: the engine decodes plainly, then resumes speculating.

`FlakyDrafter` wraps the real drafter (or the oracle) and "dies" on chosen draft calls: the
call raises `DrafterUnavailableError`, its context is gone, and it answers `is_available`
False for a few polls before coming back as a fresh drafter (or, for a transient loss, as the
old one with its stale context). Greedy output must equal plain greedy decoding, the engine
itself checks drafter context == target cache at every draft, and speculation must resume.
"""

import json
from collections.abc import Callable

import pytest
import torch

from ddtree_serve.engine.builder import build_draft_step, build_target_step
from ddtree_serve.engine.interfaces import (
    Drafter,
    DrafterUnavailableError,
    DraftInput,
    DraftOutput,
    EncodeInput,
    PrefillInput,
    SamplingBatch,
)
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.models import load_tokenizer
from tests.engine.conftest import REFERENCE_TOKENS, run_to_completion
from tests.engine.fakes import OracleDrafter

GREEDY = SamplingParams(max_tokens=REFERENCE_TOKENS, ignore_eos=True)


class FlakyDrafter:
    """A `Drafter` that dies on the draft calls numbered in `die_at_calls` (1-based).

    After a death it is unavailable for `polls_until_back` polls of `is_available`, then comes
    back: a new drafter from `make_drafter` (a restarted process), or with `keep_state` the old
    one with whatever context it held (a transient loss).
    """

    def __init__(
        self,
        make_drafter: Callable[[], Drafter],
        die_at_calls: set[int],
        polls_until_back: int,
        keep_state: bool = False,
    ) -> None:
        self._make_drafter = make_drafter
        self.inner = make_drafter()
        self._block_size = self.inner.block_size
        self.die_at_calls = die_at_calls
        self.polls_until_back = polls_until_back
        self.keep_state = keep_state
        self.num_calls = 0
        self.num_returns = 0
        self.calls_while_down = 0
        self._polls_left: int | None = None  # None: up
        # Per successful draft: whether it came after a return, and the contexts it reported.
        self.drafts: list[tuple[int, tuple[int, ...]]] = []

    @property
    def block_size(self) -> int:
        return self._block_size

    def draft(self, inputs: DraftInput) -> DraftOutput:
        if self._polls_left is not None:
            self.calls_while_down += 1
            raise DrafterUnavailableError("the drafter is still down")
        self.num_calls += 1
        if self.num_calls in self.die_at_calls:
            self._polls_left = self.polls_until_back
            raise DrafterUnavailableError("the drafter process died")
        output = self.inner.draft(inputs)
        self.drafts.append((self.num_returns, output.num_context_tokens))
        return output

    def is_available(self) -> bool:
        if self._polls_left is None:
            return True
        if self._polls_left > 0:
            self._polls_left -= 1
            return False
        if not self.keep_state:
            self.inner = self._make_drafter()
        self._polls_left = None
        self.num_returns += 1
        return True

    def release(self, slot: int) -> None:
        if self._polls_left is not None:
            self.calls_while_down += 1
            raise DrafterUnavailableError("the drafter is still down")
        self.inner.release(slot)


@pytest.fixture(scope="module")
def real_engine_factory(make_pair_config, pair_dirs):
    """SpecEngine over the real target and a `FlakyDrafter` around the real drafter."""

    def make(max_num_seqs: int, **flaky) -> tuple[SpecEngine, FlakyDrafter]:
        config = make_pair_config(mode="ddtree", budget=6, max_num_seqs=max_num_seqs)
        drafter = FlakyDrafter(lambda: build_draft_step(config), **flaky)
        engine = SpecEngine(
            config.to_settings(), build_target_step(config), drafter, load_tokenizer(pair_dirs[0])
        )
        return engine, drafter

    return make


def run_with_joins(engine: SpecEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Requests join one by one, two steps apart, then run to the end."""
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, GREEDY)
        for _ in range(2):
            outputs.update({o.request_id: list(o.token_ids) for o in engine.step() if o.finished})
    outputs.update(run_to_completion(engine))
    return outputs


@pytest.mark.parametrize(
    ("die_at_calls", "keep_state"),
    [({2}, False), ({1, 4}, False), ({3}, True)],
    ids=["one-loss", "loss-at-first-draft-and-again", "transient-loss-keeps-stale-state"],
)
def test_real_drafter_lost_midway_matches_plain_greedy_and_resumes(
    real_engine_factory, prompt_ids, greedy_references, die_at_calls, keep_state
):
    engine, drafter = real_engine_factory(
        max_num_seqs=2, die_at_calls=die_at_calls, polls_until_back=3, keep_state=keep_state
    )
    outputs = run_with_joins(engine, prompt_ids)
    for i, prompt in enumerate(prompt_ids):
        assert [*prompt, *outputs[str(i)]] == greedy_references[tuple(prompt)]
    assert drafter.calls_while_down == 0  # a lost drafter is polled, never called
    assert drafter.num_returns == len(die_at_calls) == engine.num_drafter_losses
    # Drafts after the last return happened, and each saw exactly the target's cached text
    # (the engine raises otherwise; here the lengths are also positive and whole).
    resumed = [contexts for returns, contexts in drafter.drafts if returns == len(die_at_calls)]
    assert resumed and all(n > 0 for contexts in resumed for n in contexts)
    assert engine.speculating


def test_speculation_resumes_after_the_loss(make_oracle_engine, prompt_ids, greedy_references):
    """With the oracle, trees are deep before the loss, root-only during it, deep again after."""
    engine, target = make_oracle_engine("ddtree", budget=8, max_num_seqs=3)
    oracle = engine.drafter
    assert isinstance(oracle, OracleDrafter)
    flaky = FlakyDrafter(
        lambda: OracleDrafter(target, oracle.references, oracle.vocab_size), {3}, polls_until_back=2
    )
    engine.drafter = flaky
    for i, prompt in enumerate(prompt_ids):
        engine.add_request(str(i), prompt, GREEDY)
    speculating: list[bool] = []
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: list(o.token_ids) for o in engine.step() if o.finished})
        speculating.append(engine.speculating)
    nodes_per_request = [
        n / b for n, b in zip(target.verify_num_nodes, target.verify_batch_sizes, strict=True)
    ]
    # Steps 1-2 drafted, step 3 lost the drafter, steps 4-5 polled it, step 6 drafted again.
    assert speculating[:6] == [True, True, False, False, False, True]
    assert min(nodes_per_request[:2]) > 1 and nodes_per_request[2:5] == [1.0, 1.0, 1.0]
    assert max(nodes_per_request[5:]) > 1
    for i, prompt in enumerate(prompt_ids):
        assert [*prompt, *outputs[str(i)]] == greedy_references[tuple(prompt)]


def test_a_drafter_that_never_returns_leaves_plain_decoding(
    real_engine_factory, prompt_ids, greedy_references
):
    engine, drafter = real_engine_factory(max_num_seqs=3, die_at_calls={1}, polls_until_back=10**9)
    outputs = run_with_joins(engine, prompt_ids)
    for i, prompt in enumerate(prompt_ids):
        assert [*prompt, *outputs[str(i)]] == greedy_references[tuple(prompt)]
    assert drafter.calls_while_down == 0 and not engine.speculating


def test_encode_context_equals_the_prefill_features_and_leaves_the_cache_alone(make_pair_config):
    target = build_target_step(make_pair_config(mode="ddtree", max_num_seqs=2))
    greedy = SamplingBatch(
        temperature=torch.zeros(1),
        top_k=torch.zeros(1, dtype=torch.int64),
        top_p=torch.ones(1),
        all_greedy=True,
    )
    prompt = [5, 6, 7, 8, 9, 10, 11]
    prefill = target.prefill(PrefillInput([1], [prompt], greedy, None))
    cache = target.runner.cache
    keys_before, values_before = cache.keys.clone(), cache.values.clone()
    (features,) = target.encode_context(EncodeInput([1], [prompt]))
    torch.testing.assert_close(features, prefill.context[0])
    assert target.runner.seq_len(1) == len(prompt) and target.runner.seq_len(0) == 0
    assert torch.equal(cache.keys, keys_before) and torch.equal(cache.values, values_before)
    with pytest.raises(ValueError, match="caches 7 tokens"):
        target.encode_context(EncodeInput([1], [prompt[:-1]]))


def test_an_adaptive_engine_learns_no_cost_from_a_restored_drafters_first_draft(
    make_pair_config, pair_dirs, prompt_ids, greedy_references, tmp_path
):
    """A drafter back from a loss takes every request's whole context in its first draft: the
    adaptive policy must not learn that call as what a draft costs. Greedy output still equals
    plain greedy decoding."""
    cost = tmp_path / "free_nodes.json"
    cost.write_text(json.dumps({"tokens": [1, 64], "ms": [5.0, 5.0], "draft_ms": 0.5}))
    config = make_pair_config(
        mode="ddtree", budget=6, max_num_seqs=2, budget_policy="adaptive", cost_curve=str(cost)
    )
    drafter = FlakyDrafter(lambda: build_draft_step(config), die_at_calls={3}, polls_until_back=2)
    tokenizer = load_tokenizer(pair_dirs[0])
    engine = SpecEngine(config.to_settings(), build_target_step(config), drafter, tokenizer)
    policy = engine.budget_policy
    flags: list[tuple[int, bool]] = []  # (drafter returns so far, catching up) per timed draft
    record = policy.record_draft_ms

    def recording(draft_ms: float, catching_up: bool = False, with_plan: bool = False) -> None:
        flags.append((drafter.num_returns, catching_up))
        record(draft_ms, catching_up, with_plan)

    policy.record_draft_ms = recording
    outputs = run_with_joins(engine, prompt_ids)
    for i, prompt in enumerate(prompt_ids):
        assert [*prompt, *outputs[str(i)]] == greedy_references[tuple(prompt)]
    after_return = [catching_up for returns, catching_up in flags if returns == 1]
    assert drafter.num_returns == 1 and after_return and after_return[0]
