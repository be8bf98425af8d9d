"""How wide a step builds its trees, decided before drafting from recent acceptance.

The ceiling is paid before the allocator sees a tree: the drafter's top-K and the host build
both scale with it (`build_cost.py`). The gate predicts each candidate ceiling's rate from the
recent acceptance curve as if every running request had that curve, with the drafter's call,
that ceiling's build and the verify forward as the step's cost; ceiling 0 is a plain decode step
(no drafter call, root-only trees). The best one wins (among drafting ceilings, the widest within a
few percent of it where width is nearly free: `NEAR_BEST_RATE`). The first step, with no curve yet, takes
the widest ceiling that costs at most a few plain steps. Each candidate's predicted rate is
divided by the measured-over-predicted step time of its ceiling (`step_residual.py`), so what
the models leave out is judged by what steps took, and multiplied by the tokens its steps made
over the tokens it forecast (`token_residual`): pricing every request by the batch's mean curve
forecast the drafted steps on the CI CPU at batch 4-8 4-7% above what they made (the requests'
own trees, which the steps verify, were forecast within 2%), enough to hold drafting where plain
decoding won by 7-15%. After a few steps at one choice (2 at a new batch bucket, doubling to
`probe_interval` after each probe), one step builds in turn wider (twice the choice: the curve
past the chosen width stays current and the engine can widen again when acceptance or load
changes), narrower (the next candidate below: its measured ratio stays current) and, where
drafting is predicted to win by little, not at all (a plain step: its measured ratio stays
current, `PLAIN_PROBE_MAX_GAIN`; a streak at its cap, with no wider ceiling, probes each
direction that applies one interval in three: `PROBE_TURNS`); after plain steps the probe drafts
at the best drafting ceiling (a probe at the cap could cost more than the plain steps before it
saved), and while probes keep finding drafting a loss they come at doubling intervals: each one
also pays the drafter's catch-up on all the context it skipped (on a CPU at batch 64, ten plain
steps'; at batch 8, three). They back off near the boundary too: there a plain step is about as
good as a drafted one, so the most a late probe loses is that margin, while each probe costs a
few plain steps for sure. The interval is kept per batch bucket: a load where drafting wins (the
last few requests of a batch, finishing) says nothing of one where it loses. On the CPU at batch
8 (drafting predicted at 0.8-1.0x plain decoding, measured at 0.72x) the back-off was reset by
every decision near the boundary and by each run's tail, so every 31-step run paid a probe
(7-8%).

The curve is an EMA, per best-first position, of the drafted trees' drafter probabilities
averaged over their requests (a step's trees are learned during the next step's verify, a
probe's before the next decision), calibrated when the gate decides, with the calibrator as it is then.
An EMA of calibrated values kept the calibration each step had when it was learned: the bundled
drafter's first trees, priced at half what it accepts, held the gate on plain steps at batch 1
through whole runs where drafting wins by a fifth, since only the rare probes refreshed the
curve. A mean's calibration is not the calibrations' mean (the map is concave: 10-15% high over
recorded traces), so the gate also keeps, per position, an EMA of the ratio of the two as each
step measured it (`spread`), and multiplies it in.
"""

import bisect
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ddtree_serve.engine.budget.allocator import StepCost, TokenLayout, ceiling_rates, plain_decode_rate
from ddtree_serve.engine.budget.build_cost import BuildCost
from ddtree_serve.engine.budget.marginal_gain import MarginalGain
from ddtree_serve.engine.budget.measure import powers_of_two_upto
from ddtree_serve.engine.budget.step_overhead import StepOverhead
from ddtree_serve.engine.budget.step_residual import StepResidual, batch_bucket

Calibration = Callable[[np.ndarray], np.ndarray]
"""Drafter probabilities to acceptance probabilities, elementwise (the policy's calibrator)."""

FIRST_STEP_PLAIN_STEPS = 4.0
"""What the first drafted step may cost, in plain decode steps, before anything is known."""

RECHECK_SHIFT = 0.05
"""A streak decides again once a plain step's or the drafter's predicted price moved this much (a
share), and the step after a probe of the choice's neighbours once the probe moved its ceiling's
step-time ratio this much."""

DRAFTED_RECHECK_STEPS = 16
"""A drafting streak over the same batch decides again after this many steps at least
(`recheck_steps`). A price that moves (`RECHECK_SHIFT`) and the probes of the neighbouring
ceilings still decide sooner; the recheck only bounds how long a streak trusts a still curve.
Rechecking every 8 steps (32 requests) had a third of the adaptive steps at c = 4 on the virtual
H100 (`bench/virtual_device.py`) decide or weigh, each 0.3-0.7 ms over a fixed budget's step;
at 16 (64 requests) c = 1-16 rose from 0.91-0.95 of the best fixed budget to 0.92-0.96 there."""

TAIL_STEPS = 4
"""A drafting cruise whose steps are spent keeps cruising while every running request ends
within this many of its steps (`DraftGate.ends_within_tail`): a decision there chooses for a
few steps at most, and each costs a tenth of a step or more. A closed wave's recheck falls on
its tail: on the virtual H200 (`bench/virtual_device.py`) at c = 8 a 64-token run takes 20
steps, its cruise armed at the second step ran out at the 16th, at batch 3, and the four steps
left each planned (`pdccccccccccccccdddd`: a decision at batch 3, a settled step whose lesson
armed no cruise, a due probe at batch 1 that decided, a settled step), 0.4-0.7 ms over a
cruising step's 3.4, to verify the same ceiling 32 to the end. A/B'd in one process against
`tail_steps=0` on the virtual H100 and H200 (closed, 64 tokens, `bench/results/budget_sweep_h200.md`,
forty-second session): c = 16 gained 0.01-0.04 of the best fixed budget in every pairing and a
held c = 8 0.015; c = 4 and a closed c = 8 moved within two copies' spread, where a copy that
settles on ceiling 16 at batch 8 reads 0.02-0.03 under one on 32 either way. At 8 steps the
tail was most of a 32-token run at c = 1 on the CI CPU (3 tokens a step), where a decision
costs a fifteenth of a step."""

RECHECK_REQUESTS = 64
"""... and after its steps held this many requests between them: at batch 1 a step teaches one
request's tree, so eight of them move the curve little, while the decision costs what it costs
at any batch (on the fake device's replay of the H200's costs at c = 1, 0.4-0.5 ms over a
cruising step's 2.3). There, rechecking every 32 steps at batch 1 and 16 at batch 2 (8 from
batch 4, as then) took c = 1 from 0.91-0.93 of the best fixed budget to 0.95-0.98 over five
rounds; doubling the interval after each unchanged decision at every batch (the fifteenth
session) had held an early choice at c = 8 on the H200."""

FIRST_PROBE_INTERVAL = 2
"""Drafted steps at a new batch bucket before the first probe of the choice's neighbours."""

PROBE_SHARE = 0.05
"""Probes after plain steps may take at most this share of a plain streak's time: a probe that
cost k plain steps more than a plain one keeps the next at least k / PROBE_SHARE plain steps
away at its batch bucket (within the 16x cap). On the CI CPU at c = 16 a probe's four requests
caught up on their prompts and every skipped step through the drafter, ~60 ms against 13 ms
plain steps: at the doubling intervals (16, 32, 64) a plain sweep paid 8-15% for probes."""

