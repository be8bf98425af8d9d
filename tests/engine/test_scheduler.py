"""Continuous batching limits: batch size, tokens per step, queue length, slot reuse."""

import pytest
import torch

from ddtree_serve.engine.request import Request, RequestStatus
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.scheduler import QueueFullError, Scheduler
from ddtree_serve.models.kv_cache import SlotIndex

TREE_TOKENS = 10


def make_scheduler(max_num_seqs: int = 3, max_num_batched_tokens: int = 1000, max_queue_len: int = 100):
    return Scheduler(max_num_seqs, max_num_batched_tokens, max_queue_len, tree_tokens=lambda r: TREE_TOKENS)


def request(name: str, prompt_len: int = 4) -> Request:
    params = SamplingParams()
    return Request(name, list(range(prompt_len)), params, max_output_tokens=params.max_tokens, tree_budget=0)


def test_batch_size_limit_and_slot_reuse():
    scheduler = make_scheduler(max_num_seqs=3)
    requests = [request(str(i)) for i in range(5)]
    for r in requests:
        scheduler.add(r)
    step = scheduler.schedule()
    assert [r.request_id for r in step.prefills] == ["0", "1", "2"]
    assert sorted(r.slot for r in step.running) == [0, 1, 2]
    assert len(scheduler.waiting) == 2
    assert scheduler.schedule().prefills == []  # no slot free

    freed = scheduler.free(requests[1])
    step = scheduler.schedule()
    assert [r.request_id for r in step.prefills] == ["3"]
    assert requests[3].slot == freed
    assert requests[3].status is RequestStatus.RUNNING
    assert [r.request_id for r in step.running] == ["0", "3", "2"]  # in slot order


def test_newcomers_take_the_lowest_slots_and_the_batch_runs_in_slot_order():
    """However the last batch finished, the next one's slots are consecutive and ascending: its
    KV reads are views of the cache, not gathers."""
    scheduler = make_scheduler(max_num_seqs=6)
    first = [request(f"a{i}") for i in range(6)]
    for r in first:
        scheduler.add(r)
    scheduler.schedule()
    for i in (4, 1, 5, 0, 2):  # finished out of order; slot 3 still runs
        scheduler.free(first[i])
    second = [request(f"b{i}") for i in range(4)]
    for r in second:
        scheduler.add(r)
    step = scheduler.schedule()
    assert [r.slot for r in step.prefills] == [0, 1, 2, 4]
    slots = [r.slot for r in step.running]
    assert slots == [0, 1, 2, 3, 4]
    assert isinstance(SlotIndex(slots, torch.device("cpu")).index, slice)


def test_tokens_per_step_limit_counts_prompts_and_trees():
    scheduler = make_scheduler(max_num_batched_tokens=50)
    first, second = request("a", prompt_len=20), request("b", prompt_len=20)
    scheduler.add(first)
    scheduler.add(second)
    # a: 20 prompt + 10 tree = 30; b would bring the step to 60 > 50.
    assert scheduler.schedule().prefills == [first]
    # Next step: a's tree (10) + b's prompt and tree (30) = 40 <= 50.
    assert scheduler.schedule().prefills == [second]


def test_oversized_prompt_runs_alone_rather_than_stalling():
    scheduler = make_scheduler(max_num_batched_tokens=50)
    huge, small = request("huge", prompt_len=200), request("small", prompt_len=2)
    scheduler.add(huge)
    scheduler.add(small)
    assert scheduler.schedule().prefills == [huge]
    assert scheduler.schedule().prefills == [small]


def test_queue_limit_raises():
    scheduler = make_scheduler(max_queue_len=2)
    scheduler.add(request("a"))
    scheduler.add(request("b"))
    with pytest.raises(QueueFullError, match="queue is full"):
        scheduler.add(request("c"))
