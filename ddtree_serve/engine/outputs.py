"""What callers receive: decoded text with token ids and stats, cumulative and incremental."""

from dataclasses import dataclass

from tokenizers import Tokenizer

from ddtree_serve.engine.request import RequestOutput, RequestStats

_REPLACEMENT_CHAR = "\ufffd"  # what a partial UTF-8 sequence decodes to until it completes


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
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent_text = ""
        self.num_sent_tokens = 0

    def update(self, output: RequestOutput) -> CompletionOutput:
        text = self.tokenizer.decode(list(output.token_ids))
        if output.stop_text_offset is not None:
            text = text[: output.stop_text_offset]
        if not output.finished:
            text = text.rstrip(_REPLACEMENT_CHAR)
            text = text[: max(len(self.sent_text), len(text) - self.holdback)]
        delta_text = text[len(self.sent_text) :]
        self.sent_text = self.sent_text + delta_text
        token_ids = list(output.token_ids)
        delta_token_ids = token_ids[self.num_sent_tokens :]
        self.num_sent_tokens = len(token_ids)
        return CompletionOutput(
            request_id=output.request_id,
            text=self.sent_text,
            token_ids=token_ids,
            delta_text=delta_text,
            delta_token_ids=delta_token_ids,
            finished=output.finished,
            finish_reason=output.finish_reason,
            stats=output.stats,
        )
