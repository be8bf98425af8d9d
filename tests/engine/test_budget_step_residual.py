"""The step residual: each ceiling judged by what its steps took against what the models said."""

import itertools

import numpy as np
import pytest

from ddtree_serve.engine.budget import AdaptiveBudget, BuildCost, CostCurve, DraftGate
from ddtree_serve.engine.budget.draft_gate import PROBE_TURNS, recheck_steps
from ddtree_serve.engine.budget.policy import PLAIN_CRUISE_STEPS
from ddtree_serve.engine.budget.step_overhead import StepOverhead
from ddtree_serve.engine.budget.step_residual import (
    MAX_RATIO,
    SHRINK_SAMPLES,
    STALE_HALF_LIFE_STEPS,
    WINDOW,
    StepResidual,
    batch_bucket,
)
from ddtree_serve.tree import TreeBatch, build_chain

CONFIDENT = np.array([0.95, 0.9, 0.86, 0.8, 0.75, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2, 0.15, 0.1])
FREE_BUILD = BuildCost(0.0, 0.0, 0.0)


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]


def test_a_ratio_follows_its_steps_and_untaken_ceilings_read_the_nearest_taken_one():
    residual = StepResidual()
    assert residual.ratio(8, 16) == 1.0 and residual.ratio(8, 0) == 1.0  # nothing known
    for _ in range(40):
        residual.observe(8, 16, predicted_ms=4.0, measured_ms=6.0)
    assert residual.ratio(8, 16) == pytest.approx(1.5, abs=0.002)
    assert residual.ratio(7, 16) == residual.ratio(8, 16)  # the same batch bucket
    assert residual.ratio(8, 32) == residual.ratio(8, 16)  # nearest taken drafting ceiling
    assert residual.ratio(8, 0) == 1.0  # a plain step reads only its own
    assert residual.ratio(16, 16) == 1.0  # another bucket
    frozen = StepResidual(frozen=True)
    frozen.observe(8, 16, predicted_ms=4.0, measured_ms=6.0)
    assert frozen.ratio(8, 16) == 1.0


def test_a_ceiling_is_measured_by_its_own_steps_at_its_bucket_only():
    """32 reads 16's ratio but has not measured it: the gate widens its choice only to a ceiling
    its own steps priced. A frozen table takes the models as measured everywhere."""
    residual = StepResidual()
    residual.observe(8, 16, predicted_ms=4.0, measured_ms=6.0)
    assert residual.measured(8, 16) and residual.measured(5, 16)
    assert not residual.measured(8, 32) and not residual.measured(16, 16) and not residual.measured(8, 0)
    assert StepResidual(frozen=True).measured(8, 32)


def test_one_noisy_step_moves_a_ratio_a_little():
    """A first step three times its prediction (the process descheduled) says less than that:
    it is shrunk toward the bucket's level, itself shrunk toward 1 (trust 1 / (1 + SHRINK) each);
    one sample counts as at most MAX_RATIO times its prediction."""
    residual = StepResidual()
    residual.observe(1, 16, predicted_ms=10.0, measured_ms=30.0)
    distrust = 1.0 - 1.0 / (1 + SHRINK_SAMPLES)
    assert residual.ratio(1, 16) == pytest.approx(1.0 + (3.0 - 1.0) * (1.0 - distrust**2))
    huge, capped = StepResidual(), StepResidual()
    huge.observe(1, 4, predicted_ms=1.0, measured_ms=100.0)
    capped.observe(1, 4, predicted_ms=1.0, measured_ms=MAX_RATIO)
    assert huge.ratio(1, 4) == capped.ratio(1, 4)


