"""What the ingress sends the Coordinator and what comes back, independent of HTTP or gRPC.

Both protocol adapters turn their request into a `GenerationRequest` and render the
`GenerationChunk` stream in their own format; the Coordinator never sees a wire format.
"""

from dataclasses import dataclass, field

from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.serve.errors import invalid


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    num_steps: int  # verify steps (draft + verify each); the prefill token is not one
    acceptance_length: float  # mean tokens committed per step (tau)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def openai_dict(self) -> dict[str, int | float]:
        """OpenAI `usage` plus the speculation figures."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "num_steps": self.num_steps,
            "acceptance_length": self.acceptance_length,
        }


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: str | tuple[int, ...]  # text (a chat rendered by its template) or token ids
    sampling: SamplingParams
    trace_carrier: dict[str, str] = field(default_factory=dict)  # W3C headers of the caller's span
    # The request field that chose `sampling.max_tokens` ("max_tokens", "max_completion_tokens",
    # "sampling.max_tokens"); None = the server default, which is capped to the context instead.
    max_tokens_param: str | None = None

    def check_context_length(self, num_prompt_tokens: int, context_length: int) -> None:
        """Refuses a client-chosen max_tokens that cannot fit (400, as vLLM and OpenAI answer)."""
        requested = num_prompt_tokens + self.sampling.max_tokens
        if self.max_tokens_param is not None and requested > context_length:
            raise invalid(
                f"This model's maximum context length is {context_length} tokens. However, you "
                f"requested {requested} tokens ({num_prompt_tokens} in the prompt, "
                f"{self.sampling.max_tokens} in the completion). Please reduce the length of the "
                f"prompt or {self.max_tokens_param}.",
                self.max_tokens_param,
            )


@dataclass(frozen=True)
class GenerationChunk:
    """Text and tokens committed by one engine step (or by the steps of one stream batching
    interval); the last chunk carries finish and usage."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None
