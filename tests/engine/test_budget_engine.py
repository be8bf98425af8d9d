"""The engine under `budget_policy="adaptive"`: lossless whatever the policy chooses.

Three cost files steer the policy into each of its regimes: free nodes (every tree at its
ceiling), a drafter so costly that most steps decode plainly (so drafter context piles up over
several steps and must all arrive at the next draft), and a steep per-token cost (small,
uneven trees). Greedy output must equal plain decoding, positions must stay in step, and
sampling must follow the target's distribution.
"""

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence

import pytest

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.budget import BudgetStep, BuildCost, allocator
from ddtree_serve.engine.budget.policy import AHEAD_DRAFT_LESSONS, LEARNING_STEPS, PLAIN_CRUISE_STEPS, _Cruise
from ddtree_serve.engine.budget.step_overhead import StepOverhead
from ddtree_serve.engine.budget.step_residual import StepResidual
from ddtree_serve.engine.builder import build_draft_step, build_target_step, target_dir
from ddtree_serve.engine.graph_shapes import VerifyGraphShapes
from ddtree_serve.engine.interfaces import TargetUnavailableError
from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import DRAIN_QUIET_STEPS, PROBE_REQUESTS, SpecEngine
from ddtree_serve.models import bundled_target_dir, load_tokenizer
from ddtree_serve.models.cuda_graphs import TOKEN_BUCKETS
from tests.engine.conftest import REFERENCE_TOKENS, bundled_pair_present, run_to_completion
from tests.engine.fakes import RecordingTarget
from tests.engine.test_drafter_fallback import FlakyDrafter
from tests.engine.test_positions import CheckingDrafter, check_after_step
from tests.engine.test_sampling import NUM_TOKENS, chi_square, chi_square_pvalue, exact_prefix_distribution

COSTS = {
    "free_nodes": {"tokens": [1, 4096], "ms": [10.0, 10.0], "draft_ms": 0.0},
    "costly_drafter": {"tokens": [1, 4096], "ms": [10.0, 10.0], "draft_ms": 1000.0},
    "steep": {"tokens": [1, 64], "ms": [10.0, 136.0], "draft_ms": 1.0},
}
SETTLED_COST = {"tokens": [1, 4096], "ms": [10.0, 1034.0], "draft_ms": 1.0}
"""A quarter of a millisecond a verified token: wide trees pay for their likeliest nodes only."""


FILE_ONLY = BuildCost(0.0, 0.0, 0.0)
"""A free host build: the cost file alone steers the policy (timings on a loaded machine vary)."""


def steer_by_the_file(engine: SpecEngine) -> None:
    """The cost file alone steers the policy: a free host build, no step overhead, no step-time
    ratio learned, no probe kept away by its measured cost and each drafter call priced at the
    file (this machine's host work, under the suite's load, is not what the test is about; a
    drafter call's measured milliseconds moved a batch's widths and so its probes' steps)."""
    policy = engine.budget_policy
    record_draft_ms = policy.record_draft_ms

    def record_file_priced_draft(draft_ms: float, catching_up: bool = False, with_plan: bool = False) -> None:
        record_draft_ms(draft_ms, catching_up, with_plan)
        policy._draft_ms = None  # a step's drafter call unmeasured is priced at the file

    policy.record_draft_ms = record_file_priced_draft
    policy.build = FILE_ONLY
    policy.overhead = StepOverhead(ema_weight=0.0)
    policy.gate.residual = StepResidual(frozen=True)
    policy.gate.probe_share = 0.0


def gentle_engine(make_pair_config, cost_files: dict[str, str]) -> SpecEngine:
    """The adaptive engine over the bundled pair at ceiling 16, three requests at a time, steered
    by the `gentle` file (`SETTLED_COST`: weighings keep the likeliest nodes only)."""
    config = make_pair_config(mode="ddtree", budget=16, max_num_seqs=3, budget_policy="adaptive")
    engine = build_local_engine(config.model_copy(update={"cost_curve": cost_files["gentle"]}))
    steer_by_the_file(engine)
    return engine


def add_greedy_requests(
    engine: SpecEngine, prompt_ids: list[list[int]], max_tokens: int | Sequence[int]
) -> None:
    """Request `i` for `prompt_ids[i]`, greedy, exactly `max_tokens` new tokens (or
    `max_tokens[i]`, one length a request, as many requests as lengths)."""
    lengths = [max_tokens] * len(prompt_ids) if isinstance(max_tokens, int) else max_tokens
    for i, (prompt, length) in enumerate(zip(prompt_ids, lengths, strict=False)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=length, ignore_eos=True))


def plain_decoding(
    make_pair_config, prompt_ids: list[list[int]], max_tokens: int | Sequence[int]
) -> dict[str, list[int]]:
    """`add_greedy_requests`' outputs under plain decoding: what every adaptive run must equal."""
    plain = build_local_engine(make_pair_config(mode="ar", max_num_seqs=3))
    add_greedy_requests(plain, prompt_ids, max_tokens)
    return run_to_completion(plain)


def recorded_top_ks(drafter) -> list[int]:
    """The top-K of every draft call `drafter` takes from now on, in order."""
    top_ks: list[int] = []
    draft = drafter.draft

    def recording(inputs):
        top_ks.append(inputs.top_k)
        return draft(inputs)

    drafter.draft = recording
    return top_ks


@pytest.fixture(scope="module")
def cost_files(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("costs")
    paths = {}
    for name, curve in {**COSTS, "gentle": SETTLED_COST}.items():
        path = folder / f"{name}.json"
        path.write_text(json.dumps(curve))
        paths[name] = str(path)
    return paths


def run_recording_steps(engine: SpecEngine) -> tuple[dict[str, list[int]], list[BudgetStep]]:
    finished: dict[str, list[int]] = {}
    steps: list[BudgetStep] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.token_ids)
        if engine.budget_policy.last_step is not None:
            steps.append(engine.budget_policy.last_step)
    return finished, steps


