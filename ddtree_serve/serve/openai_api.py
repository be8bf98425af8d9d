"""OpenAI-compatible request bodies and response rendering for /v1/completions and /v1/chat.

Only what the engine can honour is accepted: one choice (`n` = 1), no logprobs, no echo,
no penalties, logit bias or suffix (a non-neutral value is refused rather than dropped).
Unknown fields are ignored the way OpenAI-compatible servers do; known fields are checked
strictly here (no `true` for an integer, no `"5"` for a number, finite numbers in their
range, text that is valid Unicode), and every refusal becomes a `RequestError` (HTTP 400)
naming the field. `SamplingFields` is also what the gRPC adapter validates its message into.
"""

import json
import math
import time
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)
from pydantic_core import PydanticCustomError

from ddtree_serve.engine.sampling_params import MAX_SEED, SamplingParams
from ddtree_serve.serve.chat import TEXT_PART, ChatTurn, ContentPart
from ddtree_serve.serve.errors import RequestError, invalid

MAX_TEMPERATURE = 2.0  # OpenAI's range; also keeps 1/temperature a normal float32


def _valid_unicode(text: str) -> str:
    """Text JSON can carry but no tokenizer can encode (a lone surrogate such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise PydanticCustomError(
            "unicode", "text is not valid Unicode (lone surrogate at index {index})", {"index": error.start}
        ) from None
    return text


Text = Annotated[StrictStr, AfterValidator(_valid_unicode)]
Body = TypeVar("Body", bound=BaseModel)


def _prompt(value: Any) -> str | tuple[int, ...]:
    """A completion prompt: text, a list of one text, token ids, or a list of one id list."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return _valid_unicode(value)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        raise PydanticCustomError("one_prompt", "exactly one prompt per request is supported")
    if isinstance(value, list) and all(type(v) is int for v in value):
        if any(v < 0 for v in value):
            raise PydanticCustomError("token_id", "token ids must be >= 0")
        return tuple(value)
    raise PydanticCustomError(
        "prompt_type", "prompt must be a string, a list of one string, or a list of token ids (integers)"
    )


Prompt = Annotated[str | tuple[int, ...], PlainValidator(_prompt)]


def _stop(value: Any) -> tuple[str, ...]:
    """`stop`: null, one string or a list of strings, each non-empty valid Unicode."""
    strings = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise PydanticCustomError("stop_type", "stop must be a string or a list of strings")
    if not all(strings):
        raise PydanticCustomError("stop_empty", "stop strings must be non-empty")
    return tuple(_valid_unicode(s) for s in strings)


Stop = Annotated[tuple[str, ...], PlainValidator(_stop)]


def _bounded(name: str, low: float, high: float, *, low_open: bool = False) -> AfterValidator:
    """A finite number in [low, high] (or (low, high]); the refusal states the range."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"

    def check(value: float) -> float:
        if not (math.isfinite(value) and (low < value if low_open else low <= value) and value <= high):
            raise PydanticCustomError(
                "range", "{name} must be a finite number in {interval}, got {value}",
                {"name": name, "interval": interval, "value": value},
            )  # fmt: skip
        return value

    return AfterValidator(check)


Temperature = Annotated[StrictFloat, _bounded("temperature", 0.0, MAX_TEMPERATURE)]
TopP = Annotated[StrictFloat, _bounded("top_p", 0.0, 1.0, low_open=True)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """Sampling fields both protocols accept (OpenAI names; `top_k`, `ignore_eos`, `draft_budget`
    are extensions: `draft_budget` caps the request's draft tree nodes per step, the server's
    budget being the ceiling; it changes speed only)."""

    model_config = ConfigDict(extra="ignore")

    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    stop: Stop = ()
    seed: Annotated[StrictInt, Field(ge=0, lt=MAX_SEED)] | None = None
    ignore_eos: StrictBool = False
    draft_budget: Annotated[StrictInt, Field(ge=1)] | None = None

    def requested_max_tokens(self) -> tuple[int | None, str | None]:
        """The client's max_tokens and the field that set it; (None, None) when unset."""
        return (self.max_tokens, "max_tokens") if self.max_tokens is not None else (None, None)

    def sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        """`SamplingParams` from the set fields over the server defaults; errors -> 400."""
        max_tokens, _ = self.requested_max_tokens()
        try:
            return SamplingParams(
                max_tokens=defaults.max_tokens if max_tokens is None else max_tokens,
                temperature=defaults.temperature if self.temperature is None else self.temperature,
                top_p=defaults.top_p if self.top_p is None else self.top_p,
                top_k=defaults.top_k if self.top_k is None else self.top_k,
                stop=self.stop,
                seed=self.seed,
                ignore_eos=self.ignore_eos,
                draft_budget=self.draft_budget,
            )
        except ValueError as error:
            raise invalid(str(error)) from error