def test_bad_steps_in_a_row_leave_a_ratio_until_they_are_most_of_its_window():
    """Plain steps as predicted, then a run of steps four times slower (a descheduled process on
    a 2-core machine): up to half the window leaves the ratio where the steps put it; a slowdown
    that lasts (a real change) is learned once it holds most of the window."""
    residual = StepResidual()
    for _ in range(WINDOW):
        residual.observe(8, 0, predicted_ms=20.0, measured_ms=20.0)
    settled = residual.ratio(8, 0)
    assert settled == pytest.approx(1.0)
    for _ in range(WINDOW // 2):
        residual.observe(8, 0, predicted_ms=20.0, measured_ms=80.0)
        assert residual.ratio(8, 0) == pytest.approx(settled, abs=1e-3)  # staleness moves nothing yet
    residual.observe(8, 0, predicted_ms=20.0, measured_ms=80.0)
    assert residual.ratio(8, 0) > 3.0


def test_a_ratio_not_refreshed_fades_toward_the_buckets_level():
    """A ceiling the engine turned away from (its steps took twice their prediction) reads half
    as far from the level of the steps since (plain, as predicted) after STALE_HALF_LIFE_STEPS
    of them: it is tried again."""
    residual = StepResidual()
    for _ in range(40):
        residual.observe(4, 16, predicted_ms=5.0, measured_ms=10.0)
    fresh = residual.ratio(4, 16)
    for _ in range(int(STALE_HALF_LIFE_STEPS)):
        residual.observe(4, 0, predicted_ms=1.0, measured_ms=1.0)
    assert fresh == pytest.approx(2.0, abs=0.01)
    # It fades toward the bucket's level, here the plain steps' 1.0.
    assert residual.ratio(4, 16) == pytest.approx(1.0 + 0.5 * 40 / (40 + SHRINK_SAMPLES) * (2.0 - 1.0))


def flat_cost(verify_ms: float, draft_ms: float) -> CostCurve:
    """Every verify costs `verify_ms` whatever its size; every drafter call `draft_ms`."""
    tokens = np.array([1.0, 4096.0])
    return CostCurve([1, 64], tokens, [[verify_ms, verify_ms]] * 2, draft_ms=[draft_ms, draft_ms])


def test_a_ceiling_whose_steps_cost_more_than_predicted_gives_way():
    """The models price every width alike, so the gate takes the widest ceiling; its steps take
    three times their prediction (host work the models miss), narrower ones what they predict:
    once a probe has taken the narrower ceiling, the gate moves there and stays."""
    gate = DraftGate(probe_interval=3)
    gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
    cost = flat_cost(verify_ms=4.0, draft_ms=1.0)
    chosen = []
    for _ in range(24):
        chosen.append(gate.ceiling([16, 16], cost, FREE_BUILD, "padded"))
        gate.record_step_ms(3.0 * 5.0 if chosen[-1] == 16 else 5.0)  # predicted: 1 ms draft + 4 ms verify
    assert chosen[0] == 16 and 8 in chosen
    settled = chosen[chosen.index(8) + 1 :]
    assert settled.count(8) >= len(settled) - len(settled) // 3  # 8 but for its probes


def test_a_probe_after_plain_steps_teaches_no_ratio():
    """Plain steps teach the plain ratio (they take 1.5x their prediction here); the probes
    between them draft a few requests catching up on context (500 ms) and teach nothing."""
    gate = DraftGate(probe_interval=2)
    gate.record_curve(CONFIDENT[None, :] * 0.1, np.array([len(CONFIDENT)]))
    cost = flat_cost(verify_ms=4.0, draft_ms=40.0)  # drafting is a clear loss: plain, then probes
    probes = 0
    for _ in range(20):
        ceiling = gate.ceiling([16, 16], cost, FREE_BUILD, "padded")
        probes += gate.probing
        gate.record_step_ms(500.0 if gate.probing else 6.0)
        assert ceiling == 0 or gate.probing
    assert probes >= 2
    # The drafting ceilings have no ratio of their own: they read the level plain steps set.
    assert gate.residual.ratio(2, 0) > 1.3
    level = gate.residual.ratio(2, 1)
    assert all(gate.residual.ratio(2, c) == level for c in (2, 4, 8, 16))
    assert level == pytest.approx(gate.residual.ratio(2, 0), rel=0.05)


def test_a_step_the_drafter_lost_teaches_the_drafted_ceiling_nothing():
    """The gate decided to draft; the drafter was lost, so the step verified root-only trees:
    its time says nothing about the drafted ceiling."""
    policy = AdaptiveBudget(flat_cost(verify_ms=2.0, draft_ms=1.0))
    policy.gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
    ceiling = policy.plan([16])
    assert ceiling > 0
    policy.record_verify_ms(2.0)
    assert not policy.observe(TreeBatch.root_only([7]), [[]]).drafted
    policy.record_step_ms(50.0)
    assert policy.gate.residual.ratio(1, ceiling) == 1.0


def test_a_probe_that_has_no_other_ceiling_still_restarts_the_count():
    """With a cap of 1 a due probe can only take the choice itself; the streak still holds
    between probes (it would otherwise decide in full every step from then on), which are
    `len(PROBE_TURNS)` intervals apart where no direction applies."""
    gate = DraftGate(probe_interval=4)
    gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
    cost = flat_cost(verify_ms=4.0, draft_ms=1.0)
    for _ in range(40):
        assert gate.ceiling([1, 1], cost, FREE_BUILD, "padded") == 1
        gate.record_step_ms(5.0)
        assert gate.steps_since_probe <= len(PROBE_TURNS) * gate.probe_interval


def test_a_streak_at_its_cap_probes_narrower_one_interval_in_three():
    """Each node costs a little and the curve ends at 16 positions: 16 is the choice. At cap 16
    its probes can only look narrower (drafting wins by far: no plain probe), once in
    `len(PROBE_TURNS)` probe intervals; under cap 64 it is probed every interval, wider and
    narrower in turn (the wider probe is its only news past its width)."""
    tokens = np.array([1.0, 4096.0])
    cost = CostCurve([1, 64], tokens, [4.0 + 0.05 * (tokens - 1.0)] * 2, draft_ms=[1.0, 1.0])

    def probes(cap: int) -> list[tuple[int, int]]:
        """(step, ceiling) of each probe of the choice's neighbours over 100 steps."""
        gate = DraftGate(probe_interval=4)
        gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
        taken = []
        for step in range(100):
            ceiling = gate.ceiling([cap, cap], cost, FREE_BUILD, "padded")
            if gate.probing_neighbour:
                taken.append((step, ceiling))
            gate.record_step_ms(float(cost.verify_ms(2, 2 * (ceiling + 1))) + 1.0)
        return taken

    def last_gaps(taken: list[tuple[int, int]]) -> list[int]:
        steps = [step for step, _ in taken[-4:]]
        return [later - earlier for earlier, later in itertools.pairwise(steps)]

    at_cap, below_cap = probes(16), probes(64)
    assert {ceiling for _, ceiling in at_cap} == {8}
    assert {ceiling for _, ceiling in below_cap} == {8, 32}
    assert last_gaps(at_cap) == [1 + len(PROBE_TURNS) * 4] * 3
    assert last_gaps(below_cap) == [1 + 4] * 3


def test_a_new_batch_bucket_is_not_probed_at_once():
    """Steps at one bucket count toward its probe; the first step at another takes the best
    choice for it, as a gate meeting that batch first would."""
    cost = flat_cost(verify_ms=4.0, draft_ms=1.0)
    gate = DraftGate(probe_interval=4)
    gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
    for _ in range(2):  # the next step at this bucket would be its first probe
        gate.ceiling([16, 16], cost, FREE_BUILD, "padded")
    fresh = DraftGate(probe_interval=4)
    fresh.record_curve(gate.curve[None, :], np.array([len(gate.curve)]))
    best = fresh.ceiling([16, 16, 16], cost, FREE_BUILD, "padded")
    assert gate.ceiling([16, 16, 16], cost, FREE_BUILD, "padded") == best and not gate.probing


def test_the_step_after_a_neighbour_probe_resumes_the_choice_unless_the_probe_moved_its_price():
    """Every step costs what the models say: a probe of the choice's neighbours leaves their
    prices where they were, so the next step holds the choice undecided (a decision costs a few
    tenths of a millisecond on the H200's host). A probe step that cost twice its prediction
    moves its ceiling's price: the next step decides."""
    for slow_probe in (False, True):
        gate = DraftGate(probe_interval=3)
        gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
        cost = flat_cost(verify_ms=4.0, draft_ms=1.0)
        for _ in range(40):
            choice = gate.ceiling([16, 16], cost, FREE_BUILD, "padded")
            probe = gate.probing_neighbour
            gate.record_step_ms(10.0 if probe and slow_probe else 5.0)
            if probe and gate.steps_since_probe == 0 and choice != 16:
                break
        assert probe and choice != 16  # a neighbour probe, the choice 16
        after = gate.ceiling([16, 16], cost, FREE_BUILD, "padded")
        assert after == 16
        assert gate.held != slow_probe  # held undecided, or decided again


def test_a_plain_streak_decides_again_as_its_batch_drains_within_the_bucket():
    """A verify costs 4 ms plus 1 ms a token: at batch 64 a plain step wins, and after probes
    that found so the next probe is hundreds of steps away; as requests finish within the bucket
    the plain step's price falls, so the streak decides again and drafts before batch 33."""
    tokens = np.array([1.0, 8192.0])
    cost = CostCurve([1], tokens, [4.0 + 1.0 * tokens], draft_ms=[1.0])
    gate = DraftGate()
    gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
    steady = [gate.ceiling([16] * 64, cost, FREE_BUILD, "padded") for _ in range(300)]
    assert steady[-1] == 0 and gate.plain_probe_interval(64) > 64
    drained = []
    for batch_size in range(63, 32, -1):
        drained.append(gate.ceiling([16] * batch_size, cost, FREE_BUILD, "padded") > 0 and not gate.probing)
    assert any(drained)


def test_the_step_after_a_probe_decides_with_what_the_probe_saw():
    """A probe's trees reach the gate's curve before the next decision: else the plain streak
    the gate starts then would run a whole probe interval past what the probe found."""
    tree = TreeBatch.from_trees(
        [build_chain(np.arange(1, 9, dtype=np.int64), 7, np.full(8, -0.01))]
    )  # confident
    policy = AdaptiveBudget(
        flat_cost(verify_ms=4.0, draft_ms=40.0), gate=DraftGate(probe_interval=2), learning_steps=0
    )
    policy.gate.record_curve(CONFIDENT[None, :] * 0.05, np.array([len(CONFIDENT)]))  # unsure so far
    for _ in range(10):
        ceiling = policy.plan([8])
        if policy.probing:
            break
        policy.record_verify_ms(4.0)
        policy.observe(TreeBatch.root_only([7]), [[]])
    assert policy.probing and ceiling > 0
    policy.record_draft_ms(40.0, catching_up=True)
    allocation = policy.choose(tree, [ceiling])
    verified = tree.prefix(allocation.num_nodes)
    policy.record_verify_ms(4.0)
    policy.observe(verified, [list(range(1, int(verified.num_nodes[0])))])  # every node accepted
    before = policy.gate.curve.copy()
    policy.plan([8])
    assert policy.gate.curve[0] > before[0]


def test_caps_shrinking_within_their_power_of_two_keep_the_streak(monkeypatch):
    """Near max_tokens the engine caps each request one node lower every step: the streak holds
    (the gate does not decide in full every step), and never returns more than the cap."""
    gate = DraftGate(probe_interval=64)
    gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
    cost = flat_cost(verify_ms=4.0, draft_ms=1.0)
    first = gate.ceiling([16, 16], cost, FREE_BUILD, "padded")
    assert first == 16
    gate.drafted_probe_interval = gate.probe_interval  # no probe in this short run
    decisions = []
    original = gate._drafted_ceilings
    monkeypatch.setattr(gate, "_drafted_ceilings", lambda *a: decisions.append(1) or original(*a))
    for cap in (15, 14, 13, 12, 11, 10, 9):
        assert gate.ceiling([cap, cap], cost, FREE_BUILD, "padded") == cap
        gate.record_step_ms(5.0)
    assert len(decisions) <= 1  # at most the recheck (`recheck_steps`)


@pytest.mark.parametrize(("batch_size", "held"), [(1, 64), (2, 32), (3, 22), (4, 16), (16, 16), (32, 16)])
def test_a_drafting_streak_decides_again_once_its_steps_held_enough_requests(monkeypatch, batch_size, held):
    """A decision re-reads the curve and the ratios, which a step moves by one tree a request: a
    drafting streak keeps its choice for `DRAFTED_RECHECK_STEPS` steps, or as many as hold
    `RECHECK_REQUESTS` requests between them at a smaller batch, then decides again."""
    assert recheck_steps(batch_size) == held
    gate = DraftGate(probe_interval=1024)
    gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
    cost = flat_cost(verify_ms=4.0, draft_ms=1.0)
    caps = [16] * batch_size
    assert gate.ceiling(caps, cost, FREE_BUILD, "padded") > 0
    gate.drafted_probe_interval = gate.probe_interval  # no probe in this run
    decided: list[int] = []
    original = gate._drafted_ceilings
    for step in range(1, 3 * held):

        def recorded(*args, step=step):
            decided.append(step)
            return original(*args)

        monkeypatch.setattr(gate, "_drafted_ceilings", recorded)
        gate.ceiling(caps, cost, FREE_BUILD, "padded")
        gate.record_step_ms(5.0)
    assert decided[:2] == [held + 1, 2 * held + 2]


def test_a_decided_step_teaches_the_narrower_ceilings_tokens_from_its_trees_prefixes():
    """A drafted step at ceiling 16 also tells what its trees' first 8 and 4 nodes made: each
    narrower ceiling learns its tokens ratio against its own forecast at the decision, without
    moving the bucket's level or the ratios' clock (the step counts once, at 16). A probe
    narrower than the choice teaches its step time only: the choice's steps teach its tokens."""
    gate = DraftGate(probe_interval=3)
    gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
    cost = flat_cost(verify_ms=4.0, draft_ms=1.0)
    assert gate.ceiling([16, 16], cost, FREE_BUILD, "padded") == 16
    forecasts = dict(gate._narrower_forecasts)
    assert set(forecasts) == {1, 2, 4, 8}
    forecast_16 = gate._decided[3]
    made = {8: round(0.5 * forecasts[8]), 4: round(0.5 * forecasts[4])}
    gate.record_step_ms(5.0, tokens=20, tokens_within=made)
    tokens = gate.token_residual
    trust = 1 / (1 + SHRINK_SAMPLES)
    level = 1.0 + trust * (20 / forecast_16 - 1.0)  # the bucket's: the one step, taught at 16
    for ceiling in (8, 4):
        sample = made[ceiling] / forecasts[ceiling]
        assert tokens.ratio(2, ceiling) == pytest.approx(level + trust * (sample - level))
    assert tokens._steps == 1
    for _ in range(20):  # to the narrower probe of 16 (the probes take turns: wider, narrower, ...)
        ceiling = gate.ceiling([16, 16], cost, FREE_BUILD, "padded")
        if gate.probing_neighbour and ceiling < 16:
            break
        gate.record_step_ms(5.0, tokens=20)
    assert gate.probing_neighbour and ceiling == 8
    before = tokens.ratio(2, 8)
    gate.record_step_ms(5.0, tokens=2)
    assert tokens.ratio(2, 8) == pytest.approx(before, rel=0.05)  # aged a step, no lesson


def test_a_ceiling_wider_than_the_one_taken_reads_its_tokens_ratio():
    """Ceiling 16's own steps once made half their forecast (another text, long ago); ceiling
    8's steps now make theirs. Every width costs the same, so the wider tree wins unless its
    tokens are priced low: the gate prices 16 with 8's ratio (the steps taken say how far the
    forecast is off now; 16's nodes past 8 are known from the forecast alone) and takes it, where
    16's stale ratio would have held it at 8, whose steps never tell what 16 makes."""
    gate = DraftGate(probe_interval=1024)
    gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
    cost = flat_cost(verify_ms=4.0, draft_ms=1.0)
    for _ in range(WINDOW):
        gate.token_residual.observe(2, 16, predicted_ms=18.0, measured_ms=9.0)
    for _ in range(2 * WINDOW):  # ceiling 8's steps (and its narrower probe, which teaches no tokens)
        gate.ceiling([8, 8], cost, FREE_BUILD, "padded")
        gate.record_step_ms(5.0, tokens=round(gate._decided[3]))
    assert gate.token_residual.ratio(2, 16) < 0.7 < 0.95 < gate.token_residual.ratio(2, 8)
    assert gate.ceiling([16, 16], cost, FREE_BUILD, "padded") == 16
    gate._tokens_ceiling.clear()  # as before: each ceiling read its own ratio
    gate._streak, gate.steps_since_probe = None, 0  # a decision, no probe due
    assert gate.ceiling([16, 16], cost, FREE_BUILD, "padded") == 8


def test_a_ceiling_turned_away_from_does_not_fade_below_the_machines_level():
    """Plain steps run 1.1x their prediction (the machine's share of what the models miss);
    a drafting ceiling measured at 1.3x, then left for a long plain streak, fades toward 1.1,
    never to the models' 1.0 that would make it look cheaper than the steps still taken."""
    residual = StepResidual()
    for _ in range(WINDOW):
        residual.observe(8, 8, predicted_ms=50.0, measured_ms=65.0)
    for _ in range(int(8 * STALE_HALF_LIFE_STEPS)):
        residual.observe(8, 0, predicted_ms=20.0, measured_ms=22.0)
    assert residual.ratio(8, 8) == pytest.approx(1.1, abs=0.01)
    assert residual.ratio(8, 0) == pytest.approx(1.1, abs=0.01)


def test_the_tokens_table_takes_its_windows_trimmed_mean_not_its_median():
    """A drafted step's tokens are skewed (mostly a few, now and then many): their ratio to
    the forecast is the window's mean without its highest and lowest sample, which the median
    would put low."""
    tokens, times = StepResidual(mean=True), StepResidual()
    samples = [1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 1.0]  # made / forecast
    for sample in samples:
        tokens.observe(1, 8, predicted_ms=1.0, measured_ms=sample)
        times.observe(1, 8, predicted_ms=1.0, measured_ms=sample)
    trimmed = np.mean(sorted(samples)[1:-1])  # 7 / 5
    trust = len(samples) / (len(samples) + SHRINK_SAMPLES)
    level = 1.0 + trust * (trimmed - 1.0)  # the bucket's level: the same samples
    assert tokens.ratio(1, 8) == pytest.approx(level + trust * (trimmed - level))
    assert times.ratio(1, 8) == pytest.approx(1.0)  # the median of the same samples


def test_a_small_batch_keeps_a_window_of_as_many_trees_as_a_full_one():
    """With `window_trees` 8, a ratio at batch 1 is the trimmed mean of its last 8 windows of
    samples (one tree each), at batch 8 and above of its last window: a run of lucky steps at
    batch 1 moves it as little as one lucky step of eight trees would."""
    one_tree, full = StepResidual(mean=True, window_trees=8), StepResidual(mean=True, window_trees=8)
    for residual, batch_size in ((one_tree, 1), (full, 8)):
        for sample in [1.0] * (8 * WINDOW) + [3.0] * WINDOW:
            residual.observe(batch_size, 8, predicted_ms=1.0, measured_ms=sample)
    assert full.ratio(8, 8) == pytest.approx(3.0, rel=0.01)  # the last window: all lucky
    kept = [1.0] * (7 * WINDOW) + [3.0] * WINDOW
    assert one_tree.ratio(1, 8) == pytest.approx(np.mean(sorted(kept)[1:-1]), rel=0.01)


def forecast_gate() -> DraftGate:
    gate = DraftGate(probe_interval=4)
    gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
    return gate


def gate_steps(
    gate: DraftGate,
    steps: int,
    draft_ms: float = 29.0,
    made_over_forecast: float = 1.0,
    plain_over_predicted: float = 1.0,
    cruise: bool = False,
) -> list[tuple[int, bool]]:
    """Each of `steps` steps' ceiling, and whether it is a drafting choice's (probes after plain
    steps not counted; a drafting streak's plain probe counts as its streak's), over batch 2:
    flat 4 ms verifies and a `draft_ms` drafter call (at 29 ms drafting is forecast 11% above
    plain decoding). Drafted steps take their predicted time and make `made_over_forecast` of
    the tokens they forecast; plain steps take `plain_over_predicted` of their predicted time.
    `cruise`: a plain streak's step is followed by the plain steps the policy would cruise
    through unasked (`PLAIN_CRUISE_STEPS`), counted in `steps`."""
    cost = flat_cost(verify_ms=4.0, draft_ms=draft_ms)
    taken: list[tuple[int, bool]] = []
    while len(taken) < steps:
        ceiling = gate.ceiling([16, 16], cost, FREE_BUILD, "padded")
        taken.append((ceiling, (ceiling > 0 and not gate.probing) or gate.probing_neighbour))
        decided = gate._decided  # (batch, ceiling, predicted ms, forecast tokens), or None
        predicted_ms = decided[2] if decided is not None else (4.0 + draft_ms if ceiling else 4.0)
        if ceiling == 0:
            gate.record_step_ms(plain_over_predicted * predicted_ms)
        else:
            made = None if decided is None else round(made_over_forecast * decided[3])
            gate.record_step_ms(predicted_ms, made)
        if cruise and ceiling == 0:
            for _ in range(min(gate.plain_steps_held_ahead(cost, StepOverhead()), PLAIN_CRUISE_STEPS)):
                gate.hold_unchecked(plain=True)
                taken.append((0, False))
    return taken[:steps]


def drafted_steps(gate: DraftGate, made_over_forecast: float, steps: int, cruise: bool = False) -> list[bool]:
    """Whether each step is a drafting choice's (`gate_steps` with a 29 ms drafter call)."""
    taken = gate_steps(gate, steps, made_over_forecast=made_over_forecast, cruise=cruise)
    return [drafting for _, drafting in taken]


def drafting_share(made_over_forecast: float) -> float:
    return float(np.mean(drafted_steps(forecast_gate(), made_over_forecast, 60)))


def test_drafted_steps_that_make_fewer_tokens_than_forecast_turn_the_gate_to_plain_decoding():
    """The forecast prices drafting 11% above a plain step. Steps that make what it says keep
    the gate drafting; steps that make 70% of it (a mean curve over requests of unlike trees, a
    drafter worse than its calibration) make drafting a 22% loss, and the gate learns so from
    the tokens its steps made and decodes plainly but for its probes."""
    assert drafting_share(1.0) == 1.0
    assert drafting_share(0.7) < 0.25


def timed_steps(gate: DraftGate, draft_ms: float, plain_over_predicted: float, steps: int) -> list[int]:
    """Each step's ceiling (`gate_steps`: drafted steps make their forecast tokens)."""
    taken = gate_steps(gate, steps, draft_ms=draft_ms, plain_over_predicted=plain_over_predicted)
    return [ceiling for ceiling, _ in taken]


def test_a_close_drafting_streak_probes_a_plain_step_and_turns_plain_where_those_are_cheaper():
    """Drafting is forecast 11% above plain decoding, but plain steps take 70% of what the cost
    curve says (on the CI CPU the drift drafted verifies taught priced a plain step at 1.2x what
    it took): a drafting streak never takes a plain step of its own accord, so its probes take
    one in turn (`PLAIN_PROBE_MAX_GAIN`), and once measured the gate decodes plainly. Plain
    steps that cost what they are priced at leave it drafting: each plain step is one probe,
    and the streak resumes."""
    cheap = timed_steps(forecast_gate(), draft_ms=29.0, plain_over_predicted=0.7, steps=80)
    first_plain = cheap.index(0)
    assert all(cheap[:first_plain])  # drafting until the probe
    assert sum(c == 0 for c in cheap[-30:]) >= 25  # plain but for probes after plain steps
    as_priced = timed_steps(forecast_gate(), draft_ms=29.0, plain_over_predicted=1.0, steps=80)
    plain_probes = [i for i, c in enumerate(as_priced) if c == 0]
    assert plain_probes and all(as_priced[i + 1] > 0 for i in plain_probes if i + 1 < len(as_priced))


def test_where_drafting_wins_by_far_no_plain_step_is_probed():
    """A 1 ms drafter call: drafting is forecast far above `PLAIN_PROBE_MAX_GAIN` times plain
    decoding, where no misprice of a plain step could turn the choice; its probes stay drafting."""
    ceilings = timed_steps(forecast_gate(), draft_ms=1.0, plain_over_predicted=0.7, steps=80)
    assert all(ceilings)


@pytest.mark.parametrize("cruise", [False, True])
def test_a_gate_turned_plain_by_its_tokens_tries_drafting_again_as_they_fade(cruise):
    """Drafted steps made 70% of their forecast and the gate decodes plainly; its probes teach
    no tokens ratio (they draft a few requests of a batch), so the plain steps age it: once it
    has faded the gate drafts again, and now that drafted steps make their forecast it stays.
    The plain steps a plain streak cruises through unasked age it as the others do (else a
    plain streak of cruises faded it eight times slower)."""
    gate = forecast_gate()
    assert not any(drafted_steps(gate, 0.7, 60, cruise)[-20:])
    again = drafted_steps(gate, 1.0, 400, cruise)
    assert sum(again[-100:]) >= 90


def test_a_drafted_step_whose_trees_a_requests_end_cut_teaches_no_tokens_ratio():
    """The gate forecast whole trees; a step whose request could keep only its last tokens makes
    few whatever the drafter: its tokens teach nothing (the same step uncut does)."""
    tree = TreeBatch.from_trees([build_chain(np.arange(1, 9, dtype=np.int64), 7, np.full(8, -0.01))])
    ratios = []
    for cut in (None, np.array([True])):
        policy = AdaptiveBudget(flat_cost(verify_ms=2.0, draft_ms=1.0), learning_steps=0)
        policy.gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
        ceiling = policy.plan([8])
        assert ceiling > 0
        policy.record_draft_ms(1.0)
        allocation = policy.choose(tree, [8], None, cut)
        policy.record_verify_ms(2.0)
        policy.observe(tree.prefix(allocation.num_nodes), [[]])  # nothing accepted
        policy.record_step_ms(3.0)
        ratios.append(policy.gate.token_residual.ratio(1, ceiling))
    assert ratios[0] < 1.0 and ratios[1] == 1.0
