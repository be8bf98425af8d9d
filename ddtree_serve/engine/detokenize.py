"""Decoding a growing token sequence a few tokens at a time, so the work per token stays flat.

Decoding the whole output after every token costs O(n) per token, O(n^2) per request. Like
vLLM's incremental detokenizer, `IncrementalDecoder` keeps a window of the last few tokens:
`prefix` tokens whose text is already confirmed (decoded again only so the text of the new
tokens comes out exactly as in context) followed by the unconfirmed ones. Text is confirmed
at a token boundary that is also a character boundary: there the one-shot decode of all
tokens splits into the text before and the text after, so confirmed text never changes.
That holds for byte-level decoders (bytes joined, then decoded as UTF-8), which every
tokenizer this project loads uses.

A window that decodes to text ending in U+FFFD may end inside a UTF-8 sequence that later
tokens complete, so it is not confirmed. When it stays that way for more than
`MAX_UNCONFIRMED_TOKENS` tokens (invalid bytes, or a real U+FFFD), the boundary before the
newest token is confirmed if splitting the decode there changes nothing.
"""

from collections.abc import Sequence

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what a partial (or invalid) UTF-8 sequence decodes to
MAX_UNCONFIRMED_TOKENS = 8  # a partial character spans at most 4 byte tokens (specials aside)


class IncrementalDecoder:
    """The text of a growing token sequence: confirmed pieces as they settle, and the rest.

    `extend` returns the newly confirmed text; the confirmed pieces joined, followed by
    `pending_text`, always equal `tokenizer.decode` of every token so far.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.window: list[int] = []  # the last few tokens: confirmed prefix, then unconfirmed
        self.num_prefix_tokens = 0  # window[:num_prefix_tokens] is already confirmed text
        self.pending_text = ""  # text of the unconfirmed tokens; may change as tokens arrive
        self._prefix_text: str | None = None  # decode of the prefix, once asked for

    def extend(self, token_ids: Sequence[int]) -> str:
        """Append tokens; the text they (and earlier unconfirmed tokens) confirm, maybe ""."""
        self.window.extend(token_ids)
        prefix_text = self._prefix()
        window_text = self._decode(self.window)
        if not window_text.endswith(REPLACEMENT_CHAR):
            return self._confirm(len(self.window), window_text[len(prefix_text) :], "")
        self.pending_text = window_text[len(prefix_text) :]
        if len(self.window) - self.num_prefix_tokens > MAX_UNCONFIRMED_TOKENS:
            return self._confirm_before_newest(prefix_text, window_text)
        return ""

    def _confirm_before_newest(self, prefix_text: str, window_text: str) -> str:
        """Confirm up to the newest token if the window's text splits exactly there."""
        head_text = self._decode(self.window[:-1])
        newest_text = self._decode(self.window[-1:])
        if not newest_text or head_text + newest_text != window_text:
            return ""
        return self._confirm(len(self.window) - 1, head_text[len(prefix_text) :], newest_text)

    def _confirm(self, end: int, confirmed_text: str, pending_text: str) -> str:
        """`window[:end]` is settled: its unconfirmed part becomes the next window's prefix."""
        del self.window[: self.num_prefix_tokens]
        self.num_prefix_tokens = end - self.num_prefix_tokens
        self.pending_text = pending_text
        self._prefix_text = None
        return confirmed_text

    def _prefix(self) -> str:
        """The prefix decoded alone; kept while the tokens after it stay unconfirmed."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self.window[: self.num_prefix_tokens])
        return self._prefix_text

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if token_ids else ""
