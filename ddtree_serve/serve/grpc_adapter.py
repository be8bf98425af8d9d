"""The gRPC half of the ingress: `ddtree_serve.v1.DDTreeServe` and `grpc.health.v1.Health`.

Ray Serve's gRPC proxy routes each rpc to the ingress method of the same name (`Generate`,
`Complete`, `ModelInfo`, `Check`, `Watch`); the proxy itself serves reflection. These methods
are thin: they build a `GenerationRequest` and render the Coordinator's chunks as messages.
"""

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from grpc_health.v1 import health_pb2
from ray.serve.grpc_util import RayServegRPCContext

from ddtree_serve.serve.errors import ErrorKind, invalid
from ddtree_serve.serve.ingress_core import (
    HEALTH_TIMEOUT_S,
    REQUEST_ID_HEADER,
    IngressCore,
    as_error,
    logger,
)
from ddtree_serve.serve.openai_api import build_sampling_params, validated_messages
from ddtree_serve.serve.protocol import CHAT_END, GenerationChunk, GenerationRequest, Usage, render_chat
from ddtree_serve.serve.protos import SERVICE_NAME, pb2
from ddtree_serve.serve.tracing import Tracing, carrier_from_pairs

_WATCH_INTERVAL_S = 5.0


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


class GrpcAdapter(IngressCore):
    """gRPC methods of the ingress deployment."""

    def _grpc_request(self, message: Any, context: RayServegRPCContext) -> GenerationRequest:
        self._check_model(message.model)
        has_messages = len(message.messages) > 0
        if message.prompt and has_messages:
            raise invalid("set either prompt or messages, not both", "prompt")
        if has_messages:
            messages = validated_messages([(m.role, m.content) for m in message.messages])
            prompt = self._check_prompt(render_chat(messages))  # the limit HTTP chat applies too
            extra_stop: tuple[str, ...] = (CHAT_END,)
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
            draft_budget=sampling_message.draft_budget if has("draft_budget") else None,
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
            mapped = as_error(error)
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