def assert_regime(name: str, steps: list[BudgetStep]) -> None:
    """The cost file drove the policy where it should (else the test would prove little)."""
    drafted = [s for s in steps if s.drafted]
    if name == "free_nodes":
        at_cap = [s for s in drafted if s.ceiling == 8]  # the rest are probes of narrower ceilings
        assert len(drafted) == len(steps) and len(at_cap) >= 2 * len(drafted) // 3
        # Trees keep no node deeper than their request can keep: near its end they are shallower
        # and smaller. The first half of the run's steps is a block's length from every end.
        assert all(max(s.num_nodes) >= 6 for s in at_cap[: len(at_cap) // 2])
    elif name == "costly_drafter":
        assert 0 < len(drafted) < len(steps) // 3
    else:  # trees cut below the ceiling of 8 (live timings later flatten the steep file's curve)
        assert drafted and min(n for s in drafted for n in s.num_nodes) < 8


@pytest.mark.parametrize("cost", list(COSTS))
def test_greedy_adaptive_equals_plain_decoding_oracle(
    make_oracle_engine, greedy_references, prompt_ids, cost_files, cost
):
    engine, _ = make_oracle_engine(
        "ddtree", budget=8, max_num_seqs=3, budget_policy="adaptive", cost_curve=cost_files[cost]
    )
    steer_by_the_file(engine)  # the regime is the cost file's, not this machine's host work
    add_greedy_requests(engine, prompt_ids, REFERENCE_TOKENS)
    outputs, steps = run_recording_steps(engine)
    for i, prompt in enumerate(prompt_ids):
        assert [*prompt, *outputs[str(i)]] == greedy_references[tuple(prompt)]
    assert_regime(cost, steps)


def test_a_settled_step_drafts_and_builds_at_its_width(make_pair_config, prompt_ids, cost_files, monkeypatch):
    """Verified tokens cost enough that weighings keep only the likeliest nodes of a ceiling's
    trees (with no trim margin, so they cut at the best width however close the wider ones):
    a settled step asks the drafter for its width's ranks only and verifies trees no wider,
    and the output stays plain decoding's."""
    monkeypatch.setattr(allocator, "TRIM_MIN_GAIN", 0.0)
    max_tokens = 64
    engine = gentle_engine(make_pair_config, cost_files)
    policy = engine.budget_policy
    settled_widths: list[int | None] = []
    top_ks = recorded_top_ks(engine.drafter)
    plan = policy.plan

    def recording_plan(caps, hidden=False, steps_to_finish=None):
        ceiling = plan(caps, hidden=hidden, steps_to_finish=steps_to_finish)
        settled_widths.append(policy.settled_width if ceiling else None)
        return ceiling

    policy.plan = recording_plan
    cruised = policy.cruised

    def recording_cruised(trees, accepted, whole=False):  # a plain streak's step that did not plan
        settled_widths.append(None)
        return cruised(trees, accepted, whole)

    policy.cruised = recording_cruised
    add_greedy_requests(engine, prompt_ids, max_tokens)
    outputs, steps = run_recording_steps(engine)
    assert outputs == plain_decoding(make_pair_config, prompt_ids, max_tokens)
    drafted = [(width, step) for width, step in zip(settled_widths, steps, strict=True) if step.drafted]
    assert len(top_ks) == len(drafted)  # one draft call per drafted step
    settled = [(w, s, k) for (w, s), k in zip(drafted, top_ks, strict=True) if w is not None]
    assert any(width < step.ceiling for width, step, _ in settled)
    for width, step, top_k in settled:
        assert top_k == width and max(step.num_nodes) <= width


def test_only_a_draining_batch_tells_the_policy_its_steps_to_finish(make_pair_config, prompt_ids, cost_files):
    """Two slots for three requests, all added at once, and a policy that weighs a drain: while
    one waits, or within `DRAIN_QUIET_STEPS` of the last request added, it plans for the batch's
    rate; once
    nothing waits or arrives, it is told each running request's expected steps to its end (the
    longest request's the most), and the output stays plain decoding's."""
    config = make_pair_config(mode="ddtree", budget=8, max_num_seqs=2, budget_policy="adaptive")
    engine = build_local_engine(config.model_copy(update={"cost_curve": cost_files["free_nodes"]}))
    steer_by_the_file(engine)
    policy = engine.budget_policy
    assert not policy.weighs_drain  # off by default
    policy.gate.drain_power = 4.0
    plans: list[tuple[bool, Sequence[float] | None]] = []  # (draining, steps_to_finish)
    plan = policy.plan
    step = 0

    def recording_plan(caps, hidden=False, steps_to_finish=None):
        plans.append((engine.num_waiting == 0 and step >= DRAIN_QUIET_STEPS, steps_to_finish))
        if steps_to_finish is not None:
            assert len(steps_to_finish) == len(caps)
        return plan(caps, hidden=hidden, steps_to_finish=steps_to_finish)

    policy.plan = recording_plan
    lengths = (12, 60, 40)
    add_greedy_requests(engine, prompt_ids, lengths)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        step += 1
        outputs.update({out.request_id: list(out.token_ids) for out in engine.step() if out.finished})
    assert outputs == plain_decoding(make_pair_config, prompt_ids, lengths)
    assert any(draining for draining, _ in plans) and not all(draining for draining, _ in plans)
    assert all((told is not None) == draining for draining, told in plans)
    # Requests 1 (60 tokens, running from the start) and 2 (40, admitted when request 0 ended):
    # 2 has the more to go.
    told = [steps for _, steps in plans if steps is not None and len(steps) == 2]
    assert told and all(0 < first < second for first, second in told)


def test_a_plain_streak_cruises_unasked_until_its_batch_changes(make_pair_config, prompt_ids, cost_files):
    """A drafter so dear that the gate decodes plainly: a plain streak's steps run without
    planning, at most `PLAIN_CRUISE_STEPS` in a row, each with a plain step's record; a request
    that finishes changes the batch, and the next step plans again (the plain step's price is
    read at the batch now). The output stays plain decoding's."""
    config = make_pair_config(mode="ddtree", budget=8, max_num_seqs=3, budget_policy="adaptive")
    engine = build_local_engine(config.model_copy(update={"cost_curve": cost_files["costly_drafter"]}))
    steer_by_the_file(engine)
    policy = engine.budget_policy
    planned: list[bool] = []
    plan = policy.plan

    def recording_plan(caps, hidden=False, steps_to_finish=None):
        planned[-1] = True
        return plan(caps, hidden=hidden, steps_to_finish=steps_to_finish)

    policy.plan = recording_plan
    lengths = (16, 40, 40)  # the first request leaves the batch early
    add_greedy_requests(engine, prompt_ids, lengths)
    outputs: dict[str, list[int]] = {}
    steps: list[tuple[int, bool, BudgetStep | None]] = []  # (batch, cruised plain, record)
    while engine.has_unfinished_requests():
        planned.append(False)
        batch_size = engine.num_running or engine.num_waiting
        outputs.update({out.request_id: list(out.token_ids) for out in engine.step() if out.finished})
        cruise = engine._cruise_step
        plain_cruise = cruise is not None and cruise.width == 0
        assert not (plain_cruise and planned[-1])
        steps.append((batch_size, plain_cruise, policy.last_step))
    assert outputs == plain_decoding(make_pair_config, prompt_ids, lengths)
    cruised = [i for i, (_, plain_cruise, _) in enumerate(steps) if plain_cruise]
    assert len(cruised) >= 10
    for i in cruised:
        assert steps[i][0] == steps[i - 1][0]  # the batch it was armed at
        assert not steps[i][2].drafted and len(steps[i][2].num_nodes) == steps[i][0]
    run = 0
    for _, plain_cruise, _ in steps:
        run = run + 1 if plain_cruise else 0
        assert run <= PLAIN_CRUISE_STEPS
    drop = next(i for i in range(1, len(steps)) if steps[i][0] < steps[i - 1][0])
    assert not steps[drop][1]  # the batch changed: it planned


def test_a_step_that_did_not_plan_arms_no_plain_cruise(make_pair_config, prompt_ids, cost_files):
    """A step with the drafter lost decodes plainly without asking the gate: its end must not
    arm a plain cruise (which would outlive the loss and keep the returned drafter idle for up
    to `PLAIN_CRUISE_STEPS` steps the gate was never asked about); a plain streak's step does."""
    config = make_pair_config(mode="ddtree", budget=8, max_num_seqs=3, budget_policy="adaptive")
    engine = build_local_engine(config.model_copy(update={"cost_curve": cost_files["costly_drafter"]}))
    steer_by_the_file(engine)
    policy = engine.budget_policy
    add_greedy_requests(engine, prompt_ids, 40)
    while not policy.cruising:  # a plain streak's step arms a cruise
        engine.step()
    assert not policy.cruise_drafts  # the engine reads no keepable depths for it
    policy.end_cruise()  # the drafter lost (`SpecEngine._lose_drafter`)
    policy.record_step_ms(5.0)  # the lost step's end: no `plan` before it
    assert not policy.cruising


@pytest.mark.parametrize("graphs", ["eager", "captured", "none_for_the_batch"])
def test_a_cruising_step_drafts_builds_and_records_at_its_width(
    make_pair_config, prompt_ids, cost_files, graphs
):
    """Where node lessons are dear (a share of 0), a settled step arms a cruise: the steps its
    streak keeps run without planning, ask the drafter for the settled width's ranks, verify
    trees no wider, and still leave a drafted step's record; the output stays plain
    decoding's. A graphed target's verifies keep to its graph buckets; where it has none for the
    batch (past the largest batch bucket, or free widths near the cache's end) they run eager."""
    max_tokens = 64
    engine = gentle_engine(make_pair_config, cost_files)
    policy = engine.budget_policy
    policy.lesson_share = 0.0
    policy.cost.ema_weight = 0.0  # the file's prices hold: this machine's timings end no streak
    if graphs != "eager":
        policy.graph_shapes = VerifyGraphShapes(TOKEN_BUCKETS, engine.settings.max_seq_len)
        if graphs == "none_for_the_batch":
            policy.graph_shapes.allowed_buckets = lambda *args: None  # type: ignore[method-assign]
    padded: list[int] = []
    verify = engine.target.verify_and_commit

    def recording_verify(inputs):
        padded.append(inputs.batch.padded_num_nodes)
        return verify(inputs)

    engine.target.verify_and_commit = recording_verify
    plans: list[int] = []
    top_ks = recorded_top_ks(engine.drafter)
    plan = policy.plan

    def recording_plan(caps, hidden=False, steps_to_finish=None):
        plans.append(len(top_ks))
        return plan(caps, hidden=hidden, steps_to_finish=steps_to_finish)

    policy.plan = recording_plan
    add_greedy_requests(engine, prompt_ids, max_tokens)
    outputs: dict[str, list[int]] = {}
    cruised: list[tuple[int, int, BudgetStep]] = []  # (width, top-K, record)
    while engine.has_unfinished_requests():
        before = policy.last_step
        drafts = len(top_ks)
        outputs.update({out.request_id: list(out.token_ids) for out in engine.step() if out.finished})
        cruise = engine._cruise_step
        if cruise is not None and cruise.width == 0:  # a plain streak's cruise
            assert drafts not in plans and len(top_ks) == drafts and not policy.last_step.drafted
        elif cruise is not None:
            assert drafts not in plans and len(top_ks) == drafts + 1  # drafted without planning
            assert policy.last_step is not before
            cruised.append((cruise.width, top_ks[-1], policy.last_step))
    assert outputs == plain_decoding(make_pair_config, prompt_ids, max_tokens)
    assert len(cruised) >= 5
    for width, top_k, record in cruised:
        assert record.drafted and top_k == width and max(record.num_nodes) <= width
        assert len(record.predicted_per_request) == len(record.num_nodes)
    assert sum(record.accepted for _, _, record in cruised) > 0
    if graphs == "captured":
        assert all(n in TOKEN_BUCKETS for n in padded)


@pytest.mark.parametrize("cost", ["free_nodes", "gentle"])
def test_a_requests_draft_budget_bounds_its_trees_under_the_adaptive_policy(
    make_pair_config, prompt_ids, cost_files, cost
):
    """A request's own `draft_budget` is an upper bound on its tree, whatever the policy weighs,
    settles or cruises (the engine's budget is the ceiling), and the output stays plain
    decoding's. Free nodes keep every tree at its cap; the gentle file cuts them further."""
    config = make_pair_config(mode="ddtree", budget=16, max_num_seqs=3, budget_policy="adaptive")
    engine = build_local_engine(config.model_copy(update={"cost_curve": cost_files[cost]}))
    steer_by_the_file(engine)
    engine.budget_policy.lesson_share = 0.0  # settled steps arm cruises
    caps = (3, 16, 6)
    for i, (prompt, cap) in enumerate(zip(prompt_ids, caps, strict=False)):
        params = SamplingParams(max_tokens=48, ignore_eos=True, draft_budget=None if cap == 16 else cap)
        engine.add_request(str(i), prompt, params)
    outputs, steps = run_recording_steps(engine)
    assert outputs == plain_decoding(make_pair_config, prompt_ids[: len(caps)], 48)
    full = [s for s in steps if s.drafted and len(s.num_nodes) == len(caps)]
    assert len(full) >= 5
    for step in full:
        assert all(n <= cap for n, cap in zip(step.num_nodes, caps, strict=True))
    if cost == "free_nodes":
        assert any(step.num_nodes[0] == 3 and step.num_nodes[2] == 6 for step in full)


def test_a_drafting_streak_holds_while_its_batch_drains(make_pair_config, prompt_ids, cost_files):
    """Requests of three lengths finish one by one: the drafting streak keeps its choice as the
    batch falls below its bucket (3 -> 2 -> 1), cruising or held without deciding, as a fixed
    budget keeps its width; a request at its last token (no draft token to keep) verifies its
    root only without ending a cruise (that step's trees are cut: it teaches no tokens ratio,
    where cruising steps of whole trees do). The output stays plain decoding's."""
    engine = gentle_engine(make_pair_config, cost_files)
    policy = engine.budget_policy
    policy.lesson_share = 0.0  # node lessons are dear: settled steps arm cruises
    policy.cost.ema_weight = 0.0  # the file's prices hold: this machine's timings end no streak
    # Each drain lands inside a held streak, between its probes, and a cruise meets a request's
    # last token at batch 2 (lengths tuned to the gate's choices on this pair and cost file).
    lengths = (36, 57, 96)
    add_greedy_requests(engine, prompt_ids, lengths)
    outputs: dict[str, list[int]] = {}
    batches: list[int] = []
    cruised: list[tuple[int, list[int], BudgetStep]] = []  # (step, keepable depths, record)
    whole: list[bool] = []  # per cruising step: its trees uncut (they teach the tokens ratio)
    held: list[bool] = []  # per step: it kept the streak's choice without deciding
    while engine.has_unfinished_requests():
        batch_size = engine.num_running or engine.num_waiting
        outputs.update({out.request_id: list(out.token_ids) for out in engine.step() if out.finished})
        cruise = engine._cruise_step
        held.append(cruise is not None or policy.gate.kept)
        if cruise is not None and cruise.width > 0:
            cruised.append((len(batches), list(cruise.keepable), policy.last_step))
            whole.append(cruise.whole)
        batches.append(batch_size)
    assert outputs == plain_decoding(make_pair_config, prompt_ids, lengths)
    drained = [i for i in range(1, len(batches)) if batches[i] < batches[i - 1]]
    assert len(drained) == 2 and all(held[i] for i in drained)  # each bucket drained into, held
    assert any(i > drained[0] for i, _, _ in cruised)  # and cruising below the full batch's bucket
    last_tokens = [(depths, record) for _, depths, record in cruised if len(depths) > 1 and min(depths) == 0]
    assert last_tokens
    assert any(whole) and not any(
        w for w, (_, depths, _) in zip(whole, cruised, strict=True) if min(depths) == 0
    )
    for depths, record in last_tokens:
        assert record.drafted and len(record.num_nodes) == len(depths)
        for depth, nodes, accepted in zip(depths, record.num_nodes, record.accepted_per_request, strict=True):
            assert depth > 0 or nodes == accepted == 0


def test_a_waves_tail_cruises_to_its_end_and_the_next_wave_decides(make_pair_config, prompt_ids, cost_files):
    """Every request of a closed wave ending within the gate's tail (`TAIL_STEPS`), a drafting
    cruise whose steps are spent keeps cruising to the wave's end instead of deciding for the
    few steps left; the next wave's first step decides anew (the gate's probe count starts
    over: no neighbour probe at a step whose newcomers catch up). Both waves' outputs stay
    plain decoding's."""
    engine = gentle_engine(make_pair_config, cost_files)
    policy = engine.budget_policy
    policy.lesson_share = 0.0  # node lessons are dear: settled steps arm cruises
    policy.cost.ema_weight = 0.0  # the file's prices hold: this machine's timings end no streak
    prompts, length = prompt_ids[:3], 36
    expected = plain_decoding(make_pair_config, prompts, length)
    tails: list[list[bool]] = []  # per wave, per step: whether it cruised past its cruise's steps
    for _ in range(2):
        add_greedy_requests(engine, prompts, length)
        outputs: dict[str, list[int]] = {}
        tail: list[bool] = []
        while engine.has_unfinished_requests():
            outputs.update({out.request_id: list(out.token_ids) for out in engine.step() if out.finished})
            if not tail and tails and any(tails[-1]):
                assert engine._cruise_step is None and not policy.gate.probing_neighbour
            cruise = policy._cruise if engine._cruise_step is not None else None
            tail.append(cruise is not None and cruise.in_tail)
        assert outputs == expected
        tails.append(tail)
    assert any(tails[0])
    for tail in tails:
        if any(tail):
            assert all(tail[tail.index(True) :])  # held to the wave's end


def test_an_engine_given_a_cruising_policy_plans_its_first_step(make_pair_config, cost_files):
    """A policy kept from a lost engine (or shared by a benchmark's engines) may have a cruise
    armed for that engine's streak: the engine it is given to ends it, so its first drafted
    step plans."""
    config = make_pair_config(mode="ddtree", budget=16, max_num_seqs=3, budget_policy="adaptive")
    config = config.model_copy(update={"cost_curve": cost_files["gentle"]})
    engine = build_local_engine(config)
    policy = engine.budget_policy
    policy._cruise = _Cruise(ceiling=16, width=8, batch_bucket=1, cap_bucket=16, steps_left=5)
    assert policy.cruise_width(1, 16) == 8
    SpecEngine(config.to_settings(), engine.target, engine.drafter, engine.tokenizer, budget_policy=policy)
    assert not policy.cruising and policy.cruise_width(1, 16) is None


def test_a_drafter_lost_during_a_cruise_ends_it(make_pair_config, prompt_ids, cost_files):
    """A drafter lost on a cruising step's draft ends the cruise: that step decodes plainly, and
    the first drafted step after the drafter is back plans anew (its streak is not the one it
    settled); the output stays plain decoding's. The run is deterministic here (the file's
    prices, no lesson cheap), so a first run finds the draft call to fail."""
    max_tokens = 48

    def run(die_at_calls: set[int]) -> tuple[dict[str, list[int]], list[tuple[int, bool]], FlakyDrafter]:
        config = make_pair_config(mode="ddtree", budget=16, max_num_seqs=3, budget_policy="adaptive")
        config = config.model_copy(update={"cost_curve": cost_files["gentle"]})
        drafter = FlakyDrafter(lambda: build_draft_step(config), die_at_calls, polls_until_back=2)
        tokenizer = load_tokenizer(target_dir(config))
        engine = SpecEngine(config.to_settings(), build_target_step(config), drafter, tokenizer)
        steer_by_the_file(engine)
        engine.budget_policy.lesson_share = 0.0
        engine.budget_policy.cost.ema_weight = 0.0
        add_greedy_requests(engine, prompt_ids, max_tokens)
        outputs: dict[str, list[int]] = {}
        steps: list[tuple[int, bool]] = []  # (drafter calls so far, whether the step cruised)
        while engine.has_unfinished_requests():
            outputs.update({out.request_id: list(out.token_ids) for out in engine.step() if out.finished})
            steps.append((drafter.num_calls, engine._cruise_step is not None))
        return outputs, steps, drafter

    expected, steps, _ = run(set())
    cruising_calls = [calls for calls, cruised in steps if cruised]
    assert cruising_calls
    outputs, steps, drafter = run({cruising_calls[0]})
    assert outputs == expected and drafter.num_returns == 1
    lost = next(i for i, (calls, _) in enumerate(steps) if calls == cruising_calls[0])
    assert not steps[lost][1]  # the step whose draft failed ran plainly
    back = next(i for i, (calls, _) in enumerate(steps) if calls > cruising_calls[0])
    assert not steps[back][1]  # the first draft after the return planned


@pytest.mark.parametrize("cost", list(COSTS))
def test_greedy_adaptive_equals_plain_decoding_real_drafter(
    make_pair_config, greedy_references, prompt_ids, cost_files, cost
):
    config = make_pair_config(mode="ddtree", budget=16, max_num_seqs=3, budget_policy="adaptive")
    engine = build_local_engine(config.model_copy(update={"cost_curve": cost_files[cost]}))
    add_greedy_requests(engine, prompt_ids, REFERENCE_TOKENS)
    outputs, _ = run_recording_steps(engine)
    for i, prompt in enumerate(prompt_ids):
        assert [*prompt, *outputs[str(i)]] == greedy_references[tuple(prompt)]


def test_a_costly_host_build_narrows_the_ceiling_and_stays_lossless(
    make_pair_config, greedy_references, prompt_ids, cost_files
):
    """Free forward nodes but a build that costs per node: narrow ceilings, the same output."""
    config = make_pair_config(mode="ddtree", budget=16, max_num_seqs=3, budget_policy="adaptive")
    engine = build_local_engine(config.model_copy(update={"cost_curve": cost_files["free_nodes"]}))
    engine.budget_policy.build = BuildCost(0.0, 0.0, per_node_ms=1.0, ema_weight=0.0)  # no live rescale
    add_greedy_requests(engine, prompt_ids, REFERENCE_TOKENS)
    outputs, steps = run_recording_steps(engine)
    for i, prompt in enumerate(prompt_ids):
        assert [*prompt, *outputs[str(i)]] == greedy_references[tuple(prompt)]
    ceilings = [s.ceiling for s in steps if s.drafted]
    assert ceilings and min(ceilings) < 16  # the build's price cut the trees below the cap
    assert all(max(s.num_nodes) <= s.ceiling for s in steps if s.drafted)  # built at most the ceiling


def test_context_from_plain_steps_reaches_the_drafter(make_pair_config, prompt_ids, cost_files):
    """Costly drafter: many plain steps between drafts; drafter context == target cache throughout."""
    config = make_pair_config(mode="ddtree", budget=6, max_num_seqs=3, budget_policy="adaptive")
    engine = build_local_engine(config.model_copy(update={"cost_curve": cost_files["costly_drafter"]}))
    drafter = CheckingDrafter(engine.drafter, engine.target)
    engine.drafter = drafter
    for i, prompt in enumerate(prompt_ids):
        params = SamplingParams(max_tokens=40, temperature=0.8 if i == 1 else 0.0, seed=i, ignore_eos=True)
        engine.add_request(str(i), prompt, params)
    num_checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_checked += check_after_step(engine, drafter)
    assert drafter.num_checked >= 2 * len(prompt_ids)  # drafted more than once: a probe came back
    assert drafter.mismatches == [] and num_checked > 20


def checked_engine(
    make_pair_config, cost_file: str, budget: int, max_num_seqs: int
) -> tuple[SpecEngine, CheckingDrafter]:
    """An adaptive engine over the bundled pair steered by `cost_file` alone, with a drafter
    that checks its positions against the target's."""
    engine = build_local_engine(
        make_pair_config(
            mode="ddtree",
            budget=budget,
            max_num_seqs=max_num_seqs,
            budget_policy="adaptive",
            cost_curve=cost_file,
        )
    )
    steer_by_the_file(engine)
    drafter = CheckingDrafter(engine.drafter, engine.target)
    engine.drafter = drafter
    return engine, drafter


def run_checked(
    engine: SpecEngine, drafter: CheckingDrafter, prompts: list[list[int]], greedy_references
) -> None:
    """Runs `engine`'s requests (request `i` for `prompts[i]`) to idle, checking the drafter's
    context against the target's cache after every step: each output is its prompt's greedy
    reference and no draft found the two apart."""
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = list(output.token_ids)
        check_after_step(engine, drafter)
    for i, prompt in enumerate(prompts):
        assert [*prompt, *outputs[str(i)]] == greedy_references[tuple(prompt)]
    assert drafter.mismatches == []


def probing_engine(make_pair_config, cost_file: str, num_requests: int) -> tuple[SpecEngine, CheckingDrafter]:
    """`checked_engine` at budget 6, probing every 3 plain steps."""
    engine, drafter = checked_engine(make_pair_config, cost_file, budget=6, max_num_seqs=num_requests)
    engine.budget_policy.gate.probe_interval = 3
    return engine, drafter


def test_a_probe_drafts_a_few_requests_and_the_rest_catch_up_later(
    make_pair_config, greedy_references, prompt_ids, cost_files
):
    """More running requests than a probe drafts: the undrafted ones verify their root, keep
    their context for later, and every output is still the target's greedy output."""
    requests = [prompt_ids[i % len(prompt_ids)] for i in range(PROBE_REQUESTS + 3)]
    engine, drafter = probing_engine(make_pair_config, cost_files["costly_drafter"], len(requests))
    for i, prompt in enumerate(requests):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=REFERENCE_TOKENS, ignore_eos=True))
    finished: dict[str, list[int]] = {}
    partial_probes = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.token_ids)
        step = engine.budget_policy.last_step
        if engine.budget_policy.probing and step is not None and step.drafted:
            partial_probes += 1
            assert all(n == 0 for n in step.num_nodes[PROBE_REQUESTS:])  # roots only past the probe
        check_after_step(engine, drafter)
    assert partial_probes >= 2 and drafter.mismatches == []
    for i, prompt in enumerate(requests):
        assert [*prompt, *finished[str(i)]] == greedy_references[tuple(prompt)]


