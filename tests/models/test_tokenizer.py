"""Tokenizer directories: Kimi's tiktoken layout behind the engine's tokenizer calls, or one clear line."""

from pathlib import Path

import pytest

from ddtree_serve.models import load_tokenizer
from ddtree_serve.models.tokenizer import TiktokenTokenizer, TokenizerLayoutError
from tests.models.kimi_dirs import KIMI_NUM_BASE_TOKENS, KIMI_SPECIAL_TOKENS, write_kimi_tokenizer

TEXTS = ["hello world", "say hello, world!\n\n  indented\ttab", "你好，世界 Kimi K2.6 ünïcödé 123456", ""]


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> TiktokenTokenizer:
    tokenizer = load_tokenizer(write_kimi_tokenizer(tmp_path_factory.mktemp("kimi_tokenizer")))
    assert isinstance(tokenizer, TiktokenTokenizer)
    return tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips(kimi_tokenizer: TiktokenTokenizer, text: str) -> None:
    assert kimi_tokenizer.decode(kimi_tokenizer.encode(text).ids) == text


def test_merges_and_byte_fallback(kimi_tokenizer: TiktokenTokenizer) -> None:
    assert kimi_tokenizer.encode("hello").ids == [259]  # h e l l o -> he ll -> hell -> hello
    assert kimi_tokenizer.encode("hello world").ids == [259, 32, 263]  # " world" -> " " wo rl d -> " " world
    assert kimi_tokenizer.encode("é").ids == list("é".encode())


def test_special_tokens_encode_to_their_ids_and_round_trip(kimi_tokenizer: TiktokenTokenizer) -> None:
    ids = {token: KIMI_NUM_BASE_TOKENS + i for i, token in enumerate(KIMI_SPECIAL_TOKENS)}
    text = "<|im_user|>user<|im_middle|>hello<|im_end|>"
    encoded = kimi_tokenizer.encode(text).ids
    assert encoded == [ids["<|im_user|>"], *b"user", ids["<|im_middle|>"], 259, ids["<|im_end|>"]]
    assert kimi_tokenizer.decode(encoded, skip_special_tokens=False) == text
    assert kimi_tokenizer.decode(encoded) == "userhello"  # tokenizers' default drops special tokens
    # ids without a name in tokenizer_config.json are Kimi's reserved tokens
    reserved = KIMI_NUM_BASE_TOKENS + 200
    assert kimi_tokenizer.encode(f"<|reserved_token_{reserved}|>").ids == [reserved]


def test_directory_without_a_tokenizer_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerLayoutError, match=r"tokenizer\.json .* or tiktoken\.model") as refused:
        load_tokenizer(tmp_path)
    assert "\n" not in str(refused.value)
