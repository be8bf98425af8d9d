"""The gRPC half of the ingress: `ddtree_serve.v1.DDTreeServe` and `grpc.health.v1.Health`.

Ray Serve's gRPC proxy routes each rpc to the ingress method of the same name (`Generate`,
`Complete`, `ModelInfo`, `Check`, `Watch`); the proxy itself serves reflection. These methods
are thin: they build a `GenerationRequest` and render the Coordinator's chunks as messages.
"""

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf import json_format
from grpc_health.v1 import health_pb2
from pydantic import ValidationError
from ray.serve.grpc_util import RayServegRPCContext

from ddtree_serve.serve.chat import TEXT_PART, ChatTurn, ContentPart
from ddtree_serve.serve.errors import ErrorKind, RequestError, invalid
from ddtree_serve.serve.grpc_decode import decode
from ddtree_serve.serve.ingress_core import (
    HEALTH_TIMEOUT_S,
    REQUEST_ID_HEADER,
    IngressCore,
    as_error,
    logger,
)
from ddtree_serve.serve.openai_api import SamplingFields, validation_error
from ddtree_serve.serve.protocol import GenerationChunk, GenerationRequest, Usage
from ddtree_serve.serve.protos import SERVICE_NAME, pb2
from ddtree_serve.serve.tracing import Tracing, carrier_from_pairs

_WATCH_INTERVAL_S = 5.0
_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "draft_budget")


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


def _set_status(context: RayServegRPCContext, error: RequestError) -> None:
    context.set_code(error.kind.grpc_code)
    context.set_details(error.message)


def _decoded(message_class: Any, raw: bytes | Any, context: RayServegRPCContext) -> Any:
    """The decoded request of a method without a chunk stream; undecodable: status set, raised."""
    try:
        return decode(message_class, raw)
    except RequestError as error:
        _set_status(context, error)
        raise


def _chat_turns(messages: Any) -> list[ChatTurn]:
    """`ChatMessage`s as turns: `content`, or `content_parts` (OpenAI's list of parts), not both."""
    turns = []
    for index, message in enumerate(messages):
        if message.content and len(message.content_parts) > 0:
            raise invalid("set content or content_parts, not both", f"messages.{index}.content_parts")
        parts = [ContentPart(part.type, part.text) for part in message.content_parts]
        turns.append(ChatTurn(message.role, tuple(parts) or (ContentPart(TEXT_PART, message.content),)))
    return turns


class GrpcAdapter(IngressCore):
    """gRPC methods of the ingress deployment; requests arrive as bytes (see `protos`)."""

    def _grpc_request(self, raw: bytes | Any, context: RayServegRPCContext) -> GenerationRequest:
        message = decode(pb2.GenerateRequest, raw)
        metadata = dict(context.invocation_metadata())
        if message.request_id:
            request_id = self._check_request_id(message.request_id, "request_id")
        elif metadata.get(REQUEST_ID_HEADER):  # an empty one is none, as over HTTP
            request_id = self._check_request_id(metadata[REQUEST_ID_HEADER], REQUEST_ID_HEADER)
        else:
            request_id = context.request_id() or f"grpc-{uuid.uuid4().hex}"
        self._check_model(message.model)
        prompt = self._grpc_prompt(message)
        sampling_message = message.sampling
        fields: dict[str, Any] = {
            name: getattr(sampling_message, name)
            for name in _OPTIONAL_SAMPLING_FIELDS
            if sampling_message.HasField(name)
        }
        try:
            sampling_fields = SamplingFields.model_validate(
                {**fields, "stop": list(sampling_message.stop), "ignore_eos": sampling_message.ignore_eos}
            )
        except ValidationError as error:
            raise validation_error(error, prefix="sampling.") from None
        sampling = sampling_fields.sampling_params(self._defaults)
        if len(message.messages) > 0:
            sampling = self._chat.with_end_of_turn(sampling)
        max_tokens_param = "sampling.max_tokens" if "max_tokens" in fields else None
        context.set_trailing_metadata([(REQUEST_ID_HEADER, request_id)])
        return GenerationRequest(request_id, prompt, sampling, max_tokens_param=max_tokens_param)

    def _grpc_prompt(self, message: Any) -> str | tuple[int, ...]:
        """The one prompt source that is set, checked (a chat rendered by the target's template)."""
        given = [
            name
            for name, present in (
                ("prompt", bool(message.prompt)),
                ("messages", len(message.messages) > 0),
                ("prompt_token_ids", len(message.prompt_token_ids) > 0),
            )
            if present
        ]
        if len(given) > 1:
            raise invalid(f"set exactly one of prompt, messages, prompt_token_ids; got {given}", given[1])
        has_kwargs = message.HasField("chat_template_kwargs")
        if has_kwargs and given != ["messages"]:
            raise invalid("chat_template_kwargs applies to messages only", "chat_template_kwargs")
        if given == ["messages"]:
            kwargs = json_format.MessageToDict(message.chat_template_kwargs) if has_kwargs else None
            return self._chat_prompt(_chat_turns(message.messages), kwargs)
        if given == ["prompt_token_ids"]:
            if any(token_id < 0 for token_id in message.prompt_token_ids):
                raise invalid("prompt_token_ids must be >= 0", "prompt_token_ids")
            return self._check_prompt(tuple(message.prompt_token_ids))
        return self._check_prompt(message.prompt)

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
                request = dataclasses.replace(request, trace_carrier=Tracing.carrier_of(span))
                logger.info("request %s: grpc %s", request.request_id, rpc)
                first, stream = await self._open(request)
                async for chunk in self._rest(first, stream):
                    yield chunk
        except Exception as error:
            mapped = as_error(error)
            _set_status(context, mapped)
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
        _decoded(pb2.ModelInfoRequest, message, grpc_context)
        info = await self._coordinator.model_info.remote()
        return pb2.ModelInfoResponse(model=self._config.model_name, **info)

    # grpc.health.v1.Health (the standard service, routed here by method name like ours)

    async def _serving_status(self, service: str) -> int | None:
        """SERVING / NOT_SERVING for our services; None for a service this server does not have."""
        if service not in ("", SERVICE_NAME):
            return None
        try:
            await asyncio.wait_for(self._coordinator.stats.remote(), HEALTH_TIMEOUT_S)
        except Exception:
            return health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse.SERVING

    async def Check(self, message: Any, grpc_context: RayServegRPCContext) -> Any:
        request = _decoded(health_pb2.HealthCheckRequest, message, grpc_context)
        status = await self._serving_status(request.service)
        if status is None:
            grpc_context.set_code(ErrorKind.NOT_FOUND.grpc_code)
            grpc_context.set_details(f"unknown service {request.service!r}")
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, message: Any, grpc_context: RayServegRPCContext) -> AsyncIterator[Any]:
        """Sends the status now and on every change, until the client cancels."""
        request = _decoded(health_pb2.HealthCheckRequest, message, grpc_context)
        last = None
        while True:
            status = await self._serving_status(request.service)
            status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN if status is None else status
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(_WATCH_INTERVAL_S)
