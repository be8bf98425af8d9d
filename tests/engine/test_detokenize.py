"""Incremental detokenizing and stop-string scanning: same text as decoding everything, flat work.

The reference below is the whole-output algorithm the engine used before (decode every token
after each step, strip a trailing partial character, hold back a possible stop prefix; find a
stop string in the decode of every token after each token). The incremental path must give
the same deltas, stop offsets and tokens while decoding only a few tokens per token.
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from ddtree_serve.engine.detokenize import MAX_UNCONFIRMED_TOKENS, REPLACEMENT_CHAR
from ddtree_serve.engine.outputs import Detokenizer
from ddtree_serve.engine.request import Request
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.stop import StopChecker
from tests.conftest import EOS_TOKEN, tiny_tokenizer

NUM_TOKENS = 4000
STEP_SIZES = (1, 3, 8, 2, 5, 1, 7, 4)  # tokens per verify step, cycled
STOP = "→ FIN"  # multi-byte; the text is full of its prefix "→ FI"
SINGLE_TOKENS = (EOS_TOKEN, "ÿ", "â")  # decodes to nothing, an invalid byte, a lone lead byte
PIECES = ("a", "→", " FIN", "é", "😀", "\ufffd", *SINGLE_TOKENS)


class CountingTokenizer:
    """Delegates to a real tokenizer and counts decode calls and the tokens they decode."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.num_decode_calls = 0
        self.num_decoded_tokens = 0
        self.max_decoded_tokens = 0

    def decode(self, token_ids: Sequence[int]) -> str:
        self.num_decode_calls += 1
        self.num_decoded_tokens += len(token_ids)
        self.max_decoded_tokens = max(self.max_decoded_tokens, len(token_ids))
        return self.inner.decode(token_ids)


@dataclass
class Run:
    """What the engine's stop checker and a streaming caller's detokenizer produced."""

    token_ids: list[int]
    deltas: list[str]
    text: str
    finish_reason: str | None
    stop_text_offset: int | None
    step_of_token: list[int]  # which step emitted each output token


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return tiny_tokenizer()


def single_token(tokenizer: Tokenizer, piece: str) -> int:
    """A special token, or one byte that ByteLevel writes as itself (0xA1-0xAC, 0xAE-0xFF)."""
    token = tokenizer.token_to_id(piece)
    assert token is not None
    return token


def long_output(tokenizer: Tokenizer) -> list[int]:
    """4,000 tokens of code and prose with multi-byte characters, invalid bytes and U+FFFD."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text).ids

    invalid, lone_lead = single_token(tokenizer, "ÿ"), single_token(tokenizer, "â")  # 0xFF, 0xE2
    unit = [
        *encode("def add(a, b):\n    return a + b  # → FIX naïve café €5 😀 日本語\n"),
        *[invalid] * 3,
        *encode("x"),
        lone_lead,
        *encode(" y\ufffd\ufffd → FI"),
    ]
    runs = [[invalid] * 200, encode("\ufffd" * 100)]  # far longer than any partial character
    ids = unit * 20 + runs[0] + unit * 10 + runs[1]
    while len(ids) < NUM_TOKENS:
        ids += unit
    return ids[:NUM_TOKENS]


def run_incremental(tokenizer, ids: list[int], stop: tuple[str, ...], step_sizes=STEP_SIZES) -> Run:
    """Feed `ids` step by step through the stop checker; detokenize every step's output."""
    params = SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=stop)
    request = Request("r", [0], params, max_output_tokens=params.max_tokens, tree_budget=0)
    checker = StopChecker(tokenizer, eos_token_ids=())
    detokenizer = Detokenizer(tokenizer, stop)
    deltas, step_of_token, position = [], [], 0
    for step, size in enumerate(itertools.cycle(step_sizes)):
        checker.append(request, ids[position : position + size], max_output_tokens=len(ids))
        position += size
        step_of_token += [step] * (len(request.output_token_ids) - len(step_of_token))
        final = detokenizer.update(request.take_output())
        deltas.append(final.delta_text)
        if final.finished:
            return Run(
                final.token_ids,
                deltas,
                final.text,
                final.finish_reason,
                request.stop_text_offset,
                step_of_token,
            )
    raise AssertionError("unreachable: max_output_tokens ends the request")


def reference_stop(tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...]) -> tuple[int, int | None]:
    """(tokens kept, stop offset): the first prefix whose whole decode holds a stop string."""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        offsets = [i for s in stop if (i := text.find(s)) >= 0]
        if offsets:
            return n, min(offsets)
    return len(ids), None


