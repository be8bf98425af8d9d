"""AsyncLLM: streaming deltas, agreement with LLM, aborts on early exit, queue limit, engine death."""

import asyncio
import threading
import time

import pytest

from ddtree_serve.engine.async_llm import AsyncLLM, EngineDeadError, _Stream
from ddtree_serve.engine.llm import LLM
from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.request import RequestOutput, RequestStats
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.scheduler import QueueFullError

PARAMS = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)


@pytest.fixture
def client(make_pair_config):
    client = AsyncLLM(
        build_local_engine(make_pair_config(mode="ddtree", budget=4, max_num_seqs=1, max_queue_len=1))
    )
    yield client
    client.shutdown()


def test_stream_deltas_add_up_and_match_llm(client, make_pair_config, prompt_ids):
    async def collect():
        return [o async for o in client.generate_stream(prompt_ids[0], PARAMS, request_id="s")]

    outputs = asyncio.run(collect())
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert "".join(o.delta_text for o in outputs) == outputs[-1].text
    assert [t for o in outputs for t in o.delta_token_ids] == outputs[-1].token_ids
    llm = LLM.from_config(make_pair_config(mode="ddtree", budget=4, max_num_seqs=1))
    assert llm.generate([prompt_ids[0]], PARAMS)[0].token_ids == outputs[-1].token_ids


def test_a_caller_that_falls_behind_gets_the_queued_outputs_as_one_chunk(client, prompt_ids):
    """A loop busy for a while (here: blocked) finds several steps' outputs queued; it reads
    the newest, whose delta holds every token since the last chunk, and nothing is lost."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    steps_done = threading.Semaphore(0)
    step = client.engine.step

    def counted_step():
        outputs = step()
        steps_done.release()
        return outputs

    client.engine.step = counted_step

    async def collect():
        outputs = []
        async for output in client.generate_stream(prompt_ids[0], params, request_id="slow"):
            outputs.append(output)
            if len(outputs) == 1:
                for _ in range(3):  # the loop is blocked while three more steps finish
                    assert steps_done.acquire(timeout=60)
                time.sleep(0.2)  # their outputs reach the loop's queue once it runs again
        return outputs

    outputs = asyncio.run(collect())
    num_steps = outputs[-1].stats.steps
    assert len(outputs) < num_steps + 1  # one chunk per step (and the prefill) without merging
    assert len(outputs[1].delta_token_ids) > len(outputs[0].delta_token_ids)
    assert [t for o in outputs for t in o.delta_token_ids] == outputs[-1].token_ids
    assert len(outputs[-1].token_ids) == 24 and outputs[-1].finished


def test_a_stream_interval_batches_chunks_but_never_holds_back_the_end(client, prompt_ids):
    """With an interval longer than the request, the stream is its first chunk and its finished
    one, which comes when the request ends (not when the interval does)."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def collect():
        stream = client.generate_stream(prompt_ids[0], params, request_id="batched", interval_s=600.0)
        return [o async for o in stream]

    outputs = asyncio.run(asyncio.wait_for(collect(), timeout=120))
    assert len(outputs) == 2 and outputs[-1].finished and outputs[-1].stats.steps > 2
    assert [t for o in outputs for t in o.delta_token_ids] == outputs[-1].token_ids
    assert "".join(o.delta_text for o in outputs) == outputs[-1].text


def test_the_first_token_streams_before_the_step_drafts_and_verifies(client, prompt_ids):
    """The prefill's token is the stream's first chunk while the same step's verify still runs
    (here: held until the caller has it)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first_seen = threading.Event()
    verify = client.engine.target.verify_and_commit

    def held_verify(inputs):
        assert first_seen.wait(timeout=20), "the first token did not stream before the verify"
        return verify(inputs)

    client.engine.target.verify_and_commit = held_verify

    async def collect():
        outputs = []
        async for output in client.generate_stream(prompt_ids[0], params, request_id="early"):
            outputs.append(output)
            first_seen.set()
        return outputs

    outputs = asyncio.run(asyncio.wait_for(collect(), timeout=120))
    assert outputs[0].stats.steps == 0 and len(outputs[0].token_ids) == 1  # before any verify
    assert [t for o in outputs for t in o.delta_token_ids] == outputs[-1].token_ids
    assert len(outputs[-1].token_ids) == 8


def test_leaving_a_stream_early_aborts_and_queue_limit_raises(client, prompt_ids):
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def scenario():
        running = client.generate_stream(prompt_ids[0], long, request_id="running")
        await running.__anext__()  # admitted: it holds the only slot
        waiting = client.generate_stream(prompt_ids[1], long, request_id="waiting")
        waiting_first = asyncio.ensure_future(waiting.__anext__())
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError):
            await client.generate_stream(prompt_ids[2], long, request_id="refused").__anext__()
        await running.aclose()  # leaving early aborts "running" and frees the slot
        first = await asyncio.wait_for(waiting_first, timeout=60)
        assert first.request_id == "waiting"
        await waiting.aclose()

    asyncio.run(scenario())
    for _ in range(100):
        if not client.engine.has_unfinished_requests():
            break
        asyncio.run(asyncio.sleep(0.05))
    assert not client.engine.has_unfinished_requests()


def test_invalid_request_raises_value_error(client):
    async def bad():
        return [o async for o in client.generate_stream([], PARAMS)]

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(bad())


def test_a_failing_step_fails_streams_and_later_calls(client, prompt_ids):
    def broken_verify(*args, **kwargs):
        raise RuntimeError("device lost")

    client.engine.target.verify_and_commit = broken_verify

    async def run():
        return [o async for o in client.generate_stream(prompt_ids[0], PARAMS)]

    with pytest.raises(EngineDeadError, match="device lost"):
        asyncio.run(run())
    with pytest.raises(EngineDeadError):
        asyncio.run(run())


def test_a_stream_opened_while_the_engine_dies_fails_instead_of_hanging(client, prompt_ids):
    """The engine thread can fail between a caller's liveness check and its stream registration."""

    class DieBeforeRegistering:
        """The streams lock; the caller's first acquire lets the engine thread die first."""

        def __init__(self, lock):
            self.lock, self.armed = lock, True

        def __enter__(self):
            if self.armed and threading.current_thread() is threading.main_thread():
                self.armed = False
                client.shutdown()  # the engine thread fails every stream it knows, then exits
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    client._streams_lock = DieBeforeRegistering(client._streams_lock)

    async def run():
        stream = client.generate_stream(prompt_ids[0], PARAMS)
        return await asyncio.wait_for(stream.__anext__(), timeout=5)

    with pytest.raises(EngineDeadError):
        asyncio.run(run())


