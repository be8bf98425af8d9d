"""Appending a step's tokens to a request and ending it at exactly the right token.

A verify step emits several tokens at once; anything after a stop (EOS, stop token, stop
string, max_tokens) is dropped here so the output is what one-token-at-a-time decoding gives.
"""

from collections.abc import Sequence

from tokenizers import Tokenizer

from ddtree_serve.engine.request import Request


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
            if params.stop and self._match_stop_string(request):
                request.finish("stop")
                return
            if len(request.output_token_ids) >= max_output_tokens:
                request.finish("length")
                return

    def _match_stop_string(self, request: Request) -> bool:
        """Whether the text so far contains a stop string; if so record where the text ends.

        Checked after every token, so the first time any match exists it is the earliest one.
        Decoding the whole output each time keeps partial UTF-8 sequences exact; outputs are
        short enough that this is not worth an incremental decoder.
        """
        text = self.tokenizer.decode(request.output_token_ids)
        offsets = [i for s in request.params.stop if (i := text.find(s)) >= 0]
        if not offsets:
            return False
        request.stop_text_offset = min(offsets)
        return True