def test_a_probe_drafts_the_requests_whose_drafter_context_lags_least(
    make_pair_config, greedy_references, prompt_ids, cost_files
):
    """Requests joining during plain steps owe the drafter their whole prompt: a probe drafts
    the ones that owe least (those drafted at the last probe owe only the plain steps since),
    those near their end (trees cut short) last, puts them first in its verify batch, and every
    output is still the target's greedy output."""
    requests = [prompt_ids[i % len(prompt_ids)] for i in range(PROBE_REQUESTS + 4)]
    engine, drafter = probing_engine(make_pair_config, cost_files["costly_drafter"], len(requests))
    verified_slots: list[list[int]] = []
    verify = engine.target.verify_and_commit

    def recording_verify(inputs):
        verified_slots.append(list(inputs.slots))
        return verify(inputs)

    engine.target.verify_and_commit = recording_verify
    params = SamplingParams(max_tokens=REFERENCE_TOKENS, ignore_eos=True)
    finished: dict[str, list[int]] = {}
    probes_with_a_choice = 0
    for step in range(200):
        if step % 3 == 0 and step // 3 < len(requests):  # one newcomer every few steps
            engine.add_request(str(step // 3), requests[step // 3], params)
        if not engine.has_unfinished_requests():
            break
        # A newcomer joins this step: the drafter then lacks its prompt (prefill caches it).
        running = [*engine.scheduler.running, *engine.scheduler.waiting]
        lags = {id(r): r.num_cached_tokens - r.num_drafter_context_tokens for r in engine.scheduler.running}
        lags.update({id(r): r.num_prompt_tokens for r in engine.scheduler.waiting})
        # The probe's order: trees a request's end cuts short last, then the drafter's lag.
        order = {id(r): (engine._keepable_depths([r])[0] < engine.block_size, lags[id(r)]) for r in running}
        drafted_before = {id(r): r.num_drafter_context_tokens for r in running}
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.token_ids)
        check_after_step(engine, drafter)
        if not engine.budget_policy.probing or len(running) <= PROBE_REQUESTS:
            continue
        drafted = [r for r in running if r.num_drafter_context_tokens != drafted_before[id(r)]]
        skipped = [r for r in running if r.num_drafter_context_tokens == drafted_before[id(r)]]
        assert len(drafted) == PROBE_REQUESTS
        assert max(order[id(r)] for r in drafted) <= min(order[id(r)] for r in skipped)
        assert {r.slot for r in drafted if not r.finished} <= set(verified_slots[-1][:PROBE_REQUESTS])
        probes_with_a_choice += len({order[id(r)] for r in running}) > 1
    assert probes_with_a_choice >= 2 and drafter.mismatches == []
    for i, prompt in enumerate(requests):
        assert [*prompt, *finished[str(i)]] == greedy_references[tuple(prompt)]


def test_measured_cost_curve_covers_the_engine_shapes(make_pair_config):
    engine = build_local_engine(
        make_pair_config(mode="ddtree", budget=4, max_num_seqs=2, budget_policy="adaptive")
    )
    cost = engine.budget_policy.cost
    assert cost.batch_sizes.tolist() == [1, 2]
    assert cost.token_counts.max() == 2 * 5  # the widest padded batch: 2 trees of 4 nodes + root
    assert (cost.grid_ms > 0).all() and (cost.draft_grid_ms > 0).all()
    assert all(engine.target.runner.seq_len(slot) == 0 for slot in range(2))  # scratch slots freed


def test_adaptive_needs_ddtree():
    with pytest.raises(ValueError, match="adaptive"):
        EngineConfig(mode="chain", budget_policy="adaptive")


@pytest.mark.skipif(not bundled_pair_present(), reason="needs the bundled pair")
@pytest.mark.parametrize(("cost", "min_accepted"), [("free_nodes", 75), ("steep", 10)])
def test_adaptive_sampling_follows_the_target_distribution(cost_files, cost, min_accepted):
    """Chi-square goodness of fit of adaptive ddtree's first sampled tokens (as test_sampling)."""
    config = EngineConfig(
        mode="ddtree",
        budget=16,
        max_num_seqs=32,
        budget_policy="adaptive",
        cost_curve=cost_files[cost],
        record_timings=True,
    )
    engine = build_local_engine(config)
    steer_by_the_file(engine)
    engine.budget_policy.cost.ema_weight = 0.0  # the file's free nodes stay free: trees get verified
    prompt = load_tokenizer(bundled_target_dir()).encode("def fibonacci(n):").ids
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_k=4, ignore_eos=True)
    num_samples = 300
    for seed in range(num_samples):
        engine.add_request(str(seed), prompt, dataclasses.replace(params, seed=seed))
    outputs, steps = run_recording_steps(engine)
    counts = Counter(tuple(tokens) for tokens in outputs.values())
    exact = exact_prefix_distribution(bundled_target_dir(), prompt, params, NUM_TOKENS)
    assert sum(s.accepted for s in steps) > min_accepted  # trees were accepted, not just roots
    statistic, dof = chi_square(counts, exact)
    assert chi_square_pvalue(statistic, dof) > 1e-3