class _OpenAIFields(SamplingFields):
    """Fields both HTTP endpoints share beyond sampling."""

    model: Text | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logprobs: StrictBool | StrictInt | None = None
    # Known OpenAI fields the engine cannot honour: refused unless neutral, never silently dropped.
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    best_of: StrictInt | None = None

    def sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        if self.n != 1:
            raise invalid(f"only n=1 is supported, got {self.n}", "n")
        if self.logprobs not in (None, False, 0):
            raise invalid("logprobs are not supported", "logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise invalid(f"{name} is not supported (only 0)", name)
        if self.logit_bias:
            raise invalid("logit_bias is not supported", "logit_bias")
        if self.best_of not in (None, 1):
            raise invalid(f"only best_of=1 is supported, got {self.best_of}", "best_of")
        return super().sampling_params(defaults)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_OpenAIFields):
    prompt: Prompt
    echo: StrictBool = False
    suffix: Text | None = None

    def prompt_input(self) -> str | tuple[int, ...]:
        """The prompt as the engine takes it: text or token ids."""
        if self.echo:
            raise invalid("echo is not supported", "echo")
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        return self.prompt


def _content(value: Any) -> tuple[ContentPart, ...]:
    """A message's `content`: a string, or OpenAI's list of parts (`{"type": "text", "text": ...}`,
    `{"type": "image_url", ...}`); which part types are served is the chat format's call."""
    if isinstance(value, str):
        return (ContentPart(TEXT_PART, _valid_unicode(value)),)
    if not isinstance(value, list) or not value:
        raise PydanticCustomError(
            "content_type", "content must be a string or a non-empty list of content parts"
        )
    parts = []
    for part in value:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise PydanticCustomError(
                "content_part", "each content part must be an object with a string `type`"
            )
        if part["type"] != TEXT_PART:
            parts.append(ContentPart(part["type"]))
        elif isinstance(text := part.get("text"), str):
            parts.append(ContentPart(TEXT_PART, _valid_unicode(text)))
        else:
            raise PydanticCustomError("content_text", "a text content part needs a string `text`")
    return tuple(parts)


Content = Annotated[tuple[ContentPart, ...], PlainValidator(_content)]


class ChatMessage(BaseModel):
    role: Text
    content: Content


class ChatCompletionRequest(_OpenAIFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    # vLLM's extension: extra variables for the chat template (e.g. Kimi's `thinking`).
    chat_template_kwargs: dict[StrictStr, Any] | None = None

    def chat_turns(self) -> list[ChatTurn]:
        return [ChatTurn(message.role, message.content) for message in self.messages]

    def requested_max_tokens(self) -> tuple[int | None, str | None]:
        # OpenAI's newer name wins over the deprecated `max_tokens`, as in vLLM.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return super().requested_max_tokens()


def parse_body(body_class: type[Body], content_type: str | None, body: bytes, required: str) -> Body:
    """The request body as `body_class`, or a `RequestError` that says what is wrong and where.

    `required` names the field an empty body lacks (the one a newcomer must send first).
    """
    media_type = (content_type or "").split(";")[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise invalid(
            f"the request body must be JSON: send Content-Type: application/json (got {media_type})"
        )
    if not body.strip():
        raise invalid(f"the request body is empty: expected a JSON object with `{required}`", required)
    try:
        raw = json.loads(body)
    except ValueError as error:  # also bytes that are not UTF-8
        raise invalid(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise invalid("the request body nests JSON deeper than this server parses") from None
    if not isinstance(raw, dict):
        raise invalid(f"the request body must be a JSON object, got {type(raw).__name__}")
    try:
        return body_class.model_validate(raw)
    except ValidationError as error:
        raise validation_error(error) from None


def validation_error(error: ValidationError, prefix: str = "") -> RequestError:
    """Pydantic's first complaint as a 400 whose `param` is the field's dotted path."""
    first = error.errors(include_url=False)[0]
    param = prefix + ".".join(str(part) for part in _field_path(first["loc"]))
    if first["type"] == "missing":
        return invalid(f"`{param}` is required", param)
    message = first["msg"] if param and first["msg"].startswith(param) else f"`{param}`: {first['msg']}"
    return invalid(message, param or None)


def _field_path(loc: tuple[int | str, ...]) -> list[int | str]:
    """`loc` without pydantic's union-member tags ("constrained-int", "list[...]", ...)."""
    return [part for part in loc if isinstance(part, int) or part.isidentifier()]


def completion_body(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage: dict[str, Any] | None,
    *,
    chat: bool,
) -> dict[str, Any]:
    """A whole (non-streaming) response, or with `usage=None` one streaming event's body."""
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
        kind = "text_completion"
    choice["finish_reason"] = finish_reason
    return _envelope(request_id, kind, model, [choice], usage=usage)


def stream_event(
    request_id: str, model: str, text: str, finish_reason: str | None, *, chat: bool, first: bool
) -> dict[str, Any]:
    """One SSE event body for a step's text (OpenAI's chunk objects)."""
    if chat:
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {"index": 0, "delta": delta}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
        kind = "text_completion"
    choice["finish_reason"] = finish_reason
    return _envelope(request_id, kind, model, [choice])


def usage_event(request_id: str, model: str, usage: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """The final `stream_options.include_usage` event: no choices, only usage."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    return _envelope(request_id, kind, model, [], usage=usage)


def _envelope(
    request_id: str, kind: str, model: str, choices: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    """The fields every OpenAI completion object and chunk carries, then `extra` (e.g. usage)."""
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }
