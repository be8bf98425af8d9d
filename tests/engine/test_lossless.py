"""Greedy speculative decoding emits exactly the target's own greedy tokens, in every mode."""

import pytest

from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.sampling_params import SamplingParams
from tests.engine.conftest import REFERENCE_TOKENS, run_joining_midway, run_to_completion

GREEDY = SamplingParams(max_tokens=REFERENCE_TOKENS, ignore_eos=True)


@pytest.mark.parametrize(
    ("mode", "budget"), [("ar", 1), ("chain", 1), ("ddtree", 1), ("ddtree", 4), ("ddtree", 16)]
)
def test_one_request_at_a_time_matches_plain_greedy(
    make_oracle_engine, prompt_ids, greedy_references, mode, budget
):
    engine, target = make_oracle_engine(mode, budget=budget, max_num_seqs=1)
    for i, prompt in enumerate(prompt_ids):
        engine.add_request(str(i), prompt, GREEDY)
    outputs = run_to_completion(engine)
    for i, prompt in enumerate(prompt_ids):
        assert [*prompt, *outputs[str(i)]] == greedy_references[tuple(prompt)]
    assert max(target.verify_batch_sizes) == 1
    if mode != "ar":
        # The oracle drafts well, so whole paths are accepted: the check exercises deep commits.
        tokens_per_step = len(prompt_ids) * (REFERENCE_TOKENS - 1) / len(target.verify_batch_sizes)
        assert tokens_per_step > 1.5


@pytest.mark.parametrize(("mode", "budget"), [("chain", 1), ("ddtree", 8)])
def test_batched_with_requests_joining_midway_matches_plain_greedy(
    make_oracle_engine, prompt_ids, greedy_references, mode, budget
):
    engine, target = make_oracle_engine(mode, budget=budget, max_num_seqs=3)
    outputs = run_joining_midway(engine, prompt_ids, GREEDY)
    for i, prompt in enumerate(prompt_ids):
        assert [*prompt, *outputs[str(i)]] == greedy_references[tuple(prompt)]
    assert sorted(set(target.verify_batch_sizes)) == [1, 2, 3]


def test_real_drafter_batched_ddtree_matches_plain_greedy(make_pair_config, prompt_ids, greedy_references):
    engine = build_local_engine(make_pair_config(mode="ddtree", budget=6, max_num_seqs=2))
    for i, prompt in enumerate(prompt_ids):
        engine.add_request(str(i), prompt, GREEDY)
    outputs = run_to_completion(engine)
    for i, prompt in enumerate(prompt_ids):
        assert [*prompt, *outputs[str(i)]] == greedy_references[tuple(prompt)]
