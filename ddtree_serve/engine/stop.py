"""Appending a step's tokens to a request and ending it at exactly the right token.

A verify step emits several tokens at once; anything after a stop (EOS, stop token, stop
string, max_tokens) is dropped here so the output is what one-token-at-a-time decoding gives.
"""

from collections.abc import Sequence

from tokenizers import Tokenizer

from ddtree_serve.engine.detokenize import IncrementalDecoder
from ddtree_serve.engine.request import Request


class StopStringScan:
    """Where a request's stop strings could still match: the text's tail, decoded as it grows.

    A match that was not there before the newest token must reach past the text confirmed
    before it, so only the last `longest_stop - 1` confirmed characters and the unconfirmed
    text need searching; the rest of the output is never decoded again.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.decoder = IncrementalDecoder(tokenizer)
        self.max_overlap = max(len(s) for s in stop) - 1  # chars a new match may share with old text
        self.confirmed_tail = ""  # the last `max_overlap` confirmed characters
        self.num_confirmed_chars = 0

    def append(self, token: int) -> int | None:
        """Add the newest token; the offset in the whole text of the earliest match, if any."""
        tail_start = self.num_confirmed_chars - len(self.confirmed_tail)
        confirmed = self.decoder.extend([token])
        text = self.confirmed_tail + confirmed + self.decoder.pending_text  # the text from tail_start
        offsets = [i for s in self.stop if (i := text.find(s)) >= 0]
        self.num_confirmed_chars += len(confirmed)
        searched = self.confirmed_tail + confirmed
        self.confirmed_tail = searched[-self.max_overlap :] if self.max_overlap else ""
        return tail_start + min(offsets) if offsets else None


class StopChecker:
    """Applies every stop condition, token by token, as tokens join a request's output."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)

    def append(self, request: Request, new_tokens: Sequence[int], max_output_tokens: int) -> None:
        """Append `new_tokens` in order until one ends the request; the rest are dropped.

        `max_output_tokens` is the request's effective limit (its max_tokens, capped by the
        room left in the cache). Stop tokens and EOS are not part of the output; a stop string
        keeps its tokens but `stop_text_offset` cuts the text before the match.
        """
        params = request.params
        for token in new_tokens:
            if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
                request.finish("stop")
                return
            request.output_token_ids.append(token)
            if params.stop and self._match_stop_string(request, token):
                request.finish("stop")
                return
            if len(request.output_token_ids) >= max_output_tokens:
                request.finish("length")
                return

    def _match_stop_string(self, request: Request, token: int) -> bool:
        """Whether the text so far contains a stop string; if so record where the text ends.

        Checked after every token, so the first time any match exists it is the earliest one.
        """
        if request.stop_scan is None:
            request.stop_scan = StopStringScan(self.tokenizer, request.params.stop)
        offset = request.stop_scan.append(token)
        if offset is None:
            return False
        request.stop_text_offset = offset
        return True