PLAIN_PROBE_MAX_GAIN = 1.25
"""A drafting streak's probes also take a plain step, in turn with the wider and the narrower
ones, while the best drafting ceiling's predicted rate is at most this many times a plain step's:
the plain step's own price is then what the choice hangs on, and a drafting streak never measures
it. On the CI CPU at batch 4 the first decision priced a plain step from the start-up cost grid
and the drift the drafted verifies had taught it, 9.7 ms where plain steps took 8.1, and the
gate drafted at ceiling 8 through whole runs where plain decoding made 1.16x its tokens/s. Where
drafting wins by more, no misprice of the plain step would turn the choice, and none is taken."""

WIDER_PROBE_MAX_COST = 1.5
"""A probe twice as wide as the choice is made only when its step is predicted (with its
measured ratio) at most this many times the choice's; else the probe goes narrower. On the H200
at c = 64 a wider probe of ceiling 32 built 64-node trees for 64 requests, 25 ms against a 10 ms
step: each such probe cost one and a half steps, a few percent of the run's rate for a width
that cannot win there (it would need 2.5x the tokens a step)."""


NEAR_BEST_RATE = 0.05
"""The drafting choice is the widest ceiling predicted within this share of the best rate whose step
is measured at most `NEAR_BEST_MS` dearer (`SMALL_BATCH_NEAR_BEST_MS` at batch 1-2). A wider tree's
prefixes are the narrower trees, so its steps teach every narrower ceiling's tokens on the same
text; a narrower choice sees past itself only at its wider probes, one step in 32, and prices them
below their worth:
- at batch 1 the nodes past 32 gain a token in a few steps of many, so the probes mostly see
  none (an H100 closed sweep at c = 1 forecast them 0.15 tokens a step where fixed-64 made 0.54
  over fixed-32);
- a probe is a step that decides, weighs and teaches its nodes, so its ceiling's measured
  step-time ratio came out at 1.11 against the cruising choice's 1.07.
So where width is nearly free the argmax held whole levels at 32: on an H100, 7 of 30 closed
level runs at c = 1-4 made exactly fixed-32's tokens (0.85-0.91 of fixed-64, the best there; a
diagnosed one priced 64 3.5% under 32 in its last decision), and so did the H200's continuous
c = 1 (0.89 twice). Taking the widest near the best, 2 of 12 did, and closed c = 1 rose from 0.90
to 0.93 (four paired sweeps; c = 2-4 and continuous c = 1-4 even: `budget_sweep_h200.md`)."""

NEAR_BEST_MS = 0.05
"""... a share of the best candidate's measured step time (`NEAR_BEST_RATE`; at batch 1-2
`SMALL_BATCH_NEAR_BEST_MS`): on the H100 the probed 64 measured 3-8% over 32 at batch 1-2
(fixed-64's steps: 4-6%). At batch 5-8 it is 7-12% over 32 on the H100 and the H200, and with
256-token requests its steps made 2-3% more tokens: at 0.10 the band took 64 where 32 made 4-10%
more tokens a millisecond, for whole runs. At 0.05, paired in one process on an H200, closed c = 8
rose from 0.78 to 0.95 of fixed-32 at 256 tokens and from 0.91 to 0.95 at 64, and c = 1-4 held
within 0.01 (0.974, 0.966, 0.973 against 0.984, 0.965, 0.977; `budget_sweep_h200.md`, thirty-eighth
session). Where width is dear (the CI CPU, where 64's step is 1.2x 32's at batch 1, and 32's 1.16x
8's) the narrower choice stands: there a wider step's extra time is what the rates compare.

Only a ceiling whose own steps at the batch bucket taught its step-time ratio is measured so. One
never taken reads the nearest taken ceiling's ratio: its step is then the models' relative
price, and on the CI CPU the models underprice width (64's step predicted a few percent over
32's at batch 1). Priced so, the band took 64 for 93% of one c = 1 level where fixed-8 wins, and
c = 1 made 0.81-0.96 of the best in six paired sweeps where the gate without the band made
0.96-1.03. The wider probes measure a ceiling before the band may take it: on the H100 the
probed 64 is what the band is for."""


SMALL_BATCH = 2
"""Batches of at most this many requests weigh the band's step time by
`SMALL_BATCH_NEAR_BEST_MS`, not `NEAR_BEST_MS`."""

SMALL_BATCH_NEAR_BEST_MS = 0.10
"""`NEAR_BEST_MS` at batches of at most `SMALL_BATCH` requests. There a closed run's rate is its
steps' (one or two requests leave no long tail for a wider tree's slowest request to stretch, the
cost `NEAR_BEST_MS` guards against at batch 5-8), and on the GPUs 64's step is 3-8% over 32's
for 6-8% more tokens (fixed-64 the best fixed budget at c = 1-2 on the H100 and the H200), so at
5% the band left 64 out by a hair: on the virtual H200 (`bench/virtual_device.py`, with its
verify graphs) the gate priced 64's step 5.1% over 32's and cruised at 32 for 134 of 141 steps
at c = 1. Paired in one process against 0.05 at every batch (`bench/step_kinds.py --variant
near_best_ms=0.10`, 128 tokens, closed): on an H200 c = 2 rose from 0.917 to 0.959 of the best
fixed budget and c = 1 read 0.944 against 0.956 (forty-seventh session); on the virtual H200 c = 1
from 0.919 to 0.954 and c = 2 from 0.917 to 0.957, with c = 4-8 within 0.007; on the CI CPU,
where width is dear, c = 1-4 moved within their rounds' spread (forty-eighth session,
`budget_sweep_h200.md`); the thirty-eighth session's H200 A/B read c = 1 0.984 at 0.10 against
0.974 at 0.05."""

NEAR_TIE_RATE = 0.0
"""With `DraftGate(near_tie_rate=r)`, among drafting ceilings within that share of the best
predicted rate the widest its own steps measured is the choice, whatever its step costs: a tie,
decided by the wider trees' fewer steps a request. On the virtual H100
(`bench/virtual_device.py`) at closed c = 8 the gate's last decisions at batch 5-8 priced
ceilings 16 and 32 0.3% apart (7864 and 7890 tok/s), 32's step 7% dearer, outside
`NEAR_BEST_MS`; the argmax took either on noise, and runs on 16 made 6236-6537 tok/s where runs
on 32 made 6863-6959 (a closed run lasts as long as its slowest request). Off by default: at
0.01, A/B'd in one process against 0 beside a second copy (8 rounds, closed, 64 tokens;
`bench/results/budget_sweep_h200.md`, forty-second session), the virtual H100's c = 8 rose from
0.915 to 0.934-0.942 (ceiling 32 at batch 8 in 73-89 of ~125 steps against 27) while the virtual
H200's fell from 0.945 to 0.909-0.912 (one copy kept 16, whose rate was more than 1% under), and
c = 1, 2, 4, 16 moved within 0.025 either way."""


CURVE_TREES = 8
"""Trees a drafted step's lesson must hold to move the gate's curve by its full `curve_weight`
(`DraftGate.record_curve`); the tokens ratios keep `CURVE_TREES // b` windows of samples at
the batch buckets b below it (`StepResidual.window_trees`). A step at batch 1 teaches one request's
tree, whose acceptance swings with the text (1 to 9 tokens a step), so weighed as a step of
eight trees the forecast it made swung as much: on the CI CPU at c = 1-2 (128-token runs) the
gate's forecast tokens at ceiling 8 varied by 26-33% (coefficient of variation) from decision
to decision, and one low enough turned the gate to plain steps that drafting beat by 1.3-1.9x,
where it stayed until its probes, each one tree, drew a better one (43% of one sweep's c = 2
steps; 0.73 of fixed-8's tokens/s). Weighed by their trees, 15-18%. In four A/B processes
(`bench/step_kinds.py --variant curve_trees=...`, 10 rounds a level, caps 8 and 64) seven
gates at 8 took 0-11 plain steps over c = 1-2, where seven of eight at 1 took 60-267 of their
~660 steps there (the eighth 12); c = 2's paired medians read 0.93-0.98 of fixed-8 (median
0.973) against 0.93-0.96 (0.950), c = 1's were even (0.968 and 0.969), and so was the virtual
H200 (`bench/virtual_device.py`, c = 1-8)."""


