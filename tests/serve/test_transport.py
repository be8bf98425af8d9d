"""The compiled step graph and the overlapped step on a real local Ray cluster (CPU).

Every configuration drives one `SpecEngine` over real `TargetWorker` / `DrafterWorker` actors
on the bundled pair and must give the in-process engine's tokens exactly: greedy requests
joining and leaving a mixed batch, streams cancelled in either micro-batch, and seeded sampling
whichever micro-batch a request lands in. Both step graphs (Ray's compiled graph and the same
graph over the workers' sockets) run serial with and without chained drafts (each step's next
draft in its verify's execution) and overlapped.
"""

import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from ray.exceptions import ActorUnavailableError

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.builder import target_dir
from ddtree_serve.engine.interfaces import TargetUnavailableError
from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.models import load_tokenizer
from ddtree_serve.serve.compiled_graph import GraphTarget
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.group import reconnect_workers, start_workers
from ddtree_serve.serve.workers import RayTarget, TargetRestartedError
from tests.serve.conftest import run_schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ENGINE = EngineConfig(mode="ddtree", budget=8, max_num_seqs=4, max_queue_len=8, max_seq_len=256)
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n", "for i in range(10):", "def fib(n):"]
# (transport, overlap, chained drafts, workers): the configurations under test; actor calls
# without overlap over two actors is main's path.
CONFIGS = [
    ("compiled_graph", False, False, "actors"),
    ("compiled_graph", False, True, "actors"),
    ("compiled_graph", True, False, "actors"),
    ("sockets", False, False, "actors"),
    ("sockets", False, True, "actors"),
    ("sockets", True, False, "actors"),
    ("actor_calls", True, False, "actors"),
    ("sockets", False, False, "target_in_coordinator"),
    ("sockets", False, True, "target_in_coordinator"),
    ("sockets", True, False, "target_in_coordinator"),
]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    temp_dir = tempfile.mkdtemp(prefix="ddtree-transport-")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(
    scope="module", params=CONFIGS, ids=lambda c: f"{c[0]}-overlap{int(c[1])}-chained{int(c[2])}-{c[3]}"
)
def served_engine(request: pytest.FixtureRequest, ray_cluster: None) -> Iterator[SpecEngine]:
    transport, overlap, chained, workers = request.param
    placement = {"transport": transport, "overlap": overlap, "chain_drafts": chained, "workers": workers}
    config = ServeConfig(engine=ENGINE, placement=placement)  # type: ignore[arg-type]
    target, drafter = start_workers(config)
    assert isinstance(target, GraphTarget) == (transport != "actor_calls")
    assert not isinstance(target, GraphTarget) or target.transport == transport
    # A target inside this process has no actor: only the draft crosses to one.
    assert (getattr(target, "actor", None) is None) == (workers == "target_in_coordinator")
    tokenizer = load_tokenizer(target_dir(ENGINE))
    settings = ENGINE.to_settings()
    engine = SpecEngine(settings, target, drafter, tokenizer, overlap=overlap, chain_drafts=chained)
    assert engine.chains_drafts == chained
    yield engine
    if isinstance(target, GraphTarget):
        target.close()
    for actor in _actors(engine):
        ray.kill(actor)


def _actors(engine: SpecEngine) -> list[Any]:
    """The engine's worker actors: the drafter's, and the target's unless it runs here."""
    workers = (engine.target, engine.drafter)
    return [worker.actor for worker in workers if getattr(worker, "actor", None) is not None]


@pytest.fixture(scope="module")
def local_engine() -> SpecEngine:
    return build_local_engine(ENGINE)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _mixed_schedule(tag: str) -> list[tuple[int, str, str, SamplingParams]]:
    """Requests of different lengths joining at different steps; more than fit at once."""
    lengths = [40, 9, 25, 3, 30, 17]
    return [
        (2 * i, f"{tag}{i}", PROMPTS[i % len(PROMPTS)], _greedy(length)) for i, length in enumerate(lengths)
    ]