def reference_deltas(
    tokenizer: Tokenizer, ids: list[int], step_ends: list[int], stop: tuple[str, ...], stop_offset: int | None
) -> list[str]:
    """What the whole-output detokenizer streamed: one delta per step, the last one finished."""
    holdback = max((len(s) for s in stop), default=1) - 1
    sent, deltas = "", []
    for i, end in enumerate(step_ends):
        text = tokenizer.decode(ids[:end])
        if i == len(step_ends) - 1:
            text = text if stop_offset is None else text[:stop_offset]
        else:
            text = text.rstrip(REPLACEMENT_CHAR)
            text = text[: max(len(sent), len(text) - holdback)]
        deltas.append(text[len(sent) :])
        sent += deltas[-1]
    return deltas


def step_ends_of(run: Run) -> list[int]:
    """Output length after each step."""
    counts = [0] * (run.step_of_token[-1] + 1)
    for step in run.step_of_token:
        counts[step] += 1
    return list(itertools.accumulate(counts))


def check_against_reference(tokenizer: Tokenizer, ids: list[int], run: Run, stop: tuple[str, ...]) -> None:
    num_kept, stop_offset = reference_stop(tokenizer, ids, stop) if stop else (len(ids), None)
    assert run.token_ids == ids[:num_kept]
    assert run.stop_text_offset == stop_offset
    assert run.finish_reason == ("stop" if stop_offset is not None else "length")
    full_text = tokenizer.decode(run.token_ids)
    assert run.text == (full_text if stop_offset is None else full_text[:stop_offset])
    assert "".join(run.deltas) == run.text
    assert run.deltas == reference_deltas(tokenizer, ids, step_ends_of(run), stop, stop_offset)


def assert_flat_work(counting: CountingTokenizer, num_tokens: int) -> None:
    """A few tokens decoded per output token, never a decode of the whole output."""
    assert counting.num_decode_calls <= 4 * num_tokens
    assert counting.num_decoded_tokens <= 16 * num_tokens  # the whole-output decode: n^2 / 2
    assert counting.max_decoded_tokens <= 4 * (max(STEP_SIZES) + MAX_UNCONFIRMED_TOKENS)


def test_long_output_without_stop_strings_decodes_a_few_tokens_per_token(tokenizer):
    ids = long_output(tokenizer)
    counting = CountingTokenizer(tokenizer)
    run = run_incremental(counting, ids, stop=())
    assert len(run.token_ids) == NUM_TOKENS
    check_against_reference(tokenizer, ids, run, stop=())
    assert_flat_work(counting, NUM_TOKENS)
    assert len({"é", "€", "😀", "日", REPLACEMENT_CHAR} - set(run.text)) == 0


def test_long_output_stop_string_straddling_steps_decodes_a_few_tokens_per_token(tokenizer):
    body = long_output(tokenizer)
    stop_ids = tokenizer.encode(STOP).ids
    ids = body[: NUM_TOKENS - 100] + stop_ids + body[NUM_TOKENS - 100 :]
    counting = CountingTokenizer(tokenizer)
    run = run_incremental(counting, ids, stop=(STOP, "never in the text"))
    num_kept = NUM_TOKENS - 100 + len(stop_ids)
    assert len(run.token_ids) == num_kept and run.finish_reason == "stop"
    # The stop string's first token and the token that completed it came in different steps.
    assert run.step_of_token[NUM_TOKENS - 100] < run.step_of_token[num_kept - 1]
    check_against_reference(tokenizer, ids, run, stop=(STOP, "never in the text"))
    assert_flat_work(counting, num_kept)


def test_an_output_seen_only_when_finished_decodes_once(tokenizer):
    """`LLM.generate` detokenizes only the final output: all of it in one decode."""
    ids = long_output(tokenizer)
    counting = CountingTokenizer(tokenizer)
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True)
    request = Request("r", [0], params, max_output_tokens=NUM_TOKENS, tree_budget=0)
    StopChecker(counting, eos_token_ids=()).append(request, ids, max_output_tokens=NUM_TOKENS)
    final = Detokenizer(counting, ()).update(request.take_output())
    assert final.finished and final.text == final.delta_text == tokenizer.decode(ids)
    assert counting.num_decode_calls <= 3


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(
        st.sampled_from(["a", "→", " FIN", "é", "😀", "ÿ", "â", "\ufffd", EOS_TOKEN]), min_size=1, max_size=40
    ),
    step_sizes=st.lists(st.integers(1, 8), min_size=1, max_size=4),
    stop=st.sampled_from([(), ("→ FIN",), ("a",), ("aé", "😀a"), ("\ufffd",)]),
)
def test_random_outputs_match_the_whole_output_reference(tokenizer, pieces, step_sizes, stop):
    """Byte tokens of split characters, invalid bytes, U+FFFD and skipped special tokens."""
    ids = [
        token
        for piece in pieces
        for token in (
            [single_token(tokenizer, piece)]
            if piece in (EOS_TOKEN, "ÿ", "â")
            else tokenizer.encode(piece).ids
        )
    ]
    run = run_incremental(tokenizer, ids, stop, step_sizes)
    check_against_reference(tokenizer, ids, run, stop)