PROBE_TURNS = ("wider", "narrower", "plain")
"""The directions a drafting streak's probes take in turn (`DraftGate._probe_ceiling`); one that
does not apply passes its turn to the next. A streak at its cap has no wider probe, and there its
probes come one per direction that applies in `len(PROBE_TURNS)` intervals (`DraftGate.ceiling`): the
wider probe is a streak's only news of the curve past its width, while a narrower ceiling's
tokens are taught by the choice's own prefixes at every step and only its step-time ratio needs
a probe. At c = 1-2 on an H100, where 64 is the cap and the choice, every probe was a narrower
one, one in 16 steps, each 0.8 ms over a cruising step's 2.9 with 0.5 fewer tokens. Spacing
every streak's probes so took closed c = 1 from 0.95 to 0.98 of the best fixed budget and
continuous c = 1 from 0.94 to 0.97 (four paired sweeps each) but lost 0.01-0.04 at c = 8-64, where
the wider probes find the width; spaced at the cap only, one call gave closed c = 1-4 even and
continuous c = 1-2 0.93-0.94 -> 0.96 (`bench/results/budget_sweep_h200.md`, thirty-sixth
session)."""


DRAIN_POWER = 0.0
"""While a batch drains (no request waits or arrived lately: `SpecEngine`), the gate's choice may
weigh each request's trees by its expected steps to finish, over the batch's longest, to this
power (`drain_weights`; 0, the default: every request alike). A drained batch ends with its
slowest request, and the requests a draft serves worst gain most from width: a confident
request's best-first tree reaches the block's full depth within 16 nodes, while a flat draft's
nodes past 16 are siblings near its root that verification still accepts. On an H100 (bf16,
closed, 256 tokens, c = 16) fixed-16 made 103 tokens a step at batch 16 in 4.72 ms and fixed-32
111.5 in 5.31 (16 the better rate there, and the gate's choice), but the slowest request then
took 79 steps against 56, and fixed-32's run was 1.21x fixed-16's tokens/s; the adaptive run, on
16, made 0.78 of fixed-32's. Weighed so, the drafting ceilings are ranked by the rate of the
requests the run waits for; whether to draft at all stays the batch's rate against a plain
step's (a slow request's trees gain little over a plain step, and an earlier pacing by the
slowest row alone took plain steps in a quarter of a c = 64 round:
`bench/results/adaptive_budget_history.md`). With requests waiting, every request's tokens count
alike and the weights are off.
Off by default: not yet measured on a GPU, where alone the slowest requests gain so from width
(on this CPU, fp32 or bf16, the slowest prompt took as many steps at 16 as at 32), and on the
fake device (`bench/fake_device.py --stand-in measured --hit-spread 0.5 --variant
drain_power=4`, closed c = 4-32, 256 tokens) powers 1 and 4 read under the default at 6 of 8
cells, 4 taking 64 at batch 16 where 32 wins; three pacings of a closed batch by its slowest
request lost on an H100 before (the history file, twenty-seventh and twenty-eighth sessions).
A/B it in one process: `bench/step_kinds.py --variant drain_power=4`."""