def test_greedy_mixed_batch_equals_the_in_process_engine(
    served_engine: SpecEngine, local_engine: SpecEngine
) -> None:
    served = run_schedule(served_engine, _mixed_schedule("g"))
    local = run_schedule(local_engine, _mixed_schedule("g"))
    assert served == local
    assert len(served) == 6
    assert served_engine.scheduler.num_free_slots == ENGINE.max_num_seqs


def test_cancelling_in_either_micro_batch_frees_its_slot(
    served_engine: SpecEngine, local_engine: SpecEngine
) -> None:
    for i in range(4):
        served_engine.add_request(f"c{i}", PROMPTS[i], _greedy(200))
    for _ in range(3):
        served_engine.step()
    carried = served_engine._carried
    if served_engine.overlap:  # one request of each micro-batch
        assert carried is not None
        first = carried.requests[0].request_id
        second = next(f"c{i}" for i in range(4) if f"c{i}" not in {r.request_id for r in carried.requests})
        cancelled = [first, second]
    else:
        cancelled = ["c0", "c3"]
    for request_id in cancelled:
        served_engine.abort_request(request_id)
    outputs = {o.request_id: o for o in served_engine.step()}
    assert all(outputs[r].finish_reason == "abort" for r in cancelled)
    # The freed slots take newcomers at once, whose tokens are the in-process engine's.
    newcomers = [(0, f"n{i}", PROMPTS[4 - i], _greedy(12)) for i in range(2)]
    served = run_schedule(served_engine, newcomers)
    for i in range(4):
        served_engine.abort_request(f"c{i}")
    run_schedule(served_engine, [])
    assert {k: v for k, v in served.items() if k.startswith("n")} == run_schedule(local_engine, newcomers)
    assert served_engine.scheduler.num_free_slots == ENGINE.max_num_seqs


def test_seeded_sampling_is_the_same_in_either_micro_batch(
    served_engine: SpecEngine, local_engine: SpecEngine
) -> None:
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    alone = run_schedule(local_engine, [(0, "s", PROMPTS[1], seeded)])["s"]
    others = [(0, f"o{i}", PROMPTS[i + 2], _greedy(30)) for i in range(3)]
    # First in the scheduled order, "s" leads the first micro-batch; joining a step after the
    # others, it starts in the second.
    micro_batches = set()
    for joins_at, schedule in (
        (0, [(0, "s", PROMPTS[1], seeded), *others]),
        (1, [*others, (1, "s", PROMPTS[1], seeded)]),
    ):
        tokens, first = _run_tracking(served_engine, schedule, "s", joins_at + 1)
        assert tokens == alone
        micro_batches.add(first)
    if served_engine.overlap:
        assert micro_batches == {True, False}


def _run_tracking(
    engine: SpecEngine, schedule: list[tuple[int, str, str, SamplingParams]], request_id: str, at_step: int
) -> tuple[list[int], bool]:
    """`_run`, also saying whether `request_id` was in the first micro-batch after `at_step` steps."""
    steps_taken = 0
    in_first = False
    step = engine.step

    def counted_step() -> list[Any]:
        nonlocal steps_taken, in_first
        outputs = step()
        steps_taken += 1
        if steps_taken == at_step and engine._carried is not None:
            in_first = request_id in {r.request_id for r in engine._carried.requests}
        return outputs

    engine.step = counted_step  # type: ignore[method-assign]
    try:
        return run_schedule(engine, schedule)[request_id], in_first
    finally:
        del engine.step


