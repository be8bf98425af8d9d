"""The one ingress deployment: OpenAI-compatible HTTP and gRPC, thin adapters over the Coordinator.

Both protocols turn their request into a `GenerationRequest`, open one Coordinator stream and
render its `GenerationChunk`s; errors map through `errors.ErrorKind` to HTTP status + OpenAI
body or gRPC status + details. A stream is opened by awaiting its first chunk, so a refused
request (bad prompt, full queue) gets its status before any byte of the response is sent.
Ray Serve routes each gRPC rpc to the method of the same name here (`Generate`, `Complete`,
`ModelInfo`, and the standard `grpc.health.v1.Health` `Check` / `Watch`).
"""

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from grpc_health.v1 import health_pb2
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.grpc_util import RayServegRPCContext
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.errors import ErrorKind, RequestError, as_request_error, invalid
from ddtree_serve.serve.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    build_sampling_params,
    completion_body,
    stream_event,
    usage_event,
    validated_messages,
)
from ddtree_serve.serve.protocol import GenerationChunk, GenerationRequest, Usage, render_chat
from ddtree_serve.serve.protos import SERVICE_NAME, pb2
from ddtree_serve.serve.tracing import Tracing, carrier_from_pairs

logger = logging.getLogger("ray.serve")

REQUEST_ID_HEADER = "x-request-id"
_HEALTH_TIMEOUT_S = 5.0
_WATCH_INTERVAL_S = 5.0

app = FastAPI(title="ddtree-serve", description="Speculative decoding with DDTree draft trees.")


def _error_response(error: RequestError) -> JSONResponse:
    return JSONResponse(error.openai_body(), status_code=error.kind.http_status)


@app.exception_handler(RequestError)
async def _request_error(_: Request, error: RequestError) -> JSONResponse:
    return _error_response(error)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    """Bad JSON and schema violations: OpenAI's 400 body naming the first offending field."""
    first = error.errors()[0] if error.errors() else {}
    location = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
    message = str(first.get("msg", "invalid request")) + (f" (at {location})" if location else "")
    return _error_response(invalid(message, location))


def _as_error(error: BaseException) -> RequestError:
    """Every failure as a `RequestError`, so both protocols answer it the same way."""
    if (request_error := as_request_error(error)) is not None:
        return request_error
    if isinstance(error, BackPressureError):
        return RequestError(ErrorKind.OVERLOADED, "the server is at capacity; retry later")
    logger.exception("request failed", exc_info=error)
    return RequestError(ErrorKind.INTERNAL, f"internal error: {type(error).__name__}")


def _usage_pb(usage: Usage | None) -> Any:
    if usage is None:
        return None
    return pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        num_steps=usage.num_steps,
        acceptance_length=usage.acceptance_length,
    )


