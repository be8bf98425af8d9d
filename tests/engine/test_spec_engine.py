"""SpecEngine request handling: validation, aborts, slot release, stats and timing."""

import pytest

from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(make_pair_config):
    return build_local_engine(
        make_pair_config(mode="ddtree", budget=4, max_num_seqs=2, max_seq_len=64, record_timings=True)
    )


def test_invalid_requests_are_refused(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("oov", [engine.vocab_size], SamplingParams())
    with pytest.raises(ValueError, match="no room"):
        engine.add_request("long", [1] * 64, SamplingParams())
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1, 2], SamplingParams())
    while engine.has_unfinished_requests():
        engine.step()


def test_abort_running_and_waiting_requests_frees_their_slots(engine):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for name in ("a", "b", "c"):
        engine.add_request(name, [1, 2, 3], params)
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 1
    engine.abort_request("a")  # running
    engine.abort_request("c")  # waiting
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["a"].finish_reason == "abort" and outputs["c"].finish_reason == "abort"
    assert engine.num_running == 1 and engine.num_waiting == 0
    engine.abort_request("b")
    engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.num_free_slots == 2


def test_output_length_is_capped_by_max_seq_len_and_stats_add_up(engine):
    engine.add_request("long", [1] * 20, SamplingParams(max_tokens=1000, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    assert final is not None and final.finish_reason == "length"
    # 64 positions: 20 prompt tokens, one padded tree of budget + 1 = 5 nodes past the prefix.
    assert len(final.token_ids) == 64 - 20 - 5 + 1
    assert final.stats.steps >= 1
    assert final.stats.acceptance_length >= 1.0
    assert engine.timer.counts["verify"] >= final.stats.steps
    assert set(engine.timer.seconds) >= {"schedule", "draft", "build", "verify", "append", "target_forward"}


def test_top_k_beyond_int64_means_no_filter_and_leaves_the_engine_running(engine):
    """top_k >= vocab is "off"; one too large for an int64 tensor must not fail the batch's step."""
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    huge = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True, top_k=10**20)
    engine.add_request("huge", [1, 2, 3], huge)
    engine.add_request("plain", [1, 2, 3], sampled)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outputs["huge"].token_ids == outputs["plain"].token_ids


def test_llm_generate_refusing_one_prompt_leaves_no_other_prompt_queued(engine):
    from ddtree_serve.engine.llm import LLM

    llm = LLM.from_engine(engine)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[1, 2, 3], []], SamplingParams(max_tokens=4))
    assert engine.num_waiting == 0 and engine.num_running == 0
    assert [
        len(o.token_ids) for o in llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    ] == [4]
