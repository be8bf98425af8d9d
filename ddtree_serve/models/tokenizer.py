"""A model directory's tokenizer: `tokenizer.json` (HF `tokenizers`) or `tiktoken.model` (Kimi K2.x).

The engine needs two methods of a tokenizer, the ones `tokenizers.Tokenizer` has:
`encode(text).ids` (special-token strings in the text become their ids) and
`decode(ids, skip_special_tokens=True)`. `TiktokenTokenizer` gives exactly those over the
`tiktoken` library, for directories laid out as Moonshot's (loaded there by a custom
`tokenization_kimi.py`): `tiktoken.model` holds the BPE ranks (one `base64 rank` line per token),
the `num_reserved_special_tokens` ids after them are special tokens, named by
`tokenizer_config.json`'s `added_tokens_decoder` and `<|reserved_token_{id}|>` otherwise, and text
is split by Kimi's pattern (Han runs kept whole, cased words, digits in threes, ...).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tokenizers import Tokenizer

TIKTOKEN_FILE = "tiktoken.model"
HF_TOKENIZER_FILE = "tokenizer.json"
NUM_RESERVED_SPECIAL_TOKENS = 256
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


class TokenizerLayoutError(ValueError):
    """A model directory holds no tokenizer this package reads."""


@dataclass(frozen=True)
class Encoding:
    """The part of `tokenizers.Encoding` the engine reads."""

    ids: list[int]


class TiktokenTokenizer:
    """A tiktoken BPE with named special tokens, behind the `tokenizers.Tokenizer` calls we use."""

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self._encoding = encoding
        self._special_ids = frozenset(encoding._special_tokens.values())

    @classmethod
    def from_dir(cls, path: str | Path) -> "TiktokenTokenizer":
        """Read `tiktoken.model` and the special tokens of `tokenizer_config.json` (Kimi's layout)."""
        path = Path(path)
        ranks = load_tiktoken_bpe(str(path / TIKTOKEN_FILE))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        named = {int(i): entry["content"] for i, entry in (config.get("added_tokens_decoder") or {}).items()}
        first = len(ranks)
        special = {
            named.get(i, f"<|reserved_token_{i}|>"): i
            for i in range(first, first + NUM_RESERVED_SPECIAL_TOKENS)
        }
        encoding = tiktoken.Encoding(
            name=path.name, pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=special
        )
        return cls(encoding)

    def encode(self, text: str) -> Encoding:
        """Token ids of `text`; special-token strings in it map to their ids (as `tokenizers` does)."""
        return Encoding(self._encoding.encode(text, allowed_special="all"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (invalid UTF-8 as U+FFFD); special tokens dropped unless asked for."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self._encoding.decode(ids, errors="replace")


def load_tokenizer(path: str | Path) -> Tokenizer | TiktokenTokenizer:
    """The tokenizer of a model directory: `tokenizer.json` first, else `tiktoken.model`."""
    path = Path(path)
    if (path / HF_TOKENIZER_FILE).exists():
        return Tokenizer.from_file(str(path / HF_TOKENIZER_FILE))
    if (path / TIKTOKEN_FILE).exists():
        return TiktokenTokenizer.from_dir(path)
    raise TokenizerLayoutError(
        f"no tokenizer in {path}: expected {HF_TOKENIZER_FILE} (HF tokenizers) or {TIKTOKEN_FILE} (tiktoken)"
    )