def test_no_request_verifies_draft_tokens_it_cannot_keep(
    make_oracle_engine, greedy_references, prompt_ids, cost_files
):
    """Free nodes put every tree at its ceiling of 8, but a request with n tokens left keeps at
    most n - 1 draft tokens (its step also commits one of the target's): its trees lose the
    nodes deeper than that, not their width (shallow nodes still count), the step before its
    last drafts nothing, and the output is still the target's."""
    engine, target = make_oracle_engine(
        "ddtree", budget=8, max_num_seqs=1, budget_policy="adaptive", cost_curve=cost_files["free_nodes"]
    )
    steer_by_the_file(engine)
    prompt, max_tokens = prompt_ids[0], 12
    engine.add_request("0", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    generated, wide_and_shallow = 0, 0
    while engine.has_unfinished_requests():
        verifies = len(target.verify_max_depths)
        outputs = engine.step()
        step = engine.budget_policy.last_step
        if step is not None and generated > 0:  # the first step is the prefill's
            keepable = max_tokens - generated - 1
            assert target.verify_max_depths[verifies:] == [min(target.verify_max_depths[-1], keepable)]
            assert keepable > 0 or step.num_nodes[0] == 0
            wide_and_shallow += step.num_nodes[0] > max(keepable, 0)
        generated += sum(o.num_new_tokens for o in outputs)
        tokens = [*prompt, *outputs[0].token_ids] if outputs and outputs[0].finished else None
    assert tokens == greedy_references[tuple(prompt)][: len(prompt) + max_tokens]
    assert wide_and_shallow > 0  # a tree kept more nodes than its request could keep tokens


class _DeviceLikeTarget(RecordingTarget):
    """A target that, like a CUDA one, runs `while_verifying` inside its verify call; it records
    what the hook was and whether the policy still had a lesson to learn before and after it."""

    def __init__(self, inner, policy_of) -> None:
        super().__init__(inner)
        self.policy_of = policy_of
        self.while_verifying = None
        self.windows: list[tuple[object, bool, bool]] = []  # (hook, lesson before, lesson after)

    def verify_and_commit(self, inputs):
        hook, policy = self.while_verifying, self.policy_of()
        before = policy._lesson is not None
        if hook is not None:
            hook()
        self.windows.append((hook, before, policy._lesson is not None))
        return super().verify_and_commit(inputs)


def test_the_last_steps_lesson_is_learned_while_the_device_verifies(
    make_oracle_engine, greedy_references, prompt_ids, cost_files
):
    """A target that leaves the host idle during its verify gets the policy's `learn` to run
    there (the H200 paid 0.35 ms a step for it before the drafter's shorter kernels); the hook
    is gone after the call (another engine may share the target), and the output is unchanged."""
    engine, _ = make_oracle_engine(
        "ddtree", budget=8, max_num_seqs=3, budget_policy="adaptive", cost_curve=cost_files["free_nodes"]
    )
    steer_by_the_file(engine)
    target = _DeviceLikeTarget(engine.target, lambda: engine.budget_policy)
    engine.target = target
    add_greedy_requests(engine, prompt_ids, REFERENCE_TOKENS)
    outputs, _ = run_recording_steps(engine)
    for i, prompt in enumerate(prompt_ids):
        assert [*prompt, *outputs[str(i)]] == greedy_references[tuple(prompt)]
    assert target.while_verifying is None
    assert all(hook == engine.budget_policy.learn for hook, _, _ in target.windows)
    # Past the calibrator's first steps (`plan` learns those at once), each step leaves its
    # lesson to the next one's verify, which learns it.
    settled = target.windows[LEARNING_STEPS + 1 :]
    assert len(settled) >= 3 and all(before and not after for _, before, after in settled)


def test_a_verify_that_raises_leaves_no_hook_on_the_target(make_oracle_engine, prompt_ids, cost_files):
    """The hook is the calling engine's for one call only: a target lost mid-verify must not
    keep it (another engine, or the next one after a restart, may call that target)."""
    engine, _ = make_oracle_engine(
        "ddtree", budget=8, max_num_seqs=3, budget_policy="adaptive", cost_curve=cost_files["free_nodes"]
    )
    target = _DeviceLikeTarget(engine.target, lambda: engine.budget_policy)
    engine.target = target

    def lost(inputs):
        assert target.while_verifying is not None  # set for the call
        raise TargetUnavailableError("the device is gone")

    target.verify_and_commit = lost  # type: ignore[method-assign]
    engine.add_request("0", prompt_ids[0], SamplingParams(max_tokens=8, ignore_eos=True))
    with pytest.raises(TargetUnavailableError):
        for _ in range(3):
            engine.step()
    assert target.while_verifying is None


def drafts_as_on_a_device(engine: SpecEngine, monkeypatch) -> list[bool]:
    """Every draft of `engine` counts as a device's (its kernels queued when the call returns,
    as a CUDA drafter's), so its adaptive steps may launch a draft before they plan; returns the
    `hidden` flag of every `plan` from now on, in order (and fails a hidden one whose draft could
    only go unused: every cap 0)."""
    call_drafter = engine._call_drafter

    def on_device(requests, top_k):
        draft = call_drafter(requests, top_k)
        engine._device_drafts = draft is not None
        return draft

    monkeypatch.setattr(engine, "_call_drafter", on_device)
    hidden_flags: list[bool] = []
    plan = engine.budget_policy.plan

    def recording_plan(caps, hidden=False, steps_to_finish=None):
        hidden_flags.append(hidden)
        if hidden:
            assert any(caps), "a draft launched ahead where no request can keep a token"
        return plan(caps, hidden=hidden, steps_to_finish=steps_to_finish)

    monkeypatch.setattr(engine.budget_policy, "plan", recording_plan)
    return hidden_flags


@pytest.mark.parametrize("cost", ["free_nodes", "steep"])
def test_a_draft_launched_before_the_plan_keeps_the_output_and_the_drafters_context(
    make_pair_config, greedy_references, prompt_ids, cost_files, cost, monkeypatch
):
    """With a device's drafter a step the policy all but surely drafts launches its draft (at
    the widest K) before it plans: the trees cut from it are a best-first tree's prefixes, the
    output stays the plain decoding's and the drafter's context the target's cache."""
    engine, drafter = checked_engine(make_pair_config, cost_files[cost], budget=16, max_num_seqs=3)
    top_ks = recorded_top_ks(drafter)
    hidden = drafts_as_on_a_device(engine, monkeypatch)
    add_greedy_requests(engine, prompt_ids, REFERENCE_TOKENS)
    run_checked(engine, drafter, prompt_ids, greedy_references)
    assert not hidden[0]  # the first plan has no drafting decision behind it
    if cost == "free_nodes":  # drafting far ahead of plain steps: its decisions run hidden
        assert any(hidden) and 16 in top_ks  # drafts launched ahead take the cap's K
        # but one in `AHEAD_DRAFT_LESSONS` does not, so the drafter's price is still learned
        runs = "".join("h" if flag else "." for flag in hidden).split(".")
        assert max(len(run) for run in runs) <= AHEAD_DRAFT_LESSONS
    else:  # plain steps within `PLAIN_PROBE_MAX_GAIN`: a plain probe may come, nothing ahead
        assert not any(hidden)


def test_a_plain_choice_after_a_draft_launched_ahead_leaves_it_unused(
    make_pair_config, greedy_references, prompt_ids, cost_files, monkeypatch
):
    """A plan that turns to a plain step after its draft was launched: the step decodes
    plainly, the drafter keeps the context it took (the next draft needs no catch-up) and the
    step's time is taught without the drafter call's price (`draft_unused`), or not at all
    where the draft caught up on a newcomer's prompt (no step's cost)."""
    engine, drafter = checked_engine(make_pair_config, cost_files["free_nodes"], budget=16, max_num_seqs=3)
    policy = engine.budget_policy
    plan = policy.plan
    turned: list[bool] = []

    newcomers: list[bool] = []  # per plain turn: whether its draft caught up on a prompt

    def plain_every_other_ahead(caps, hidden=False, steps_to_finish=None):
        ceiling = plan(caps, hidden=hidden, steps_to_finish=steps_to_finish)
        if hidden:
            turned.append(not turned or not turned[-1])
            if turned[-1]:
                newcomers.append(any(r.steps == 0 for r in engine.scheduler.running))
            return 0 if turned[-1] else ceiling
        return ceiling

    monkeypatch.setattr(policy, "plan", plain_every_other_ahead)
    drafts_as_on_a_device(engine, monkeypatch)
    record_step_ms = policy.record_step_ms
    unused: list[bool] = []

    priced: list[bool] = []  # per unused draft: whether its step's time teaches a cost

    def recording_step_ms(step_ms, draft_unused=False):
        unused.append(draft_unused)
        if draft_unused:
            priced.append(policy._priced_ms is not None)
        record_step_ms(step_ms, draft_unused=draft_unused)

    monkeypatch.setattr(policy, "record_step_ms", recording_step_ms)
    waves = [*prompt_ids, *prompt_ids]  # the second wave's requests join as slots free
    add_greedy_requests(engine, waves, REFERENCE_TOKENS)
    run_checked(engine, drafter, waves, greedy_references)
    assert sum(turned) >= 1 and sum(unused) == sum(turned)
    assert priced == [not caught_up for caught_up in newcomers] and any(newcomers)
