"""What a group reports to the autoscaling policy (`GroupLoad`), from a real engine's steps and
from real request streams, and through the Coordinator's Serve hook (no Ray)."""

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from ddtree_serve.engine.async_llm import AsyncLLM
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.models import bundled_target_dir, load_tokenizer
from ddtree_serve.serve import load
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.coordinator import Coordinator
from ddtree_serve.serve.group import start_workers
from ddtree_serve.serve.load import GroupLoad
from ddtree_serve.serve.observed_engine import ObservedEngine, StepRecord

pytestmark = pytest.mark.timeout(120)

CONFIG = ServeConfig.model_validate(
    {"engine": {"max_seq_len": 256, "max_num_seqs": 2, "budget": 16}, "placement": {"workers": "in_process"}}
)


def bundled_engine(group_load: GroupLoad) -> ObservedEngine:
    target, drafter = start_workers(CONFIG)
    return ObservedEngine(
        CONFIG.engine.to_settings(),
        target,
        drafter,
        load_tokenizer(bundled_target_dir()),
        observer=group_load.on_step,
    )


def test_tokens_per_step_is_the_mean_over_verified_requests_of_the_recent_steps() -> None:
    group_load = GroupLoad(max_num_seqs=2, window_steps=10_000)  # the window holds every step
    engine = bundled_engine(group_load)
    for request_id, prompt in (("a", "def add(a, b):"), ("b", "for i in range(10):"), ("c", "import os")):
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    stats = []
    while engine.has_unfinished_requests():
        stats += [output.stats for output in engine.step() if output.finished]
    report = group_load.stats(num_running=engine.num_running, num_waiting=engine.num_waiting)
    verified_tokens = sum(s.acceptance_length * s.steps for s in stats)
    assert report[load.TOKENS_PER_STEP] == pytest.approx(verified_tokens / sum(s.steps for s in stats))
    assert report[load.TOKENS_PER_STEP] > 1.0  # the trained pair accepts drafts
    assert (report[load.RUNNING], report[load.WAITING], report[load.MAX_NUM_SEQS]) == (0.0, 0.0, 2.0)
    assert report[load.NO_DRAFT_SHARE] == 0.0  # the fixed budget policy drafts every step


def test_no_draft_share_is_the_share_of_recent_steps_the_adaptive_budget_did_not_draft(tmp_path) -> None:
    """A drafter costly enough that most steps decode plainly; the window holds every step."""
    cost_file = tmp_path / "costly_drafter.json"
    cost_file.write_text(json.dumps({"tokens": [1, 4096], "ms": [10.0, 10.0], "draft_ms": 1000.0}))
    engine_config = CONFIG.engine.model_copy(
        update={"budget": 8, "budget_policy": "adaptive", "cost_curve": str(cost_file)}
    )
    config = CONFIG.model_copy(update={"engine": engine_config})
    group_load = GroupLoad(max_num_seqs=2, window_steps=10_000)
    drafted: list[bool] = []

    def observe(record: StepRecord) -> None:
        group_load.on_step(record)
        if record.num_step_tokens:
            drafted.append(record.budget.drafted)

    target, drafter = start_workers(config)
    engine = ObservedEngine(
        config.engine.to_settings(), target, drafter, load_tokenizer(bundled_target_dir()), observer=observe
    )
    for request_id, prompt in (("a", "def add(a, b):"), ("b", "import os")):
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    share = group_load.stats(num_running=0, num_waiting=0)[load.NO_DRAFT_SHARE]
    assert 0.0 < share < 1.0  # the costly drafter made most steps plain, the probes drafted
    assert share == pytest.approx(drafted.count(False) / len(drafted))


def test_a_request_waits_until_its_first_item_and_not_after() -> None:
    group_load = GroupLoad(max_num_seqs=1)
    first_item = asyncio.Event()

    async def stream() -> AsyncIterator[int]:
        await first_item.wait()
        yield 1
        yield 2

    async def scenario() -> tuple[float, float, list[int], float]:
        items: list[int] = []

        async def consume() -> None:
            items.extend([item async for item in group_load.watch("r", stream())])

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        waiting = group_load.stats(0, 1)[load.QUEUE_WAIT_S]
        await asyncio.sleep(0.05)
        still_waiting = group_load.stats(0, 1)[load.QUEUE_WAIT_S]
        first_item.set()
        await task
        return waiting, still_waiting, items, group_load.stats(0, 0)[load.QUEUE_WAIT_S]

    waiting, still_waiting, items, after = asyncio.run(scenario())
    assert 0 < waiting < still_waiting  # the age grows while nothing arrived
    assert items == [1, 2] and after == 0.0


def test_a_stream_closed_before_its_first_item_stops_waiting() -> None:
    group_load = GroupLoad(max_num_seqs=1)
    closed = []

    async def never() -> AsyncIterator[int]:
        try:
            await asyncio.Event().wait()
            yield 0
        finally:
            closed.append(True)

    async def scenario() -> float:
        task = asyncio.create_task(anext(group_load.watch("r", never())))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return group_load.stats(0, 0)[load.QUEUE_WAIT_S]

    assert asyncio.run(scenario()) == 0.0
    assert closed == [True]  # the engine stream is closed, so its request is aborted


def test_the_coordinator_hands_serve_its_engine_counts() -> None:
    llm = AsyncLLM(bundled_engine(GroupLoad(max_num_seqs=2)))
    try:
        coordinator = Coordinator.sync_init(CONFIG, llm)
        report = asyncio.run(coordinator.record_autoscaling_stats())
    finally:
        llm.shutdown()
    assert set(report) == {
        load.RUNNING,
        load.WAITING,
        load.MAX_NUM_SEQS,
        load.QUEUE_WAIT_S,
        load.TOKENS_PER_STEP,
        load.NO_DRAFT_SHARE,
    }
    assert report[load.MAX_NUM_SEQS] == CONFIG.engine.max_num_seqs
    assert all(isinstance(value, float) for value in report.values())