class DraftGate:
    """The step's tree ceiling; `ceiling` is called once per step, `record_curve` with each
    drafted step's lesson (the policy's `learn`), `record_step_ms` after each step."""

    def __init__(
        self,
        probe_interval: int = 16,
        curve_weight: float = 0.3,
        probe_share: float = PROBE_SHARE,
        near_best_ms: float = NEAR_BEST_MS,
        small_batch_near_best_ms: float = SMALL_BATCH_NEAR_BEST_MS,
        near_tie_rate: float = NEAR_TIE_RATE,
        tail_steps: int = TAIL_STEPS,
        recheck_steps: int = DRAFTED_RECHECK_STEPS,
        curve_trees: int = CURVE_TREES,
        drain_power: float = DRAIN_POWER,
    ) -> None:
        """`probe_share`: see `PROBE_SHARE` (0: probes back off by doubling alone).
        `near_best_ms`: see `NEAR_BEST_MS` (0: a wider ceiling than the best only at no more
        measured step time, at batches above `SMALL_BATCH`); a setting so a benchmark can A/B it
        on one device.
        `small_batch_near_best_ms`: the same at batches of at most `SMALL_BATCH` requests
        (`SMALL_BATCH_NEAR_BEST_MS`).
        `near_tie_rate`: see `NEAR_TIE_RATE` (0: ties go to the best rate alone); a setting so a
        benchmark can A/B it.
        `tail_steps`: see `TAIL_STEPS` (0: a cruise ends when its steps are spent, always).
        `recheck_steps`: see `DRAFTED_RECHECK_STEPS`; a setting so a benchmark can A/B it.
        `curve_trees`: see `CURVE_TREES` (1: every lesson moves the curve by `curve_weight`, and
        every bucket's tokens ratios keep one window); a setting so a benchmark can A/B it.
        `drain_power`: see `DRAIN_POWER` (0: a draining batch's requests weigh alike); a setting
        so a benchmark can A/B it."""
        if (
            probe_interval < 1
            or not 0.0 < curve_weight <= 1.0
            or probe_share < 0.0
            or near_best_ms < 0.0
            or small_batch_near_best_ms < 0.0
            or not 0.0 <= near_tie_rate < 1.0
            or tail_steps < 0
            or recheck_steps < 1
            or curve_trees < 1
            or drain_power < 0.0
        ):
            raise ValueError(
                "need probe_interval >= 1, curve_weight in (0, 1], probe_share >= 0, near_best_ms >= 0,"
                " small_batch_near_best_ms >= 0,"
                " near_tie_rate in [0, 1), tail_steps >= 0, recheck_steps >= 1, curve_trees >= 1"
                " and drain_power >= 0"
            )
        self.probe_interval = probe_interval
        self.curve_weight = curve_weight
        self.probe_share = probe_share
        self.near_best_ms = near_best_ms
        self.small_batch_near_best_ms = small_batch_near_best_ms
        self.near_tie_rate = near_tie_rate
        self.tail_steps = tail_steps
        self.recheck_steps = recheck_steps
        self.curve_trees = curve_trees
        self.drain_power = drain_power
        self.curve: np.ndarray | None = None  # [positions] recent drafter probabilities
        # [positions] recent mean of calibrated over calibrated mean (1 where `record_curve` is
        # given no calibration: its probabilities are acceptance already)
        self.spread = np.ones(0)
        # The same over each step's requests weighed by `drain_weights` where the step had them
        # (alike where it had none): what a draining batch's choice reads (`DRAIN_POWER`); empty
        # while no lesson could be read so (`drain_power` 0 and no weights given).
        self.drain_curve = np.zeros(0)
        self.drain_spread = np.ones(0)
        self.steps_since_probe = 0  # steps since the last probe (each took the best choice)
        # Plain steps before the next probe, per batch bucket (`probe_interval` where none is
        # kept): doubled after each probe that found drafting still a loss at that bucket (a
        # probe pays the drafter's catch-up on every context it skipped), up to 16x.
        self.plain_probe_intervals: dict[int, int] = {}
        # Per batch bucket, the last probe's extra wall time in plain steps (`PROBE_SHARE`).
        self.probe_costs: dict[int, float] = {}
        # Drafted steps before the next probe of the neighbouring ceilings: from
        # `FIRST_PROBE_INTERVAL` when the batch moves to a bucket not drafted at before (a new
        # load, whose step-time ratios are its own), doubled after each probe, up to
        # `probe_interval` (a new load is learned in a few steps, a settled one pays for a probe
        # rarely; the choice flipping between neighbours on noise does not start the learning
        # over). Each bucket keeps its interval when the batch leaves it: a load seen before
        # resumes where it was. On the H200 the sweep's runs pass through every bucket again and
        # again (a run's start and its tail), and at c = 8 half the adaptive steps ran at the
        # neighbours of the best ceiling, each return to a bucket probing from 2 steps again.
        self.drafted_probe_interval = min(FIRST_PROBE_INTERVAL, probe_interval)
        self._drafted_probe_intervals: dict[int, int] = {}  # per batch bucket, once it probed
        self._probe_bucket: int | None = None  # the batch bucket the interval was set for
        self.probing = False  # the last ceiling is a probe after plain steps
        # The last decision found the best drafting rate above `PLAIN_PROBE_MAX_GAIN` times a
        # plain step's: no plain probe among its options (False until a decision had a curve).
        self.plain_far = False
        # The last ceiling is a probe of a neighbour of the drafting choice (wider or narrower):
        # its trees are what keeps the curve past the chosen width current.
        self.probing_neighbour = False
        # The last ceiling kept the drafting streak under way (decided at an earlier step), at
        # the batch size it was decided for (its step teaches the ceiling's ratio).
        self.held = False
        # The last ceiling kept the drafting streak's choice, at any batch size in its bucket
        # (requests finishing one by one): its trees may take the streak's width unweighed.
        self.kept = False
        # (batch bucket, cap) of the streak under way (None: decide the next step), its choice,
        # its steps since decided, and the predicted ms of its step (read by a drafting streak; a
        # plain one prices its step anew each time): see `ceiling`.
        self._streak: tuple[int, int] | None = None
        self._streak_choice = 0
        self._streak_age = 0
        self._streak_ms = 0.0
        self._streak_batch = 0  # the batch size the streak was decided at
        self._streak_prices = (0.0, 0.0)  # plain step and drafter call, predicted when decided
        self._streak_turns = 1  # the probe directions that apply to a drafting streak's choice
        self.residual = StepResidual()
        # Per (batch bucket, ceiling): tokens a drafted step made over the tokens it forecast.
        self.token_residual = StepResidual(mean=True, window_trees=curve_trees)
        # Per batch bucket, the ceiling whose own steps taught its tokens ratio last: the ratio
        # of a wider one is read from it (`_drafted_ceilings`).
        self._tokens_ceiling: dict[int, int] = {}
        # Per (batch bucket, ceiling): tokens its nodes past the next narrower ceiling's made over
        # their forecast, from the taken steps' prefixes: a wider ceiling's further nodes are
        # priced by it (`_drafted_ceilings`).
        self.marginal = MarginalGain()
        self._probe_turn = 0  # the next drafting probe's direction: an index into `PROBE_TURNS`
        # (batch size, ceiling, predicted step ms, forecast tokens) of the step the last
        # `ceiling` decided, for `record_step_ms`; None when that step teaches no ratio (the
        # first step, a probe after plain steps, a drafting streak's step at another batch than
        # it was decided for).
        self._decided: tuple[int, int, float, float] | None = None
        # The forecast tokens of the ceilings below the decided one, at its decision: what its
        # step's trees, cut to each, would have made teaches their tokens ratios too.
        self._narrower_forecasts: dict[int, float] = {}
        self._streak_tokens = 0.0  # the streak's forecast tokens a step (a drafting one's)
        self._streak_narrower: dict[int, float] = {}  # those below the streak's choice, at its decision

    def ceiling(
        self,
        caps: Sequence[int],
        cost: StepCost,
        build: BuildCost,
        layout: TokenLayout,
        overhead: StepOverhead | None = None,
        learning: bool = False,
        calibrate: Calibration | None = None,
        weights: np.ndarray | None = None,
    ) -> int:
        """Draft nodes per tree this step may build (0: decode plainly); counts toward a probe.

        `overhead`: each kind of step's host work besides its priced parts (default: none).
        `learning`: the acceptance forecast rests on too few verified steps to judge drafting
        by (the policy's calibrator has learned few): draft at the best drafting ceiling, and
        hold no streak, so each such step decides with what the last one taught.
        Each candidate's predicted rate is divided by its measured step-time ratio and
        multiplied by its made-over-forecast tokens ratio (`step_residual.py`); `record_step_ms`
        teaches both from the step this chose.
        `calibrate`: the acceptance of drafter probabilities (None: the curve is acceptance).
        `weights`: a draining batch's (`drain_weights`; None: none drains): the drafting
        ceilings are ranked by their rates over `drain_curve`; whether to draft at all, and the
        predictions the step's ratios are learned against, stay the batch's own curve's."""
        overhead = overhead or StepOverhead()
        self._decided = None
        self._narrower_forecasts = {}
        self.held = self.kept = False
        cap = max(caps)
        if cap <= 0:
            return 0
        batch_size = len(caps)
        plain_ms, draft_ms = _prices(batch_size, cost, overhead)
        # Requests finishing one by one keep a streak, and so do caps shrinking within their
        # power of two (the engine caps each request at the draft tokens it can still keep); a
        # drafting streak also keeps through the buckets below its own (`_in_streak`). A
        # drafting streak's prices are read at the batch it was decided at: they move when the
        # cost curve learns, not when requests finish (its age bounds it). A plain streak's are
        # read at the batch now: a plain step's price falling as the batch drains is what turns
        # it back to drafting before its probe, which after failed probes may be 16 intervals
        # away.
        streak = (batch_bucket(batch_size), batch_bucket(cap))
        holds = False
        if self._in_streak(streak):
            at_batch = batch_size == self._streak_batch or self._streak_choice == 0
            holds = self._streak_holds(
                *((plain_ms, draft_ms) if at_batch else _prices(self._streak_batch, cost, overhead))
            )
        if holds:
            # A streak over the same batch keeps its choice until its probe is due, and decides
            # again when a plain step's price moved (without a draft the curve stands still),
            # or, drafting, when the drafter's did or the streak is `recheck_steps` old: on a
            # fast target the decision costs a tenth of a step, one step's curve moves it little.
            self.steps_since_probe += 1
            self._streak_age += 1
            self.probing = self.probing_neighbour = False
            choice = min(self._streak_choice, cap)
            self.kept = choice > 0 and choice == self._streak_choice
            if choice == 0:
                # Its price is read again every step.
                self._decided = (batch_size, 0, plain_ms, float(batch_size))
            elif batch_size == self._streak_batch and choice == self._streak_choice:
                # A drafting streak's prediction was made for the batch and cap it was decided
                # at: a smaller batch, or trees cut by a smaller cap, would teach a biased ratio.
                self._decided = (batch_size, choice, self._streak_ms, self._streak_tokens)
                self._narrower_forecasts = self._streak_narrower
                self.held = True
            return choice
        plain_close = False  # whether a plain step is near enough to probe (`PLAIN_PROBE_MAX_GAIN`)
        if self.curve is None:
            best = drafted = self._first_ceiling(caps, cost, build, overhead)
            predicted_ms: dict[int, float] = {}
            predicted_tokens: dict[int, float] = {}
        else:
            acceptance = self.curve if calibrate is None else calibrate(self.curve) * self.spread
            candidates, rates, step_ms, tokens, measured_ms = self._drafted_ceilings(
                acceptance, caps, cost, build, layout, overhead
            )
            # Which drafting ceiling: in a draining batch, the rate of the requests it waits for
            # (`DRAIN_POWER`); whether to draft at all stays the batch's rate against a plain step's.
            choice_rates = rates
            if weights is not None and len(self.drain_curve):
                drain = self.drain_curve
                if calibrate is not None:
                    drain = calibrate(drain) * self.drain_spread
                choice_rates = self._drafted_ceilings(drain, caps, cost, build, layout, overhead)[1]
            predicted_ms = dict(zip(candidates, step_ms.tolist(), strict=True))
            predicted_tokens = dict(zip(candidates, tokens.tolist(), strict=True))
            plain_rate = plain_decode_rate(batch_size, cost, overhead.plain_ms) / self.residual.ratio(
                batch_size, 0
            )
            # Drafting is judged by its best rate; the choice is the widest near it that still
            # beats a plain step.
            drafted_rate = float(np.max(rates))
            own_steps = np.array([self.residual.measured(batch_size, c) for c in candidates])
            near = _widest_near_best(
                choice_rates,
                measured_ms,
                own_steps,
                plain_rate,
                self._near_best_ms(batch_size),
                self.near_tie_rate,
            )
            drafted = candidates[near]
            best = drafted if drafted_rate > plain_rate or learning else 0
            plain_close = drafted_rate <= PLAIN_PROBE_MAX_GAIN * plain_rate
        self.plain_far = self.curve is not None and not plain_close
        predicted_ms[0], predicted_tokens[0] = plain_ms, float(batch_size)
        if streak[0] != self._probe_bucket:  # another load: its neighbours at its own interval
            first = min(FIRST_PROBE_INTERVAL, self.probe_interval)
            self.drafted_probe_interval = self._drafted_probe_intervals.get(streak[0], first)
            self.steps_since_probe = 0
        self._probe_bucket = streak[0]
        chosen = best
        plain_interval = self.plain_probe_interval(batch_size)
        options = self._probe_options(best, cap, batch_size, predicted_ms, plain_close and not learning)
        # The probe turns the streak takes: all of them below the cap (the wider probe is its
        # only news of the curve past its width), else only the directions that apply
        # (`PROBE_TURNS`).
        turns = len(PROBE_TURNS) if best < cap else len(options)
        interval = plain_interval if best == 0 else self._drafted_interval(turns)
        probe_due = self.steps_since_probe >= interval
        if probe_due:
            chosen = drafted if best == 0 else self._probe_ceiling(best, options)
            if best > 0:
                self.drafted_probe_interval = min(2 * self.drafted_probe_interval, self.probe_interval)
                self._drafted_probe_intervals[streak[0]] = self.drafted_probe_interval
        self.probing = best == 0 and chosen > 0
        self.probing_neighbour = best > 0 and chosen != best
        if best > 0:
            self.plain_probe_intervals.pop(streak[0], None)
        elif chosen > 0:
            self.plain_probe_intervals[streak[0]] = min(2 * plain_interval, self._longest_plain_interval)
        # A due probe restarts the count even when it could take no other ceiling (a cap of 1).
        self.steps_since_probe = 0 if probe_due else self.steps_since_probe + 1
        if not self.probing and not learning and chosen in predicted_ms:
            # A probe after plain steps drafts a few requests only, catching up, and a learning
            # step verifies its trees whole, wider than priced: neither teaches a ratio.
            self._decided = (batch_size, chosen, predicted_ms[chosen], predicted_tokens[chosen])
            self._narrower_forecasts = _below(predicted_tokens, chosen)
        # A probe after plain steps, or the first step, is its own decision; the best choice
        # starts a streak, and so does a probe of its neighbours, which the next step resumes
        # without deciding unless the probe's step moved its ceiling's price (`record_step_ms`):
        # a decision there would not know the probe's trees yet (learned during the next step's
        # work), and in the fake-device sweep at c = 64 the steps after probes were a tenth of
        # all, each deciding for a few tenths of a millisecond on the H200's host.
        resumes = (not probe_due or self.probing_neighbour) and not learning
        self._streak = streak if resumes and self._decided is not None else None
        choice = best if self.probing_neighbour else chosen
        self._streak_choice, self._streak_age, self._streak_batch = choice, 0, batch_size
        self._streak_ms = predicted_ms.get(choice, 0.0)
        self._streak_tokens = predicted_tokens.get(choice, 0.0)
        self._streak_narrower = _below(predicted_tokens, choice)
        self._streak_prices = (plain_ms, draft_ms)
        self._streak_turns = turns
        return chosen

    def _near_best_ms(self, batch_size: int) -> float:
        """The band's step-time tolerance at this batch size (`SMALL_BATCH_NEAR_BEST_MS`)."""
        return self.small_batch_near_best_ms if batch_size <= SMALL_BATCH else self.near_best_ms

    def _in_streak(self, buckets: tuple[int, int]) -> bool:
        """Whether a step at these (batch, widest cap) buckets belongs to the streak under way:
        its own buckets, or for a drafting streak the ones below them its batch drained into
        (requests finishing, and the ones left near their ends). A closed batch's tail passes
        through a bucket in a few steps, and deciding in each (on the
        virtual H100 at c = 16, `32N 16 32 32` as the batch fell through buckets 8, 4 and 2,
        each 0.3-0.5 ms over a cruising step) cost more than the wider trees it found for the
        requests left: held, c = 16 rose from 0.940 to 0.965 of the best fixed budget there
        (means of six paired sweeps; c = 2-8 within their noise). The streak decides again at
        its recheck or its probe, at the batch then, as a drafting cruise does when its batch
        drains."""
        streak = self._streak
        if streak is None:
            return False
        if buckets == streak:
            return True
        return self._streak_choice > 0 and buckets[0] <= streak[0] and buckets[1] <= streak[1]

    def steps_held_ahead(self) -> int:
        """Steps after this one that keep the drafting streak's choice without deciding, as
        long as its prices stand still (the cost curve learns nothing meanwhile) and the batch
        stays in its bucket or drains below it: until its recheck or its probe is due (0 unless
        this step kept a drafting choice)."""
        if not self.kept or self._streak is None:
            return 0
        return max(
            0,
            min(
                self._drafted_interval(self._streak_turns) - self.steps_since_probe,
                self._streak_recheck - self._streak_age,
            ),
        )

    def ends_within_tail(self, longest_left: int) -> bool:
        """Whether a drafting streak's requests all end within `tail_steps` of its steps: the
        longest may emit at most `longest_left` more tokens, and a request makes a step what the
        streak's forecast at its decision gave each (`TAIL_STEPS`). Requests that stop early
        only end sooner."""
        if self._streak_choice <= 0 or self._streak_batch <= 0 or self._streak_tokens <= 0.0:
            return False
        return longest_left <= self.tail_steps * self._streak_tokens / self._streak_batch

    def end_wave(self) -> None:
        """A drafting cruise held to its requests' ends (`ends_within_tail`) is over: the next
        step decides anew and counts its probe interval from there, as at a new load. Kept, the
        streak would meet the next wave's first step with its recheck and its probe both due,
        and probe there, where the newcomers' catch-up teaches no step time."""
        self._streak = None
        self.steps_since_probe = 0

    def plain_steps_held_ahead(self, cost: StepCost, overhead: StepOverhead) -> int:
        """Plain steps after this one that keep the plain streak without asking, as long as the
        batch does not change and the cost curve learns nothing meanwhile: until its probe is
        due (0 unless this step took a plain streak's choice, decided or held, or when the plain
        step's price at its batch has moved since it was decided: `RECHECK_SHIFT`)."""
        if self._streak is None or self._streak_choice != 0 or self.probing or self.probing_neighbour:
            return 0
        if not self._streak_holds(*_prices(self._streak_batch, cost, overhead)):
            return 0
        return max(0, self.plain_probe_interval(self._streak_batch) - self.steps_since_probe)

    def record_cruise_tokens(
        self, batch_size: int, tokens: int, tokens_within: Mapping[int, int] | None = None
    ) -> None:
        """The tokens a drafting cruise's step made (its accepted draft tokens and bonuses), its
        trees whole, and what their prefixes would have made (`record_step_ms`): they teach the
        streak's ceiling and those below it their tokens ratios against the forecasts the
        streak was decided with, at the batch it was decided at (a drained batch's would be
        biased). Taught only by the steps that decide or hold, the ratio came from the steps
        next to decisions and probes; on the fake device's replay of an H100's costs at c = 1,
        its text repeating every few steps, they were the streak's poorest (a third of the
        forecast, against four fifths over all its steps) and turned the gate to plain steps
        where drafting made 2.6x their tokens."""
        if self._streak_choice > 0 and batch_size == self._streak_batch and self._streak_tokens > 0.0:
            choice, forecast = self._streak_choice, self._streak_tokens
            self._teach_tokens(batch_size, choice, forecast, tokens, tokens_within, self._streak_narrower)

    def hold_unchecked(self, plain: bool = False) -> None:
        """A step that kept the streak's choice without asking
        (`steps_held_ahead`, `plain_steps_held_ahead`): it counts toward the recheck and the
        probe as a held step does. A `plain` one also ages the ratios as the plain step it
        stands for would have (`record_step_ms`): a gate that turned plain on drafted steps that
        made little tries drafting again as they fade, and plain cruises are most of a plain
        streak's steps."""
        self.steps_since_probe += 1
        self._streak_age += 1
        if plain:
            self.residual.age()
            self.token_residual.age()

    def plain_probe_interval(self, batch_size: int) -> int:
        """Plain steps between probes at this batch size's bucket (see `plain_probe_intervals`),
        at least what keeps its probes' measured cost within `PROBE_SHARE` of the plain steps."""
        bucket = batch_bucket(batch_size)
        interval = self.plain_probe_intervals.get(bucket, self.probe_interval)
        extra_steps = self.probe_costs.get(bucket, 0.0)
        if self.probe_share <= 0.0 or extra_steps <= 0.0:
            return interval
        return max(interval, min(math.ceil(extra_steps / self.probe_share), self._longest_plain_interval))

    @property
    def _longest_plain_interval(self) -> int:
        """The most plain steps between probes at a bucket: 16x `probe_interval`."""
        return 16 * self.probe_interval

    def _streak_holds(self, plain_ms: float, draft_ms: float) -> bool:
        """Whether the streak under way keeps its choice this step (see `ceiling`)."""
        moved = [
            abs(now - then) > RECHECK_SHIFT * then
            for now, then in zip((plain_ms, draft_ms), self._streak_prices, strict=True)
        ]
        if self._streak_choice == 0:
            interval = self.plain_probe_interval(self._streak_batch)
            return self.steps_since_probe < interval and not moved[0]
        due = self.steps_since_probe >= self._drafted_interval(self._streak_turns)
        return not due and not any(moved) and self._streak_age < self._streak_recheck

    @property
    def _streak_recheck(self) -> int:
        """The steps the drafting streak under way holds before deciding again (`recheck_steps`
        at the batch it was decided at, at least `self.recheck_steps`)."""
        return recheck_steps(self._streak_batch, self.recheck_steps)

    def _probe_ceiling(self, best: int, options: dict[str, int]) -> int:
        """A drafting probe's ceiling, the directions taken in turn (`PROBE_TURNS`): twice the
        choice (the curve past it stays known), the candidate below it (its step-time ratio
        stays known) and a plain step (its price stays known), of the `options` that apply to
        `best` (`_probe_options`); a direction that does not apply passes its turn to the
        next."""
        for offset in range(len(PROBE_TURNS)):
            turn = (self._probe_turn + offset) % len(PROBE_TURNS)
            if PROBE_TURNS[turn] in options:
                self._probe_turn = (turn + 1) % len(PROBE_TURNS)
                return options[PROBE_TURNS[turn]]
        return best

    def _probe_options(
        self, best: int, cap: int, batch_size: int, predicted_ms: dict[int, float], plain: bool
    ) -> dict[str, int]:
        """The probe directions that apply to the drafting choice `best` (none to a plain one),
        each with its ceiling: twice the choice within the cap, at a price
        (`WIDER_PROBE_MAX_COST`), the candidate below it, and where `plain`
        (`PLAIN_PROBE_MAX_GAIN`) a plain step. `predicted_ms`: the candidates' predicted step
        milliseconds, before their measured ratios."""
        if best == 0:
            return {}
        wider = min(cap, 2 * best)
        narrower = max((c for c in powers_of_two_upto(cap) if c < best), default=0)
        options = {}
        if wider > best and self._affordable(wider, best, batch_size, predicted_ms):
            options["wider"] = wider
        if narrower:
            options["narrower"] = narrower
        if plain:
            options["plain"] = 0
        return options

    def _drafted_interval(self, turns: int) -> int:
        """Drafted steps between a streak's probes where it takes `turns` of the `PROBE_TURNS`:
        `drafted_probe_interval` for each of them, so each direction it probes comes once in
        `len(PROBE_TURNS)` intervals."""
        return self.drafted_probe_interval * len(PROBE_TURNS) // max(turns, 1)

    def _affordable(self, wider: int, best: int, batch_size: int, predicted_ms: dict[int, float]) -> bool:
        """Whether a probe at `wider` costs at most `WIDER_PROBE_MAX_COST` steps at `best`."""
        if wider not in predicted_ms or best not in predicted_ms:
            return True  # nothing priced yet (the first curve): the probe is how it is learned
        wider_ms = predicted_ms[wider] * self.residual.ratio(batch_size, wider)
        best_ms = predicted_ms[best] * self.residual.ratio(batch_size, best)
        return wider_ms <= WIDER_PROBE_MAX_COST * best_ms

    def record_probe_ms(self, batch_size: int, step_ms: float) -> None:
        """The wall time of the probe after plain steps the last `ceiling` chose (drafting its
        requests' catch-up): what it cost above a plain step sets the bucket's next interval
        (`PROBE_SHARE`), against the plain step priced when the probe was chosen. Nothing when
        the last ceiling was no such probe."""
        plain_ms = self._streak_prices[0]  # set by every decision, the probe's included
        if self.probing and plain_ms > 0.0:
            self.probe_costs[batch_bucket(batch_size)] = max(step_ms / plain_ms - 1.0, 0.0)

    def record_step_ms(
        self, step_ms: float, tokens: int | None = None, tokens_within: Mapping[int, int] | None = None
    ) -> None:
        """The wall time of the step the last `ceiling` decided, and the tokens it made (its
        accepted draft tokens and bonuses; None: unknown): teach that ceiling's ratios (the
        policy gives none of a step whose draft caught up on context). A probe of the choice's
        neighbours whose step moved its ceiling's time ratio by more than `RECHECK_SHIFT` ends
        the streak it would resume: the next step decides with that price.

        `tokens_within[c]`: the tokens the step's trees cut to their first c nodes would have
        made (`AdaptiveBudget`): a best-first tree's prefix is the narrower ceiling's tree, and
        the accepted path's nodes inside it are what that tree accepts, so each ceiling below
        the decided one learns its tokens ratio from the same steps as the choice, on the same
        text. A probe narrower than the choice then teaches its step time only. Learned from
        their probes, the narrower ceilings' ratios were the probes' steps': on the fake
        device's replay at c = 2 every run probed ceiling 32 at the same step of the same text
        (greedy runs of the same prompts), one that made 2 tokens at any width, and the gate
        kept ceiling 64, whose steps made what 32's would at 1.07x their time. Taught from the
        prefixes, c = 2 went from 0.90-0.92 of the best fixed budget to 0.95-0.96 in six
        rounds, closed and staggered (`bench/results/fake_device.md`).

        A step given here that teaches no tokens ratio (a plain one, a probe after plain steps,
        one whose trees a request's end cut) still ages the ratios, so a gate that turned to
        plain steps on drafted steps that made little tries drafting again as they fade
        (`STALE_HALF_LIFE_STEPS`); probes alone cannot teach them (they draft a few requests of
        the batch). Drafting cruises' steps, which the policy does not give here, teach the tokens
        ratios and the marginal gains alone (`record_cruise_tokens`); plain cruises' age the
        ratios (`hold_unchecked`)."""
        taught_tokens = False
        if self._decided is not None:
            batch_size, ceiling, predicted_ms, predicted_tokens = self._decided
            before = self.residual.ratio(batch_size, ceiling) if self.probing_neighbour else 0.0
            self.residual.observe(batch_size, ceiling, predicted_ms, step_ms)
            # A probe narrower than the choice teaches its step time only: the choice's steps
            # teach its tokens (and their prefixes') on the same text as the choice's own.
            narrower_probe = self.probing_neighbour and ceiling < self._streak_choice
            if ceiling > 0 and tokens is not None and not narrower_probe:  # a plain step's are its batch
                self._teach_tokens(
                    batch_size, ceiling, predicted_tokens, tokens, tokens_within, self._narrower_forecasts
                )
                taught_tokens = True
            if before and abs(self.residual.ratio(batch_size, ceiling) - before) > RECHECK_SHIFT * before:
                self._streak = None
        if not taught_tokens:
            self.token_residual.age()
        self._decided = None

    def _teach_tokens(
        self,
        batch_size: int,
        ceiling: int,
        forecast: float,
        tokens: int,
        tokens_within: Mapping[int, int] | None,
        narrower_forecasts: Mapping[int, float],
    ) -> None:
        """A drafted step's tokens at `ceiling` against their forecast, and its prefixes' at the
        ceilings below against theirs: the tokens ratios and the marginal gains."""
        self.token_residual.observe(batch_size, ceiling, forecast, tokens)
        self._tokens_ceiling[batch_bucket(batch_size)] = ceiling
        for narrower, made in (tokens_within or {}).items():
            if predicted := narrower_forecasts.get(narrower):
                self.token_residual.observe(batch_size, narrower, predicted, made, counterfactual=True)
        if tokens_within:
            self.marginal.observe(
                batch_size, {**tokens_within, ceiling: tokens}, {**narrower_forecasts, ceiling: forecast}
            )

    def _drafted_ceilings(
        self,
        acceptance: np.ndarray,
        caps: Sequence[int],
        cost: StepCost,
        build: BuildCost,
        layout: TokenLayout,
        overhead: StepOverhead,
    ) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The drafting ceilings, their predicted rates corrected by their measured ratios (tokens
        made over forecast, step time taken over predicted), their predicted step milliseconds
        and tokens (the models' own, which the ratios are learned against), and their step
        milliseconds as measured (the predictions times their step-time ratios).
        `acceptance`: the recent curve, calibrated.

        A ceiling wider than the one whose own steps taught the tokens ratio last at this batch
        bucket (the one taken) is priced at the taken one's corrected tokens plus its further
        nodes' forecast: the steps taken say what its first nodes make now (a narrower ceiling
        learns its own ratio from their prefixes at every step, a wider one only when it is taken
        or probed, one request's tree a probe at batch 1), and the nodes past them are known
        from the forecast alone. Read from its own stale samples, the wider ceiling's ratio swung
        by a fifth between decisions on the virtual H100 at c = 1, below the taken one's as often
        as not, and the gate held 32 in half the steps where fixed-64 makes 7% more tokens at the
        same step time; priced so, c = 1 went from 0.91-0.92 of the best fixed budget to
        0.93-0.96 there (three sweeps each, c = 2 0.92-0.95 -> 0.95-0.96). The taken ratio is not
        carried onto the further nodes: a narrower ceiling's ratio is the larger (at c = 1 16:
        1.41, 32: 1.30, as measured), and carried so it held the CI CPU, where width is dear, at
        16 where 8 wins (c = 1 0.88-0.92 in three sweeps, against 0.94-0.98). Once taken, a wider
        ceiling reads its own steps' ratio. Each further doubling's forecast gain is scaled by
        what that doubling's nodes made over their forecast when steps last ran that wide
        (`marginal_gain.py`): forecast alone, 64's nodes past 32 were priced at half what they
        made on an H100 at batch 1, and the gate never took 64 there, the best fixed budget."""
        batch_size = len(caps)
        candidates = powers_of_two_upto(max(caps))
        nodes_built = _nodes_built(caps, candidates)
        build_ms = build.ms(batch_size, nodes_built, np.minimum(candidates, max(caps)))
        draft_ms = cost.draft_ms(batch_size) + overhead.drafted_ms + build_ms
        rates, step_ms = ceiling_rates(acceptance, caps, candidates, cost, draft_ms=draft_ms, layout=layout)
        tokens = rates * step_ms / 1000.0
        made, took = self.token_residual, self.residual
        corrected = tokens * np.array([made.ratio(batch_size, c) for c in candidates])
        # The candidate of the ceiling taken (the widest, where none has taught tokens yet).
        measured = self._tokens_ceiling.get(batch_bucket(batch_size), candidates[-1])
        taken = bisect.bisect_right(candidates, measured) - 1
        for i in range(taken + 1, len(candidates)):  # each doubling's forecast gain, as measured
            gain = tokens[i] - tokens[i - 1]
            corrected[i] = corrected[i - 1] + self.marginal.ratio(batch_size, candidates[i]) * gain
        measured_ms = step_ms * np.array([took.ratio(batch_size, c) for c in candidates])
        return candidates, 1000.0 * corrected / measured_ms, step_ms, tokens, measured_ms

    @staticmethod
    def _first_ceiling(caps: Sequence[int], cost: StepCost, build: BuildCost, overhead: StepOverhead) -> int:
        """The first step knows no acceptance: the widest ceiling that costs at most
        `FIRST_STEP_PLAIN_STEPS` plain steps (at least 1), so learning the curve costs little
        where wide trees are dear (a CPU under load) and sees the whole cap where they are not."""
        batch_size = len(caps)
        plain_ms, draft_ms = _prices(batch_size, cost, overhead)
        draft_ms += overhead.drafted_ms
        candidates = powers_of_two_upto(max(caps))
        nodes_built = _nodes_built(caps, candidates)
        affordable = 1
        for candidate, nodes in zip(candidates, nodes_built, strict=True):
            step_ms = (
                draft_ms
                + float(build.ms(batch_size, nodes, min(candidate, max(caps))))
                + float(cost.verify_ms(batch_size, batch_size * (candidate + 1)))
            )
            if step_ms <= FIRST_STEP_PLAIN_STEPS * plain_ms:
                affordable = candidate
        return affordable

    def record_curve(
        self,
        probs: np.ndarray,
        lengths: np.ndarray,
        calibrate: Calibration | None = None,
        weights: np.ndarray | None = None,
    ) -> None:
        """A drafted step's candidates as one matrix: row b holds request b's drafter
        probabilities in best-first order (acceptance probabilities when `calibrate` is None),
        its first `lengths[b]` entries (zeros past them). A lesson of n trees moves the curve as
        n / `curve_trees` lessons of `curve_trees` trees would, by `curve_weight` at most.
        `weights`: the rows' `drain_weights` at the step's decision (None: alike), which the
        drain curve's lesson weighs them by."""
        width = int(lengths.max(initial=0))
        if width == 0:
            return
        probs = probs[:, :width]
        step_curve, step_spread = _step_curve(probs, lengths, np.ones(len(lengths)), calibrate)
        # The drain curve only where a choice can read it: a gate that weighs drains, or a lesson
        # given weights (with `drain_power` 0 the policy gives none, and every lesson skips it).
        drain = None
        if weights is not None:
            drain = _step_curve(probs, lengths, weights, calibrate)
        elif self.drain_power > 0.0:
            drain = (step_curve.copy(), step_spread.copy())  # blended in place, apart from the curve's
        trees = int(np.count_nonzero(lengths))
        weight = min(self.curve_weight, 1.0 - (1.0 - self.curve_weight) ** (trees / self.curve_trees))
        if self.curve is None:
            self.curve, self.spread = step_curve, step_spread
        else:
            self.curve, self.spread = _blend(self.curve, self.spread, step_curve, step_spread, weight)
        if drain is not None and not len(self.drain_curve):
            self.drain_curve, self.drain_spread = drain  # the first lesson it takes, as measured
        elif drain is not None:
            self.drain_curve, self.drain_spread = _blend(self.drain_curve, self.drain_spread, *drain, weight)


