"""Stop tokens, EOS, stop strings and max_tokens end a request at exactly the right token.

Each case first samples a reference continuation with a fixed seed, then reruns the same seed
with a stop condition picked from that reference: the output must be the reference cut at the
stop, although a verify step may have produced tokens past it.
"""

import dataclasses

import pytest

from ddtree_serve.engine.outputs import Detokenizer
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine

MODES = [("ar", 1), ("chain", 1), ("ddtree", 8)]
BASE = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)


def generate_one(engine: SpecEngine, prompt: list[int], params: SamplingParams):
    engine.add_request("r", prompt, params)
    final = None
    detokenizer = Detokenizer(engine.tokenizer, params.stop)
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = detokenizer.update(output)
    assert final is not None and final.finished
    return final


def first_new_token_index(tokens: list[int], start: int) -> int:
    """Index of the first token at or after `start` that does not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module", params=MODES, ids=[m for m, _ in MODES])
def engine_and_reference(request, make_oracle_engine, prompt_ids):
    mode, budget = request.param

    def make() -> SpecEngine:
        return make_oracle_engine(mode, budget=budget, max_num_seqs=1)[0]

    reference = generate_one(make(), prompt_ids[1], BASE)
    assert len(reference.token_ids) == BASE.max_tokens
    return make, prompt_ids[1], reference


def test_stop_token_ends_before_it(engine_and_reference):
    make, prompt, reference = engine_and_reference
    stop_at = first_new_token_index(reference.token_ids, 5)
    params = dataclasses.replace(BASE, stop_token_ids=(reference.token_ids[stop_at],))
    output = generate_one(make(), prompt, params)
    assert output.token_ids == reference.token_ids[:stop_at]
    assert output.finish_reason == "stop"


def test_eos_ends_before_it_unless_ignored(engine_and_reference):
    make, prompt, reference = engine_and_reference
    stop_at = first_new_token_index(reference.token_ids, 4)
    engine = make()
    engine.stop_checker.eos_token_ids = frozenset({reference.token_ids[stop_at]})
    output = generate_one(engine, prompt, dataclasses.replace(BASE, ignore_eos=False))
    assert output.token_ids == reference.token_ids[:stop_at]
    assert output.finish_reason == "stop"


def test_max_tokens_is_exact(engine_and_reference):
    make, prompt, reference = engine_and_reference
    for max_tokens in (1, 6):
        output = generate_one(make(), prompt, dataclasses.replace(BASE, max_tokens=max_tokens))
        assert output.token_ids == reference.token_ids[:max_tokens]
        assert output.finish_reason == "length"


def test_stop_string_cuts_text_and_tokens(engine_and_reference):
    make, prompt, reference = engine_and_reference
    engine = make()
    decode = engine.tokenizer.decode
    # A stop string from the reference's text: the first character, from token 3 on, that is
    # decodable and does not occur earlier.
    text = reference.text
    start = len(decode(reference.token_ids[:3]))
    offset = next(i for i in range(start, len(text)) if text[i] != "\ufffd" and text[i] not in text[:i])
    stop = text[offset]
    output = generate_one(engine, prompt, dataclasses.replace(BASE, stop=(stop,)))
    assert output.text == text[:offset]
    assert output.finish_reason == "stop"
    # Tokens run up to the one that completed the stop string, and not one further.
    assert output.token_ids == reference.token_ids[: len(output.token_ids)]
    assert stop in decode(output.token_ids) and stop not in decode(output.token_ids[:-1])
