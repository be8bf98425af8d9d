"""Detokenizer: streamed text never takes back a character, holds partial UTF-8 and stop prefixes."""

from ddtree_serve.engine.outputs import Detokenizer
from ddtree_serve.engine.request import RequestOutput, RequestStats
from tests.conftest import tiny_tokenizer

STATS = RequestStats(num_prompt_tokens=1, num_generated_tokens=0, steps=0, acceptance_length=0.0)


def output(
    token_ids: list[int], finished: bool = False, stop_text_offset: int | None = None
) -> RequestOutput:
    return RequestOutput(
        "r", token_ids, len(token_ids), 1, finished, "stop" if finished else None, stop_text_offset, STATS
    )


def test_partial_utf8_is_held_until_complete():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("aé").ids
    assert len(ids) >= 3  # "a", then the two bytes of "é"
    detokenizer = Detokenizer(tokenizer)
    deltas = [detokenizer.update(output(ids[: n + 1])).delta_text for n in range(len(ids))]
    assert deltas[0] == "a"
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) == "aé"


def test_possible_stop_prefix_is_held_and_stop_text_is_cut():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("x = 1\n\ny").ids
    stop = "\n\ny"
    detokenizer = Detokenizer(tokenizer, stop=(stop,))
    streamed = ""
    for n in range(1, len(ids)):
        streamed += detokenizer.update(output(ids[:n])).delta_text
        assert "\n\n" not in streamed  # never ahead of what a stop match could cut
    final = detokenizer.update(output(ids, finished=True, stop_text_offset=len("x = 1")))
    assert final.text == "x = 1"
    assert streamed + final.delta_text == "x = 1"