def drain_weights(steps_to_finish: Sequence[float] | None, power: float) -> np.ndarray | None:
    """Each request's weight in a draining batch's choice (`DRAIN_POWER`): its expected steps to
    finish over the batch's longest, to `power`, scaled to a mean of 1. None where nothing
    drains (`steps_to_finish` None), `power` is 0, or every request weighs alike (one request,
    or equal steps): the batch's own curve decides."""
    if steps_to_finish is None or power <= 0.0 or len(steps_to_finish) < 2:
        return None
    steps = np.asarray(steps_to_finish, dtype=np.float64)
    longest = float(steps.max())
    if longest <= 0.0 or float(steps.min()) == longest:
        return None
    weights = (np.maximum(steps, 0.0) / longest) ** power
    return weights * (len(weights) / weights.sum())


def _step_curve(
    probs: np.ndarray, lengths: np.ndarray, weights: np.ndarray, calibrate: Calibration | None
) -> tuple[np.ndarray, np.ndarray]:
    """One step's curve and spread (`DraftGate.record_curve`): per position, the mean over the
    rows whose tree reaches it, each row counted by its weight."""
    width = probs.shape[1]
    reaches = np.arange(width)[None, :] < lengths[:, None]  # [B, width]
    counts = np.maximum(weights @ reaches, 1e-12)
    step_curve = (weights @ probs) / counts
    step_spread = np.ones(width)
    if calibrate is not None:
        mean_of_calibrated = (weights @ calibrate(probs)) / counts
        calibrated_mean = calibrate(step_curve)
        np.divide(mean_of_calibrated, calibrated_mean, out=step_spread, where=calibrated_mean > 0)
    return step_curve, step_spread