def test_a_steps_outputs_reach_each_loop_in_one_hand_over(make_pair_config, prompt_ids):
    """Four streams on one loop: each step hands the loop its outputs once (a wake-up per step,
    not per request), and every stream still gets its own tokens, equal to `LLM`'s."""
    client = AsyncLLM(build_local_engine(make_pair_config(mode="ddtree", budget=4, max_num_seqs=4)))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    steps = 0
    step = client.engine.step

    def counted_step():
        nonlocal steps
        outputs = step()
        steps += 1
        return outputs

    client.engine.step = counted_step
    hand_overs = 0

    async def collect():
        nonlocal hand_overs
        loop = asyncio.get_running_loop()
        threadsafe = loop.call_soon_threadsafe

        def counted(callback, *args):
            nonlocal hand_overs
            hand_overs += 1
            return threadsafe(callback, *args)

        loop.call_soon_threadsafe = counted

        async def one(i):
            return [o async for o in client.generate_stream(prompt_ids[i % len(prompt_ids)], params, f"r{i}")]

        return await asyncio.gather(*(one(i) for i in range(4)))

    try:
        streams = asyncio.run(collect())
    finally:
        client.shutdown()
    finals = [outputs[-1].token_ids for outputs in streams]
    llm = LLM.from_config(make_pair_config(mode="ddtree", budget=4, max_num_seqs=4))
    prompts = [prompt_ids[i % len(prompt_ids)] for i in range(4)]
    assert finals == [o.token_ids for o in llm.generate(prompts, params)]
    # At most one hand-over per step and one per prefill's first tokens: fewer than the outputs.
    assert sum(len(outputs) for outputs in streams) > hand_overs
    assert hand_overs <= 2 * steps


def _output(num_tokens: int, finished: bool = False) -> RequestOutput:
    tokens = list(range(num_tokens))
    stats = RequestStats(4, num_tokens, num_tokens, 1.0)
    reason = "length" if finished else None
    return RequestOutput("held", tokens, num_tokens, 1, finished, reason, None, stats)


def test_a_held_stream_wakes_for_its_timer_or_its_end_not_for_each_output():
    """Outputs pushed while a stream holds them back (its interval) do not wake its reader: at
    c = 64 with a 50 ms interval each step had woken every stream only to sleep again. The
    timer lets the newest go; a finished output goes at once."""

    async def run() -> tuple[int, RequestOutput, int, RequestOutput]:
        loop = asyncio.get_running_loop()
        stream = _Stream(loop)
        wakes = 0
        wait = stream._ready.wait

        async def counted_wait() -> bool:
            nonlocal wakes
            result = await wait()
            wakes += 1
            return result

        stream._ready.wait = counted_wait  # type: ignore[method-assign]
        reader = asyncio.create_task(stream.next(loop.time() + 0.3))
        await asyncio.sleep(0)  # the reader waits, held
        for num_tokens in range(1, 11):  # ten steps' outputs before its timer
            stream.push(_output(num_tokens))
        held = await reader
        held_wakes, wakes = wakes, 0
        reader = asyncio.create_task(stream.next(loop.time() + 600.0))
        await asyncio.sleep(0)
        for num_tokens in range(11, 14):
            stream.push(_output(num_tokens, finished=num_tokens == 13))
        end = await asyncio.wait_for(reader, timeout=10)
        return held_wakes, held, wakes, end

    held_wakes, held, end_wakes, end = asyncio.run(run())
    assert (held_wakes, held.num_tokens) == (1, 10)  # the timer's wake-up, the newest output
    assert (end_wakes, end.num_tokens, end.finished) == (1, 13, True)
