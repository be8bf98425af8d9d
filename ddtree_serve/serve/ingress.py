"""The one ingress deployment: OpenAI-compatible HTTP here, gRPC inherited from `GrpcAdapter`.

Serve requires both protocols on one deployment class, so the class is assembled from three
small parts: `IngressCore` (shared checks, Coordinator streams, errors), `GrpcAdapter` (gRPC
methods) and the FastAPI routes below.
"""

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException

from ddtree_serve.serve.errors import RETRY_AFTER_S, ErrorKind, RequestError
from ddtree_serve.serve.grpc_adapter import GrpcAdapter
from ddtree_serve.serve.ingress_core import HEALTH_TIMEOUT_S, REQUEST_ID_HEADER, as_error, logger
from ddtree_serve.serve.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_body,
    parse_body,
    stream_event,
    usage_event,
)
from ddtree_serve.serve.protocol import GenerationChunk, GenerationRequest
from ddtree_serve.serve.tracing import Tracing, carrier_from_pairs

app = FastAPI(title="ddtree-serve", description="Speculative decoding with DDTree draft trees.")

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health")


def error_response(error: RequestError) -> Response:
    """OpenAI's error object; ASCII JSON, so no input echoed in a message can break rendering."""
    return Response(
        json.dumps(error.openai_body()),
        status_code=error.kind.http_status,
        media_type="application/json",
        headers=error.kind.http_headers,
    )


@app.exception_handler(RequestError)
async def _request_error(_: Request, error: RequestError) -> Response:
    return error_response(error)


@app.exception_handler(HTTPException)
async def _http_error(request: Request, error: HTTPException) -> Response:
    """Unknown routes and wrong methods in OpenAI's format instead of FastAPI's `detail`."""
    route = f"{request.method} {request.url.path}"
    if error.status_code == 404:
        message = f"Invalid URL ({route}): this server serves {', '.join(ROUTES)}"
        return error_response(RequestError(ErrorKind.NOT_FOUND, message))
    if error.status_code == 405:
        allowed = {name.lower(): value for name, value in (error.headers or {}).items()}.get("allow", "")
        message = f"Method {request.method} is not allowed on {request.url.path} (allowed: {allowed})"
        response = error_response(RequestError(ErrorKind.METHOD_NOT_ALLOWED, message))
        response.headers["Allow"] = allowed
        return response
    return error_response(RequestError(ErrorKind.INVALID_ARGUMENT, str(error.detail)))


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, error: RequestValidationError) -> Response:
    """A route's own parameters (the bodies are parsed by `parse_body`): name the first field."""
    first = error.errors()[0] if error.errors() else {}
    location = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
    message = f"{first.get('msg', 'invalid request')} (at {location or request.url.path})"
    return error_response(RequestError(ErrorKind.INVALID_ARGUMENT, message, location))


@serve.ingress(app)
class Ingress(GrpcAdapter):
    """Stateless front door; scales independently of the speculation groups behind it."""

    @app.get("/health")
    async def health(self) -> JSONResponse:
        try:
            stats = await asyncio.wait_for(self._coordinator.stats.remote(), HEALTH_TIMEOUT_S)
        except Exception as error:
            return JSONResponse(
                {"status": "unavailable", "error": str(error)},
                status_code=503,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return JSONResponse({"status": "ok", **stats})

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        """The served model's card, with vLLM's `max_model_len` (the engine's slot length, capped
        at the target's context length) while its group answers; a group still starting or
        restarting is listed without it rather than failing the listing."""
        card: dict[str, Any] = {
            "id": self._config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "ddtree-serve",
        }
        try:
            info = await asyncio.wait_for(self._coordinator.model_info.remote(), HEALTH_TIMEOUT_S)
        except Exception as error:  # the listing is not the group's health check
            logger.info("model listing without max_model_len: %s", type(error).__name__)
        else:
            card["max_model_len"] = info["max_model_len"]
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(self, raw: Request) -> Any:
        body = parse_body(CompletionRequest, raw.headers.get("content-type"), await raw.body(), "prompt")
        self._check_model(body.model)
        prompt = self._check_prompt(body.prompt_input())
        return await self._http_generate(body, prompt, raw, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, raw: Request) -> Any:
        body = parse_body(
            ChatCompletionRequest, raw.headers.get("content-type"), await raw.body(), "messages"
        )
        self._check_model(body.model)
        prompt = self._chat_prompt(body.chat_turns(), body.chat_template_kwargs)
        return await self._http_generate(body, prompt, raw, chat=True)

    async def _http_generate(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        prompt: str | tuple[int, ...],
        raw: Request,
        *,
        chat: bool,
    ) -> Any:
        # Serve's proxy puts the client's x-request-id (or one it generates) on the request and
        # echoes it in the response headers; the logs use the same value and the body id is it
        # with OpenAI's prefix (vLLM's convention: `cmpl-<x-request-id>`).
        request_id = self._check_request_id(
            raw.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex, REQUEST_ID_HEADER
        )
        completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        sampling = body.sampling_params(self._defaults)
        if chat:
            sampling = self._chat.with_end_of_turn(sampling)
        _, max_tokens_param = body.requested_max_tokens()
        route = "/v1/chat/completions" if chat else "/v1/completions"
        with self._tracing.span(
            f"POST {route}", carrier_from_pairs(raw.headers.items()), {"request_id": request_id}
        ) as span:
            request = GenerationRequest(
                request_id, prompt, sampling, Tracing.carrier_of(span), max_tokens_param
            )
            logger.info("request %s: %s, stream=%s", request_id, route, body.stream)
            first, stream = await self._open(request)
            chunks = self._rest(first, stream)
            if body.stream:
                events = self._sse(chunks, completion_id, chat=chat, include_usage=body.include_usage)
                return StreamingResponse(events, media_type="text/event-stream")
            text, finish_reason, usage = [], None, None
            async for chunk in chunks:
                text.append(chunk.text)
                finish_reason, usage = chunk.finish_reason, chunk.usage or usage
            payload = completion_body(
                completion_id,
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
            yield f"data: {json.dumps(as_error(error).openai_body())}\n\n"
        yield "data: [DONE]\n\n"
