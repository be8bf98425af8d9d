"""What the HTTP and gRPC adapters share: checks, chat rendering, opening a Coordinator stream,
error mapping.

Both protocols turn their request into a `GenerationRequest`, open one Coordinator stream and
render its `GenerationChunk`s; errors map through `errors.ErrorKind` to HTTP status + OpenAI
body or gRPC status + details. A stream is opened by awaiting its first chunk, so a refused
request (bad prompt, full queue) gets its status before any byte of the response is sent.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from ddtree_serve.serve.chat import ChatFormat, ChatTurn
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.errors import ErrorKind, RequestError, as_request_error, invalid, is_lost_replica
from ddtree_serve.serve.protocol import GenerationChunk, GenerationRequest
from ddtree_serve.serve.tracing import Tracing

logger = logging.getLogger("ray.serve")

REQUEST_ID_HEADER = "x-request-id"
HEALTH_TIMEOUT_S = 5.0
# Request ids travel in logs, response bodies and gRPC trailing metadata (8 KiB in all by default).
MAX_REQUEST_ID_CHARS = 256

PromptT = TypeVar("PromptT", str, tuple[int, ...])


def cancelled_downstream() -> bool:
    """True inside an `except CancelledError` when the Coordinator's side was cancelled, not us.

    Serve stops a replica on a drained or removed node by cancelling its in-flight requests; the
    handle re-raises that in the ingress as `asyncio.CancelledError` although the ingress task
    itself was never cancelled (`cancelling()` counts only cancellations of this task). That is a
    lost group, retriable, not a client that went away.
    """
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


def as_error(error: BaseException) -> RequestError:
    """Every failure as a `RequestError`, so both protocols answer it the same way."""
    if (request_error := as_request_error(error)) is not None:
        return request_error
    if isinstance(error, BackPressureError):
        return RequestError(ErrorKind.OVERLOADED, "the server is at capacity; retry later")
    if is_lost_replica(error) or isinstance(error, asyncio.CancelledError):
        logger.warning("request lost its speculation group (%s); answered as retriable", type(error).__name__)
        return RequestError(
            ErrorKind.UNAVAILABLE, "the speculation group serving this request was lost; retry"
        )
    logger.exception("request failed", exc_info=error)
    return RequestError(ErrorKind.INTERNAL, f"internal error: {type(error).__name__}")


class IngressCore:
    """State and helpers of the ingress deployment, protocol-independent."""

    def __init__(self, coordinator: DeploymentHandle, config: ServeConfig, chat: ChatFormat) -> None:
        """`chat` is the served target's chat format, read once when the application is built."""
        self._coordinator = coordinator
        self._config = config
        self._chat = chat
        self._defaults = config.engine.default_sampling_params()
        self._tracing = Tracing(config.observability.tracing, component="ingress")

    def _check_model(self, model: str | None) -> None:
        if model not in (None, "", self._config.model_name):
            raise RequestError(ErrorKind.NOT_FOUND, f"The model `{model}` does not exist", "model")

    @staticmethod
    def _check_request_id(request_id: str, param: str) -> str:
        """Refused before any work: an over-long id would fail only once echoed back."""
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise invalid(
                f"{param} has {len(request_id)} characters, more than the limit of {MAX_REQUEST_ID_CHARS}",
                param,
            )
        return request_id

    def _check_prompt(self, prompt: PromptT) -> PromptT:
        """Text or token ids, non-empty; text within the character limit (ids: the token limit)."""
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        if isinstance(prompt, str) and len(prompt) > self._config.limits.max_prompt_chars:
            raise invalid(
                f"prompt has {len(prompt)} characters, more than the limit of "
                f"{self._config.limits.max_prompt_chars}",
                "prompt",
            )
        return prompt

    def _chat_prompt(self, turns: Sequence[ChatTurn], chat_template_kwargs: dict[str, Any] | None) -> str:
        """The conversation rendered by the target's template, within the prompt limits."""
        return self._check_prompt(self._chat.render(turns, chat_template_kwargs))

    async def _open(self, request: GenerationRequest) -> tuple[GenerationChunk, DeploymentResponseGenerator]:
        """Starts the Coordinator stream and waits for its first chunk (or its refusal)."""
        stream: DeploymentResponseGenerator = self._coordinator.options(stream=True).generate.remote(request)
        try:
            first = await stream.__anext__()
        except BaseException as error:
            stream.cancel()
            if isinstance(error, asyncio.CancelledError) and not cancelled_downstream():
                raise
            raise as_error(error) from error
        return first, stream

    @staticmethod
    async def _rest(
        first: GenerationChunk, stream: DeploymentResponseGenerator
    ) -> AsyncIterator[GenerationChunk]:
        """All chunks from the first; cancels the Coordinator request if the caller goes away."""
        finished = first.finish_reason is not None
        try:
            yield first
            while not finished:
                try:
                    chunk: GenerationChunk = await stream.__anext__()
                except asyncio.CancelledError as error:
                    if cancelled_downstream():
                        raise as_error(error) from error
                    raise
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if not finished:
                stream.cancel()
