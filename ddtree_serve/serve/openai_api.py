"""OpenAI-compatible request bodies and response rendering for /v1/completions and /v1/chat.

Only what the engine can honour is accepted: one choice (`n` = 1), no logprobs, no echo,
no penalties, logit bias or suffix (a non-neutral value is refused rather than dropped).
Unknown fields are ignored the way OpenAI-compatible servers do; known fields are checked
here and by `SamplingParams`, and every refusal becomes a `RequestError` (HTTP 400).
"""

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.serve.errors import invalid
from ddtree_serve.serve.protocol import CHAT_END, CHAT_ROLES, render_chat


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints (OpenAI names; `top_k`, `ignore_eos`, `draft_budget` are
    extensions: `draft_budget` caps the request's draft tree nodes per step, below the engine's)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    ignore_eos: bool = False
    draft_budget: int | None = None
    # Known OpenAI fields the engine cannot honour: refused unless neutral, never silently dropped.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None

    def sampling_params(self, defaults: SamplingParams, extra_stop: tuple[str, ...] = ()) -> SamplingParams:
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
        if self.seed is not None and not 0 <= self.seed < 2**64:  # a torch generator's seed range
            raise invalid(f"seed must be in [0, 2**64), got {self.seed}", "seed")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return build_sampling_params(
            defaults,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=stop + extra_stop,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            draft_budget=self.draft_budget,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr]
    echo: bool = False
    suffix: str | None = None

    def prompt_text(self) -> str:
        if self.echo:
            raise invalid("echo is not supported", "echo")
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise invalid("exactly one prompt per request is supported", "prompt")
            return self.prompt[0]
        return self.prompt


class ChatMessage(BaseModel):
    role: StrictStr
    content: StrictStr


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def prompt_text(self) -> str:
        return render_chat(validated_messages([(m.role, m.content) for m in self.messages]))

    def sampling_params(self, defaults: SamplingParams, extra_stop: tuple[str, ...] = ()) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        # The assistant turn ends at ChatML's end marker, whether or not it is one token.
        return super().sampling_params(defaults, (*extra_stop, CHAT_END))


def validated_messages(messages: list[tuple[str, str]]) -> list[tuple[str, str]]:
    if not messages:
        raise invalid("messages must not be empty", "messages")
    for role, _ in messages:
        if role not in CHAT_ROLES:
            raise invalid(f"message role must be one of {sorted(CHAT_ROLES)}, got {role!r}", "messages")
    return messages


def build_sampling_params(
    defaults: SamplingParams,
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    stop: tuple[str, ...],
    seed: int | None,
    ignore_eos: bool,
    draft_budget: int | None = None,
) -> SamplingParams:
    """`SamplingParams` from optional wire fields over the server defaults; errors -> 400."""
    try:
        return SamplingParams(
            max_tokens=defaults.max_tokens if max_tokens is None else max_tokens,
            temperature=defaults.temperature if temperature is None else temperature,
            top_p=defaults.top_p if top_p is None else top_p,
            top_k=defaults.top_k if top_k is None else top_k,
            stop=stop,
            seed=seed,
            ignore_eos=ignore_eos,
            draft_budget=draft_budget,
        )
    except ValueError as error:
        raise invalid(str(error)) from error


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
