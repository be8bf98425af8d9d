"""What callers receive: decoded text with token ids and stats, cumulative and incremental."""

from dataclasses import dataclass

from tokenizers import Tokenizer

from ddtree_serve.engine.detokenize import REPLACEMENT_CHAR, IncrementalDecoder
from ddtree_serve.engine.request import RequestOutput, RequestStats


@dataclass(frozen=True)
class CompletionOutput:
    """One request's output so far; `delta_*` hold what is new since the previous one."""

    request_id: str
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    stats: RequestStats


class Detokenizer:
    """Turns a request's successive `RequestOutput`s into text, never taking back a character.

    While the request runs it holds back a trailing partial UTF-8 sequence and, if the request
    has stop strings, the last `longest_stop - 1` characters (they may yet start a stop match).
    Each update decodes only the last few tokens (`IncrementalDecoder`); the text not yet sent
    is kept apart so that holding back never rescans the whole output.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent_text = ""
        self.token_ids: list[int] = []
        self.unsent_confirmed_text = ""  # confirmed by the decoder, not yet sent
        self.num_sent_pending_chars = 0  # chars of the decoder's pending text already sent

    @property
    def num_sent_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, output: RequestOutput) -> CompletionOutput:
        delta_token_ids = output.token_ids_from(self.num_sent_tokens)
        self.token_ids.extend(delta_token_ids)
        self._take_confirmed(self.decoder.extend(delta_token_ids))
        # What follows `sent_text` in the one-shot decode of every token so far.
        unsent = (self.unsent_confirmed_text + self.decoder.pending_text)[self.num_sent_pending_chars :]
        if output.finished:
            end = len(unsent)
            if output.stop_text_offset is not None:
                end = max(0, min(end, output.stop_text_offset - len(self.sent_text)))
        else:
            end = max(0, len(unsent.rstrip(REPLACEMENT_CHAR)) - self.holdback)
        delta_text = unsent[:end]
        self._mark_sent(end)
        self.sent_text = self.sent_text + delta_text
        return CompletionOutput(
            request_id=output.request_id,
            text=self.sent_text,
            token_ids=list(self.token_ids),
            delta_text=delta_text,
            delta_token_ids=delta_token_ids,
            finished=output.finished,
            finish_reason=output.finish_reason,
            stats=output.stats,
        )

    def _take_confirmed(self, confirmed_text: str) -> None:
        """Queue newly confirmed text, less what was already sent of it while it was pending."""
        already_sent = min(self.num_sent_pending_chars, len(confirmed_text))
        self.num_sent_pending_chars -= already_sent
        self.unsent_confirmed_text += confirmed_text[already_sent:]

    def _mark_sent(self, num_chars: int) -> None:
        from_confirmed = min(num_chars, len(self.unsent_confirmed_text))
        self.unsent_confirmed_text = self.unsent_confirmed_text[from_confirmed:]
        self.num_sent_pending_chars += num_chars - from_confirmed
