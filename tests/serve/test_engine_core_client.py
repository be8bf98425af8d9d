"""`EngineCoreClient` against a scripted core on a real socket, without Ray: the token deltas it
rebuilds into outputs, the step records it hands to telemetry, an add the core refused, and a
core that dies (`tests/serve/test_engine_core.py` runs the real core in a served app)."""

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

import ddtree_serve.serve.engine_core as engine_core
from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.async_llm import EngineDeadError
from ddtree_serve.engine.builder import bundled_target_dir
from ddtree_serve.engine.interfaces import TargetUnavailableError
from ddtree_serve.engine.request import RequestStats
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.scheduler import QueueFullError
from ddtree_serve.models import load_tokenizer
from ddtree_serve.serve.engine_core import CoreInfo, EngineCoreClient, EngineView
from ddtree_serve.serve.observed_engine import StepRecord
from ddtree_serve.serve.step_sockets import _Listener, recv_message, send_message

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _stats(num_tokens: int) -> RequestStats:
    return RequestStats(3, num_tokens, num_tokens, 2.0)


@pytest.fixture
def core(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[EngineCoreClient, Any, list[StepRecord]]]:
    """A client connected to a scripted core end (its socket), and the step records it observed."""
    monkeypatch.setattr(engine_core.ray, "kill", lambda actor: None)
    listener = _Listener()
    tokenizer = load_tokenizer(bundled_target_dir())
    view = EngineView(
        CoreInfo(16, tokenizer.get_vocab_size(), 512, 33, 479), EngineConfig().to_settings(), tokenizer, None
    )
    records: list[StepRecord] = []
    client = EngineCoreClient(object(), listener.address, view, records.append)
    accepted = listener.accept_any()
    assert accepted is not None and accepted[1] == b"C"
    yield client, accepted[0], records
    accepted[0].close()  # the core's end goes first, as a core that shut down does
    client.shutdown(timeout_s=5.0)


async def _opened(client: EngineCoreClient, end: Any, request_id: str) -> tuple[Any, Any]:
    """A stream of a new request whose add the scripted core has read -> (the stream, its first
    output to come)."""
    stream = client.generate_stream([5, 6, 7], PARAMS, request_id=request_id)
    first = asyncio.ensure_future(stream.__anext__())
    kind, added_id, prompt, params = await asyncio.to_thread(recv_message, end)
    assert (kind, added_id, prompt, params) == ("add", request_id, [5, 6, 7], PARAMS)
    return stream, first


def test_deltas_become_cumulative_outputs_and_each_step_reaches_telemetry_first(core: Any) -> None:
    client, end, records = core

    async def run() -> list[Any]:
        stream, first = await _opened(client, end, "r1")
        send_message(end, ("added", "r1", None, 1))
        for _ in range(500):  # the ack's queue length reaches the view (the client's queue limit)
            if client.engine.num_waiting == 1:
                break
            await asyncio.sleep(0.01)
        assert client.engine.num_waiting == 1
        stats = (1, 0, True, 0, 1, 0.004)
        send_message(end, ("step", [("r1", [11], 1, False, None, None, _stats(1))], None, stats))
        outputs = [await first]
        assert client.engine.num_waiting == 0  # the first tokens' stats: it runs
        lite = (1, {"verify": (0, 10)}, {"r1": 3}, None)
        send_message(end, ("step", [("r1", [12, 13, 14], 4, False, None, None, _stats(4))], lite, stats))
        outputs.append(await stream.__anext__())
        assert len(records) == 1  # the step's record was observed before its outputs went out
        done = (0, 0, True, 0, 2, 0.008)
        send_message(end, ("step", [("r1", [15], 5, True, "length", None, _stats(5))], lite, done))
        outputs.extend([o async for o in stream])
        return outputs

    outputs = asyncio.run(asyncio.wait_for(run(), timeout=30))
    assert [o.token_ids for o in outputs] == [[11], [11, 12, 13, 14], [11, 12, 13, 14, 15]]
    assert [o.delta_token_ids for o in outputs] == [[11], [12, 13, 14], [15]]
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert "".join(o.delta_text for o in outputs) == outputs[-1].text
    assert [r.num_step_tokens for r in records] == [{"r1": 3}, {"r1": 3}]  # not for the first tokens
    assert records[-1].outputs[0].token_ids == (11, 12, 13, 14, 15)
    assert (client.num_steps, client.step_seconds, client.engine.num_running) == (2, 0.008, 0)


def test_an_add_the_core_refused_raises_in_its_stream(core: Any) -> None:
    client, end, _ = core

    async def run() -> None:
        _, first = await _opened(client, end, "r2")
        send_message(end, ("added", "r2", QueueFullError("request queue is full"), 0))
        await first

    with pytest.raises(QueueFullError, match="queue is full"):
        asyncio.run(asyncio.wait_for(run(), timeout=30))


def test_a_core_that_died_ends_every_stream_with_a_target_loss(core: Any) -> None:
    client, end, _ = core

    async def run() -> None:
        _, first = await _opened(client, end, "r3")
        send_message(end, ("added", "r3", None, 0))
        send_message(end, ("dead", "RuntimeError: CUDA error"))
        await first

    with pytest.raises(EngineDeadError) as raised:
        asyncio.run(asyncio.wait_for(run(), timeout=30))
    assert isinstance(raised.value.cause, TargetUnavailableError) and "CUDA error" in str(raised.value)
    assert not client.is_running