def _blend(
    curve: np.ndarray, spread: np.ndarray, step_curve: np.ndarray, step_spread: np.ndarray, weight: float
) -> tuple[np.ndarray, np.ndarray]:
    """A curve and its spread moved toward one step's by `weight`. Positions no tree reached
    before (a probe past the ceilings so far) start as measured: blended up from zero they would
    price the wider ceiling at a third of its gain, and the next probe is a probe interval away."""
    known = min(len(step_curve), len(curve))
    curve[:known] += weight * (step_curve[:known] - curve[:known])
    spread[:known] += weight * (step_spread[:known] - spread[:known])
    if len(step_curve) > known:
        curve = np.concatenate((curve, step_curve[known:]))
        spread = np.concatenate((spread, step_spread[known:]))
    return curve, spread


def _widest_near_best(
    rates: np.ndarray,
    measured_ms: np.ndarray,
    own_steps: np.ndarray,
    plain_rate: float,
    near_best_ms: float,
    near_tie_rate: float,
) -> int:
    """The index of the drafting choice among the candidates: the best predicted rate (the
    narrowest of equal ones), or the widest candidate above `plain_rate` that its own steps
    measured (`own_steps`) and that is within `NEAR_BEST_RATE` of it with a step at most
    `near_best_ms` (a share: `DraftGate._near_best_ms`) dearer as measured, or within
    `near_tie_rate` (`NEAR_TIE_RATE`) of it at any step time."""
    pick = int(np.argmax(rates))
    cheap_enough = (rates >= (1.0 - NEAR_BEST_RATE) * rates[pick]) & (
        measured_ms <= (1.0 + near_best_ms) * measured_ms[pick]
    )
    tied = rates >= (1.0 - near_tie_rate) * rates[pick]
    near = (cheap_enough | tied) & (rates > plain_rate) & own_steps
    near[pick] = True  # the best itself, whatever its rate (a NaN compares false)
    return int(np.flatnonzero(near)[-1])


def recheck_steps(batch_size: int, least: int = DRAFTED_RECHECK_STEPS) -> int:
    """Steps a drafting streak decided at this batch size keeps its choice before deciding
    again: `least` (`DRAFTED_RECHECK_STEPS`), or more at small batches (`RECHECK_REQUESTS`)."""
    return max(least, -(-RECHECK_REQUESTS // max(batch_size, 1)))


def _below(forecasts: dict[int, float], ceiling: int) -> dict[int, float]:
    """The drafting ceilings' forecasts below `ceiling`."""
    return {c: tokens for c, tokens in forecasts.items() if 0 < c < ceiling}


def _prices(batch_size: int, cost: StepCost, overhead: StepOverhead) -> tuple[float, float]:
    """A plain step's and the drafter call's predicted milliseconds at this batch size."""
    return float(cost.verify_ms(batch_size, batch_size)) + overhead.plain_ms, cost.draft_ms(batch_size)


def _nodes_built(caps: Sequence[int], ceilings: Sequence[int]) -> np.ndarray:
    """Draft nodes the build makes over the batch at each ceiling: each request up to its cap."""
    return np.minimum(np.asarray(caps)[None, :], np.asarray(ceilings)[:, None]).sum(axis=1)