@serve.ingress(app)
class Ingress:
    """Stateless front door; scales independently of the speculation groups behind it."""

    def __init__(self, coordinator: DeploymentHandle, config: ServeConfig) -> None:
        self._coordinator = coordinator
        self._config = config
        self._defaults = config.engine.default_sampling_params()
        self._tracing = Tracing(config.observability.tracing, component="ingress")

    # ------------------------------------------------------------------ shared by both protocols

    def _check_model(self, model: str | None) -> None:
        if model not in (None, "", self._config.model_name):
            raise RequestError(ErrorKind.NOT_FOUND, f"The model `{model}` does not exist", "model")

    def _check_prompt(self, prompt: str) -> str:
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        if len(prompt) > self._config.limits.max_prompt_chars:
            raise invalid(
                f"prompt has {len(prompt)} characters, more than the limit of "
                f"{self._config.limits.max_prompt_chars}",
                "prompt",
            )
        return prompt

    async def _open(self, request: GenerationRequest) -> tuple[GenerationChunk, DeploymentResponseGenerator]:
        """Starts the Coordinator stream and waits for its first chunk (or its refusal)."""
        stream: DeploymentResponseGenerator = self._coordinator.options(stream=True).generate.remote(request)
        try:
            first = await stream.__anext__()
        except BaseException as error:
            stream.cancel()
            if isinstance(error, asyncio.CancelledError):
                raise
            raise _as_error(error) from error
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
                chunk: GenerationChunk = await stream.__anext__()
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if not finished:
                stream.cancel()

    # ------------------------------------------------------------------------------------ HTTP

    @app.get("/health")
    async def health(self) -> JSONResponse:
        try:
            stats = await asyncio.wait_for(self._coordinator.stats.remote(), _HEALTH_TIMEOUT_S)
        except Exception as error:
            return JSONResponse({"status": "unavailable", "error": str(error)}, status_code=503)
        return JSONResponse({"status": "ok", **stats})

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": self._config.model_name, "object": "model", "created": 0, "owned_by": "ddtree-serve"}
            ],
        }

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, raw: Request) -> Any:
        self._check_model(body.model)
        prompt = self._check_prompt(body.prompt_text())
        return await self._http_generate(body, prompt, raw, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, raw: Request) -> Any:
        self._check_model(body.model)
        prompt = self._check_prompt(body.prompt_text())
        return await self._http_generate(body, prompt, raw, chat=True)

    async def _http_generate(
        self, body: CompletionRequest | ChatCompletionRequest, prompt: str, raw: Request, *, chat: bool
    ) -> Any:
        # Serve's proxy puts the client's x-request-id (or one it generates) on the request and
        # echoes it in the response headers; the body id and the logs use the same value.
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = raw.headers.get(REQUEST_ID_HEADER) or f"{prefix}-{uuid.uuid4().hex}"
        sampling = body.sampling_params(self._defaults)
        route = "/v1/chat/completions" if chat else "/v1/completions"
        with self._tracing.span(
            f"POST {route}", carrier_from_pairs(raw.headers.items()), {"request_id": request_id}
        ) as span:
            request = GenerationRequest(request_id, prompt, sampling, Tracing.carrier_of(span))
            logger.info("request %s: %s, stream=%s", request_id, route, body.stream)
            first, stream = await self._open(request)
            chunks = self._rest(first, stream)
            if body.stream:
                events = self._sse(chunks, request_id, chat=chat, include_usage=body.include_usage)
                return StreamingResponse(events, media_type="text/event-stream")
            text, finish_reason, usage = [], None, None
            async for chunk in chunks:
                text.append(chunk.text)
                finish_reason, usage = chunk.finish_reason, chunk.usage or usage
            payload = completion_body(
                request_id,
                self._config.model_name,
                "".join(text),
                finish_reason,
                usage.openai_dict() if usage else None,
                chat=chat,
            )
            return JSONResponse(payload)

    async def _sse(
        self, chunks: AsyncIterator[GenerationChunk], request_id: str, *, chat: bool, include_usage: bool
    ) -> AsyncIterator[str]:
        model = self._config.model_name
        first = True
        try:
            async for chunk in chunks:
                event = stream_event(
                    request_id, model, chunk.text, chunk.finish_reason, chat=chat, first=first
                )
                first = False
                yield f"data: {json.dumps(event)}\n\n"
                if chunk.usage is not None and include_usage:
                    usage = usage_event(request_id, model, chunk.usage.openai_dict(), chat=chat)
                    yield f"data: {json.dumps(usage)}\n\n"
        except Exception as error:
            # Headers are out: report the failure in-band the way OpenAI streams do.
            yield f"data: {json.dumps(_as_error(error).openai_body())}\n\n"
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------------------------ gRPC

    def _grpc_request(self, message: Any, context: RayServegRPCContext) -> GenerationRequest:
        self._check_model(message.model)
        has_messages = len(message.messages) > 0
        if message.prompt and has_messages:
            raise invalid("set either prompt or messages, not both", "prompt")
        if has_messages:
            prompt = render_chat(validated_messages([(m.role, m.content) for m in message.messages]))
            extra_stop: tuple[str, ...] = ("<|im_end|>",)
        else:
            prompt = self._check_prompt(message.prompt)
            extra_stop = ()
        sampling_message = message.sampling
        has = sampling_message.HasField
        sampling = build_sampling_params(
            self._defaults,
            max_tokens=sampling_message.max_tokens if has("max_tokens") else None,
            temperature=sampling_message.temperature if has("temperature") else None,
            top_p=sampling_message.top_p if has("top_p") else None,
            top_k=sampling_message.top_k if has("top_k") else None,
            stop=(*sampling_message.stop, *extra_stop),
            seed=sampling_message.seed if has("seed") else None,
            ignore_eos=sampling_message.ignore_eos,
        )
        metadata = dict(context.invocation_metadata())
        request_id = (
            message.request_id
            or metadata.get(REQUEST_ID_HEADER)
            or context.request_id()
            or f"grpc-{uuid.uuid4().hex}"
        )
        context.set_trailing_metadata([(REQUEST_ID_HEADER, request_id)])
        return GenerationRequest(request_id, prompt, sampling)

    async def _grpc_chunks(
        self, message: Any, context: RayServegRPCContext, rpc: str
    ) -> AsyncIterator[GenerationChunk]:
        """The chunk stream of one gRPC call; a refusal sets the status, then raises.

        Serve's proxy takes the status from the context only along with a response message,
        which a refused stream never sends; raising after `set_code` makes the proxy use the
        code we set (Serve wraps it in `gRPCStatusError`) for unary and streaming calls alike.
        """
        try:
            request = self._grpc_request(message, context)
            carrier = carrier_from_pairs(context.invocation_metadata())
            with self._tracing.span(f"grpc {rpc}", carrier, {"request_id": request.request_id}) as span:
                request = GenerationRequest(
                    request.request_id, request.prompt, request.sampling, Tracing.carrier_of(span)
                )
                logger.info("request %s: grpc %s", request.request_id, rpc)
                first, stream = await self._open(request)
                async for chunk in self._rest(first, stream):
                    yield chunk
        except Exception as error:
            mapped = _as_error(error)
            context.set_code(mapped.kind.grpc_code)
            context.set_details(mapped.message)
            if mapped is error:
                raise
            raise mapped from error

    async def Generate(self, message: Any, grpc_context: RayServegRPCContext) -> AsyncIterator[Any]:
        async for chunk in self._grpc_chunks(message, grpc_context, "Generate"):
            yield pb2.GenerateChunk(
                request_id=chunk.request_id,
                text=chunk.text,
                token_ids=chunk.token_ids,
                finish_reason=chunk.finish_reason or "",
                usage=_usage_pb(chunk.usage),
            )

    async def Complete(self, message: Any, grpc_context: RayServegRPCContext) -> Any:
        request_id, text, token_ids, finish_reason, usage = "", [], [], "", None
        async for chunk in self._grpc_chunks(message, grpc_context, "Complete"):
            request_id = chunk.request_id
            text.append(chunk.text)
            token_ids.extend(chunk.token_ids)
            finish_reason, usage = chunk.finish_reason or finish_reason, chunk.usage or usage
        return pb2.GenerateResponse(
            request_id=request_id,
            text="".join(text),
            token_ids=token_ids,
            finish_reason=finish_reason,
            usage=_usage_pb(usage),
        )

    async def ModelInfo(self, message: Any, grpc_context: RayServegRPCContext) -> Any:
        info = await self._coordinator.model_info.remote()
        return pb2.ModelInfoResponse(model=self._config.model_name, **info)

    # ------------------------------------------------------- grpc.health.v1.Health (standard)

    async def _serving_status(self, service: str) -> int | None:
        """SERVING / NOT_SERVING for our services; None for a service this server does not have."""
        if service not in ("", SERVICE_NAME):
            return None
        try:
            await asyncio.wait_for(self._coordinator.stats.remote(), _HEALTH_TIMEOUT_S)
        except Exception:
            return health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse.SERVING

    async def Check(self, message: Any, grpc_context: RayServegRPCContext) -> Any:
        status = await self._serving_status(message.service)
        if status is None:
            grpc_context.set_code(ErrorKind.NOT_FOUND.grpc_code)
            grpc_context.set_details(f"unknown service {message.service!r}")
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, message: Any, grpc_context: RayServegRPCContext) -> AsyncIterator[Any]:
        """Sends the status now and on every change, until the client cancels."""
        last = None
        while True:
            status = await self._serving_status(message.service)
            status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN if status is None else status
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(_WATCH_INTERVAL_S)
