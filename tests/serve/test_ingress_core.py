"""`as_error`: every failure the ingress sees, as the status both protocols answer (no cluster).

A Coordinator replica that died (its node removed, its process killed) must read as retriable:
Serve replaces the group, so the client gets 503 + Retry-After / UNAVAILABLE, and a stream
already under way ends with an error event of that type instead of `internal_error`.
"""

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace

import grpc
import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError

from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.errors import ErrorKind, RequestError
from ddtree_serve.serve.ingress import Ingress, error_response
from ddtree_serve.serve.ingress_core import IngressCore, as_error
from ddtree_serve.serve.protocol import GenerationChunk


def remote_failure(cause: BaseException) -> BaseException:
    """`cause` as Ray re-raises it from another process: a RayTaskError subclassing its class."""
    return RayTaskError("generate", "Traceback ...", cause).as_instanceof_cause()


def lost_replica_errors() -> list[BaseException]:
    wrapped = RuntimeError("stream broke")
    wrapped.__cause__ = ActorDiedError()
    return [
        ActorDiedError(),
        ActorUnavailableError("the actor is restarting", None),
        ReplicaUnavailableError("Coordinator#abc"),
        remote_failure(ActorDiedError()),
        wrapped,
    ]


@pytest.mark.parametrize("error", lost_replica_errors(), ids=lambda error: type(error).__name__)
def test_a_lost_coordinator_replica_is_retriable_on_both_protocols(error: BaseException) -> None:
    mapped = as_error(error)
    assert mapped.kind is ErrorKind.UNAVAILABLE
    assert mapped.kind.grpc_code == grpc.StatusCode.UNAVAILABLE
    response = error_response(mapped)
    assert response.status_code == 503 and response.headers["Retry-After"].isdigit()
    assert json.loads(response.body)["error"]["type"] == "service_unavailable_error"


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (RuntimeError("a bug"), ErrorKind.INTERNAL),
        (remote_failure(ValueError("a bug in the replica")), ErrorKind.INTERNAL),
        (BackPressureError(num_queued_requests=3, max_queued_requests=2), ErrorKind.OVERLOADED),
        (RequestError(ErrorKind.INVALID_ARGUMENT, "bad", "prompt"), ErrorKind.INVALID_ARGUMENT),
        (remote_failure(RequestError(ErrorKind.UNAVAILABLE, "target lost")), ErrorKind.UNAVAILABLE),
    ],
    ids=["bug", "remote_bug", "backpressure", "request_error", "remote_request_error"],
)
def test_other_failures_keep_their_kind(error: BaseException, kind: ErrorKind) -> None:
    assert as_error(error).kind is kind


def test_a_stream_whose_replica_dies_ends_with_a_retriable_error_event() -> None:
    ingress = SimpleNamespace(_config=ServeConfig())  # all that `_sse` reads of the ingress

    async def chunks() -> AsyncIterator[GenerationChunk]:
        yield GenerationChunk(request_id="r", text="Once", token_ids=(1,), finish_reason=None)
        raise ActorDiedError()

    async def events() -> list[str]:
        return [
            event async for event in Ingress._sse(ingress, chunks(), "r", chat=False, include_usage=False)
        ]

    lines = asyncio.run(events())
    assert lines[-1] == "data: [DONE]\n\n"
    error_event = json.loads(lines[-2].removeprefix("data: "))
    assert error_event["error"]["type"] == "service_unavailable_error"
    assert error_event["error"]["code"] == "503"


class _StreamCancelledDownstream:
    """A Coordinator stream whose replica Serve stopped: `__anext__` raises CancelledError."""

    def __init__(self, chunks_before: int) -> None:
        self.left = chunks_before
        self.cancelled = False

    async def __anext__(self) -> GenerationChunk:
        if self.left == 0:
            raise asyncio.CancelledError()
        self.left -= 1
        return GenerationChunk(request_id="r", text="Once", token_ids=(1,), finish_reason=None)

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize("chunks_before", [0, 2], ids=["before_first_chunk", "mid_stream"])
def test_a_replica_stopped_under_a_stream_is_retriable_not_a_cut(chunks_before: int) -> None:
    # Serve stops the replicas of a removed node by cancelling their requests; the ingress task
    # itself was not cancelled, so this must answer UNAVAILABLE instead of escaping as a cancel.
    stream = _StreamCancelledDownstream(chunks_before)
    ingress = SimpleNamespace(
        _coordinator=SimpleNamespace(
            options=lambda **_: SimpleNamespace(generate=SimpleNamespace(remote=lambda _request: stream))
        )
    )

    async def consume() -> list[GenerationChunk]:
        first, rest = await IngressCore._open(ingress, None)
        return [chunk async for chunk in IngressCore._rest(first, rest)]

    with pytest.raises(RequestError) as raised:
        asyncio.run(consume())
    assert raised.value.kind is ErrorKind.UNAVAILABLE
    assert stream.cancelled


def test_a_client_that_goes_away_still_cancels() -> None:
    """The ingress task's own cancellation propagates: it is not mistaken for a lost group."""

    class Hanging(_StreamCancelledDownstream):
        async def __anext__(self) -> GenerationChunk:
            if self.left == 0:
                await asyncio.Event().wait()
            return await super().__anext__()

    stream = Hanging(1)

    async def consume() -> None:
        first = await stream.__anext__()
        task = asyncio.create_task(_drain(IngressCore._rest(first, stream)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(consume())
    assert stream.cancelled


async def _drain(chunks: AsyncIterator[GenerationChunk]) -> None:
    async for _ in chunks:
        pass