def test_call_traces_split_each_call_inside_the_coordinators_window(served_engine: SpecEngine) -> None:
    """The workers' stamps and the Coordinator's share one clock: every traced call starts and
    returns inside the step that sent it, its parts in order."""
    actors = _actors(served_engine)
    ray.get([actor.trace_calls.remote(True) for actor in actors])
    served_engine.add_request("trace", PROMPTS[0], _greedy(12))
    windows = []
    while served_engine.has_unfinished_requests():
        started = time.perf_counter()
        served_engine.step()
        windows.append((started, time.perf_counter()))
    *target_traces, drafter_calls = ray.get([actor.take_call_trace.remote() for actor in actors])
    target_calls = target_traces[0] if target_traces else []
    methods = {c.method for c in target_calls + drafter_calls}
    if target_traces:
        graph_methods = {"graph_draft", "graph_call:verify_and_commit"}
        assert graph_methods <= methods or {"draft", "verify_and_commit"} <= methods
    else:  # the target in this process: the drafter's calls only
        assert {"graph_draft"} <= methods or {"graph_chained_draft"} <= methods
    if served_engine.chains_drafts:  # one execution a step: each verify drafts the next block
        counts = Counter(c.method for c in target_calls + drafter_calls)
        assert counts["graph_draft"] == 1  # the newcomer's first draft, after its prefill
        assert counts["graph_chained_draft"] > 2
        assert not target_traces or counts["graph_chained_draft"] == counts["graph_call:verify_and_commit"]
    for call in target_calls + drafter_calls:
        stamps = [call.start_s] + [at for _, at in call.marks]
        assert stamps == sorted(stamps)
        assert call.marks[-1][0] == "return"
        assert any(start <= call.start_s and stamps[-1] <= end for start, end in windows), call
    ray.get([actor.trace_calls.remote(False) for actor in actors])
    assert ray.get([actor.take_call_trace.remote() for actor in actors]) == [[]] * len(actors)


def test_chained_drafts_are_refused_over_the_overlapped_graph(served_engine: SpecEngine) -> None:
    """Over the overlap-shaped graph a chained draft would never run: asked for, it fails loudly."""
    target = served_engine.target
    if not (isinstance(target, GraphTarget) and served_engine.overlap):
        pytest.skip("only the overlap-shaped step graph")
    with pytest.raises(ValueError, match="serial graph"):
        target.submit_verify_then_draft(SimpleNamespace(return_context=True), 8)  # type: ignore[arg-type]


def test_a_serial_verify_runs_the_engines_host_work_while_the_workers_run(served_engine: SpecEngine) -> None:
    """`GraphTarget` / `RayTarget` are `AsyncDeviceTarget`s: the host work the engine hands a
    verify (the adaptive policy's lesson) runs once per verify, while the workers compute. Only
    the serial, unchained step calls `verify_and_commit`; the others submit their verifies."""
    if served_engine.overlap or served_engine.chains_drafts:
        pytest.skip("the overlapped and chained steps submit their verifies")
    target: Any = served_engine.target
    verify, calls = target.verify_and_commit, Counter()

    def hooked(inputs: Any) -> Any:
        calls["verify"] += 1
        target.while_verifying = lambda: calls.update(["hook"])
        try:
            return verify(inputs)
        finally:
            target.while_verifying = None

    target.verify_and_commit = hooked
    try:
        outputs = run_schedule(served_engine, [(0, "hooked", PROMPTS[0], _greedy(12))])
    finally:
        del target.verify_and_commit
    assert len(outputs["hooked"]) == 12
    assert calls["verify"] > 2 and calls["hook"] == calls["verify"]


def test_a_killed_drafter_decodes_plainly_then_speculates_again(
    served_engine: SpecEngine, local_engine: SpecEngine
) -> None:
    """The graph breaks, is torn down, and is compiled over the new drafter."""
    schedule = [(0, f"k{i}", PROMPTS[i], _greedy(60)) for i in range(3)]
    expected = run_schedule(local_engine, schedule)
    for _, request_id, prompt, params in schedule:
        served_engine.add_request(request_id, prompt, params)
    finished: dict[str, list[int]] = {}
    for step in range(400):
        if step == 3:
            ray.kill(served_engine.drafter.actor, no_restart=False)  # type: ignore[union-attr]
        for output in served_engine.step():
            if output.finished:
                finished[output.request_id] = list(output.token_ids)
        if not served_engine.has_unfinished_requests():
            break
    assert finished == expected
    assert served_engine.num_drafter_losses == 1
    # Once Ray restarted it, the drafter's context is rebuilt and the next requests speculate.
    for _ in range(600):
        if served_engine.drafter.is_available():  # type: ignore[union-attr]
            break
        time.sleep(0.1)
    again = [(0, "after", PROMPTS[4], _greedy(20))]
    assert run_schedule(served_engine, again) == run_schedule(local_engine, again)
    assert served_engine.speculating


def test_a_killed_target_restarts_in_place_under_a_new_engine(
    served_engine: SpecEngine, local_engine: SpecEngine
) -> None:
    """Last in the module: the lost engine's requests fail retriably; Ray restarts the target in
    its place and a new engine over the same two actors (a new graph under either step graph)
    decodes every slot, those the lost requests held included, exactly as in process."""
    target, drafter = served_engine.target, served_engine.drafter
    assert drafter is not None
    if getattr(target, "actor", None) is None:
        pytest.skip("a target inside the Coordinator dies with its replica (Serve replaces it)")
    for i in range(3):
        served_engine.add_request(f"t{i}", PROMPTS[i], _greedy(60))
    with pytest.raises(TargetUnavailableError):
        for step in range(400):
            if step == 3:
                ray.kill(target.actor, no_restart=False)  # type: ignore[attr-defined]
                _until_restarted(target.actor)  # type: ignore[attr-defined]  # the kill is asynchronous
            served_engine.step()
    if isinstance(target, GraphTarget):
        target.discard()
    RayTarget(target.actor)  # type: ignore[attr-defined]  # waits for Ray's restart
    with pytest.raises(TargetRestartedError):  # a call of the lost engine cannot reach its empty slots
        ray.get(target.actor.encode_context.remote(None))  # type: ignore[attr-defined]
    transport = target.transport if isinstance(target, GraphTarget) else "actor_calls"
    config = ServeConfig(engine=ENGINE, placement={"transport": transport, "overlap": served_engine.overlap})  # type: ignore[arg-type]
    new_target, new_drafter = reconnect_workers(config, target.actor, drafter.actor)  # type: ignore[attr-defined]
    engine = SpecEngine(
        ENGINE.to_settings(),
        new_target,
        new_drafter,
        served_engine.tokenizer,
        overlap=served_engine.overlap,
        chain_drafts=served_engine.chains_drafts,
    )
    try:
        again = [(0, f"r{i}", PROMPTS[i], _greedy(30)) for i in range(ENGINE.max_num_seqs)]
        assert run_schedule(engine, again) == run_schedule(local_engine, again)
        assert engine.speculating and engine.num_drafter_losses == 0
    finally:
        if isinstance(new_target, GraphTarget):
            new_target.close()


def _until_restarted(actor: Any, timeout_s: float = 120.0) -> None:
    """Waits until Ray has restarted `actor` (its `describe` says it does not serve yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if not ray.get(actor.describe.remote())["serving"]:
                return
        except ActorUnavailableError:
            pass
        time.sleep(0.05)
    pytest.fail(f"the target actor did not restart within {timeout_s:g} s")


def test_the_adaptive_policy_calibrates_and_decodes_over_the_step_graph(
    ray_cluster: None, local_engine: SpecEngine
) -> None:
    """The adaptive budget's start-up cost calibration (no cost file) runs through the step graph:
    each of its prefills delivers the slot's context features to the drafter's worker, which keeps
    them until a draft or a release of the slot (`ddtree-serve serve --budget-policy adaptive`
    once failed to deploy on the deliveries it left behind). Its steps decode the in-process
    engine's greedy tokens."""
    adaptive = ENGINE.model_copy(update={"budget_policy": "adaptive", "cost_curve": None})
    target, drafter = start_workers(ServeConfig(engine=adaptive))
    assert isinstance(target, GraphTarget)  # the default transport: the step graph
    try:
        tokenizer = load_tokenizer(target_dir(adaptive))
        engine = SpecEngine(adaptive.to_settings(), target, drafter, tokenizer)
        assert engine.budget_policy is not None and engine.budget_policy.cost.draft_ms(1) > 0.0
        assert run_schedule(engine, _mixed_schedule("a")) == run_schedule(local_engine, _mixed_schedule("a"))
    finally:
        target.close()
        for actor in _actors(SimpleNamespace(target=target, drafter=drafter)):
            ray.kill(actor)
