"""`AdaptiveBudget`: the engine's per-step budget choice, from calibration, cost and the gate.

One step calls, in pipeline order (the policy holds the step's figures in between):
    plan(caps)                    before drafting: the step's tree ceiling, 0 = a plain decode
                                  step (root-only trees); the drafter's top-K and the build use it
    record_draft_ms(ms, catching_up)  after the drafter call, when there was one
    choose(trees, caps, captured) trees built at the ceiling, and the verify graphs the step may
                                  run (`graph_shapes.py`) -> draft nodes per request (a
                                  `settled` step's: the last weighing's width, unweighed)
    record_build_ms(ms)           after the build stage (trees, choice, verify buffers)
    record_verify_ms(ms, captured_graph)  after the verify call (a capture's teaches no cost)
    observe(trees, accepted, n)   the verified trees (padded to n nodes) and their accepted nodes: the step's
                                  `BudgetStep` record (what it teaches waits for `learn`)
    record_step_ms(ms)            the whole step's wall time: what its priced parts left out
                                  (`step_overhead.py`), and how far the gate's prediction for
                                  its ceiling was off (`step_residual.py`)
    learn()                       the observed step's lesson, calibration and cost refresh: the
                                  engine calls it while the device computes, on CUDA in the
                                  next step's draft, else inside its verify; `observe` calls it
                                  first, so no lesson is skipped
The trees verified are best-first prefixes of the ones built (`TreeBatch.prefix`), so the
choice reads drafter outputs only and verification stays lossless.

A cruising step (armed by a settled step where node lessons are dear, or by a plain streak's
step) replaces all of these with two calls: `cruise_width(batch, cap, longest_left)` before
drafting (None: plan instead; 0: a plain step), `cruised(trees, accepted)` after the verify; it
drafts and builds at the settled width like a fixed budget, or decodes plainly like plain
decoding.

Deciding time. A step's `plan` and `choose` time is the policy deciding, and the steps that
decide pay most of it: a drafting streak's later steps (`settled`) a few hundredths of a
millisecond, a decision or a probe of a neighbouring ceiling a few tenths (0.5 ms on this CPU's
replay at batch 32, `bench/fake_device.py`). The gate learns each ceiling's measured over
predicted step time (`step_residual.py`) with the step's own deciding time replaced by the
recent mean of its kind (drafted or plain): a neighbour is measured only at its probes, which
decide, the choice mostly at its settled steps, so with each step's own every neighbour read
0.5 ms dearer than its own streak would run (fixed-8's steps took 5.8 ms at batch 32, the
probes of ceiling 8 6.9 ms) and the gate held ceiling 16 where 8 wins by a tenth; the mean
keeps what deciding costs on average in every drafted ceiling's price alike, as the step
overhead the predictions add holds it. The build's price learns the build stage without
`choose` for the same reason.
"""

import bisect
import functools
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ddtree_serve.engine.budget.allocator import (
    Allocation,
    Forecast,
    TokenLayout,
    allocate,
    allocate_padded_rows,
    forecast_values,
)
from ddtree_serve.engine.budget.build_cost import BuildCost
from ddtree_serve.engine.budget.calibration import AcceptanceCalibrator
from ddtree_serve.engine.budget.cost_curve import CostCurve
from ddtree_serve.engine.budget.draft_gate import DraftGate, drain_weights
from ddtree_serve.engine.budget.measure import powers_of_two_upto
from ddtree_serve.engine.budget.step_overhead import StepOverhead
from ddtree_serve.engine.budget.step_residual import batch_bucket
from ddtree_serve.engine.graph_shapes import VerifyGraphShapes
from ddtree_serve.tree import TreeBatch

CALIBRATION_STEPS = 4
"""Drafted steps whose verified nodes the calibrator learns in one update: its statistics move
little per step (decay 0.995), and the refit costs more host time than a fast step spares."""

EARLY_CALIBRATIONS = 8
"""Updates made one drafted step at a time before the calibrator batches them."""

NODE_LESSON_INTERVAL = 4
"""Past the early calibrations, one drafted step in this many teaches its verified nodes (the
calibrator, the gate's curve, the build cost); every step teaches its forwards' times. A node
lesson took 0.13 ms of a 0.33 ms policy step on this CPU's replay at batch 4, twice that on the
H200's host, where a whole step is 4 ms; the calibrator still sees one step in four, hundreds of
nodes per update at batch 4, and probes (of drafting after plain steps, and of the neighbours
of the drafting choice, whose trees are the gate's only news past its chosen width) and
learning steps always teach."""

SETTLED_LESSON_INTERVAL = 8
"""A settled streak's steps (`settled`) teach their nodes one in this many: its trees are the
width its last weighing kept, step after step, so a lesson adds little the last one did not
(the gate decides again at most `recheck_steps` later, with one more lesson learned);
on the H200's host a node lesson took 0.13-0.3 ms, 0.03-0.06 ms of every settled step at one
in `NODE_LESSON_INTERVAL`, a fifth of what a settled step spent over a fixed budget's."""

LESSON_SHARE = 0.02
"""Every drafted step teaches its nodes while a node lesson's host time is at most this share of
a drafted step's wall time (on the CI CPU 0.1-0.2 ms of a 15 ms step at batch 1): where lessons
are that cheap, one step in `NODE_LESSON_INTERVAL` only starved the calibrator, and a cold one
forecast the first nodes of a tree at 0.7 where they were accepted 0.9 of the time, so the
gate took ceiling 32 at c = 1 where 8 wins (the CPU's drafter is dear)."""

SETTLE_BELOW_MS = 25.0
"""A drafting streak's steps reuse its last weighing's width unweighed (`settled`) only where a
drafted step is predicted to take less than this: a weighing costs the host 0.1-0.5 ms, a tenth
of a 3 ms step on a GPU with a small pair, and under 2% of a longer one, while weighing each
step's own trees gives each request the nodes its tree is worth. On the Kimi K2.6 slice's cost
replay (steps of 70 ms and more; `bench/budget_sweep.py --simulate-cost`) weighing every step
took c = 1 and 2 from 1.14 and 1.21 of the best fixed budget to 1.21 and 1.27."""

CRUISE_LESSON_BATCH = 8
"""A drafting cruise's steps teach the gate their tokens this many at a time (`learn`): the gate
reads what they teach only when it decides, and `plan` teaches any still waiting first. One at a
time, each step's lesson ran cold after the step's other work: on an H100 `learn` took
0.083 ms of a cruising step at batch 1 and 0.070 at batch 2 (2-3% of a launch-bound step, whose
host time is its time), and 0.021 and 0.036 taught eight at a time (`bench/step_stages.py`, one
run each)."""

PLAIN_CRUISE_STEPS = 8
"""A plain streak's steps run unasked (`AdaptiveBudget.cruise_width`) at most this many in a row:
the next one decides, learns its verify's time and teaches the plain step's ratio. On the CI CPU
an adaptive plain step took 0.27-0.35 ms more than a plain-decoding engine's at batch 8-16
(8 ms steps), in `plan`, `observe`, `learn` and `record_step_ms`, which a step whose choice,
batch and prices stand still repeats to the same end."""

AHEAD_DRAFT_LESSONS = 8
"""Decisions in a row whose draft is launched ahead of them (`drafts_ahead`) before one is not:
a draft launched ahead teaches the drafter's cost curve nothing (its time holds the plan's), so
one decision in this many launches its draft after it and teaches the drafter's price."""

LESSON_WEIGHT = 0.2
"""EMA weight of the node lessons' host milliseconds and of the drafted steps' wall time."""

DECIDING_MEAN_WEIGHT = 0.1
"""EMA weight of the recent mean deciding time per kind of step (module docstring)."""

LEARNING_STEPS = 4
"""Drafted steps the calibrator learns before the gate may judge drafting a loss: before them
the forecast is mostly the drafter's own word (the bundled drafter's is half what it accepts),
and a gate that turned plain on it would learn more only from a probe every 16 steps."""


@dataclass(frozen=True)
class BudgetStep:
    """What one step chose and how its forecast fared (for metrics, spans and benchmarks)."""

    drafted: bool
    num_nodes: tuple[int, ...]  # draft nodes verified per request
    # Calibrated expected accepted draft tokens per request (0: no draft), or how to work them
    # out when first read (`predicted_per_request`): a settled step's, which only metrics read.
    forecast: Forecast = field(repr=False)
    accepted_per_request: tuple[int, ...]  # draft tokens verification accepted
    ceiling: int = 0  # draft nodes per tree the step built at most (0: a plain step)

    @functools.cached_property
    def predicted_per_request(self) -> tuple[float, ...]:
        """Calibrated expected accepted draft tokens per request (0: no draft)."""
        return forecast_values(self.forecast)

    @property
    def predicted_accepted(self) -> float:
        """Calibrated expected accepted draft tokens, whole batch."""
        return sum(self.predicted_per_request)

    @property
    def accepted(self) -> int:
        """Accepted draft tokens, whole batch."""
        return sum(self.accepted_per_request)

    @property
    def calibration_error(self) -> float:
        """Predicted minus accepted draft tokens per request (> 0: the forecast was too hopeful)."""
        return (self.predicted_accepted - self.accepted) / len(self.num_nodes)


class AdaptiveBudget:
    """Owns the calibrator, the cost curve and the draft gate of one engine."""

    def __init__(
        self,
        cost: CostCurve,
        build: BuildCost | None = None,
        calibrator: AcceptanceCalibrator | None = None,
        gate: DraftGate | None = None,
        layout: TokenLayout = "padded",
        token_buckets: Sequence[int] | None = None,
        learning_steps: int = LEARNING_STEPS,
        graph_shapes: VerifyGraphShapes | None = None,
        lesson_share: float = LESSON_SHARE,
    ) -> None:
        """`build`: the host build's cost (default: free, so only the forwards are priced).
        `token_buckets`: the tree tokens a graphed target pads each verify to (None: eager).
        `graph_shapes`: the verify graphs that target has captured (the calibration's, then
        each step's, recorded by the engine): they are the target's, so they go with the
        policy to any engine over it (a benchmark's engines share one calibrated policy).
        `learning_steps`: drafted steps taught to the calibrator before drafting may be judged
        a loss (`LEARNING_STEPS`; 0: the gate judges from the first curve).
        `lesson_share`: node lessons at every drafted step below this share of its time
        (`LESSON_SHARE`; 0: one in `NODE_LESSON_INTERVAL` only)."""
        self.cost = cost
        self.build = build or BuildCost(0.0, 0.0, 0.0)
        self.calibrator = calibrator or AcceptanceCalibrator()
        self.gate = gate or DraftGate()
        self.layout = layout  # the engine pads every tree of a batch to the widest
        self.token_buckets = None if token_buckets is None else tuple(token_buckets)
        self.graph_shapes = graph_shapes
        self.overhead = StepOverhead()
        self.learning_steps = learning_steps
        self.lesson_share = lesson_share
        # Whether `drafts_ahead` may say yes at all: a setting so a benchmark can A/B it.
        self.draft_ahead = True
        self._lesson_ms = 0.0  # EMA: host ms of a node lesson (`learn`), 0 until one is timed
        self._drafted_step_wall_ms = 0.0  # EMA: a drafted step's wall time, 0 until one is timed
        self._priced_ms: float | None = None  # the last observed step's priced parts, measured
        # The last chosen step's drafter probabilities [B, built] (None: a settled step's, from
        # its log-weights `_settled_logws` when a lesson reads them).
        self._raw_probs: np.ndarray | None = np.zeros((0, 0))
        self._settled_logws = np.zeros((0, 0))
        self._built_lengths = np.zeros(0, dtype=np.int64)  # its draft nodes built per request
        self._whole_rows: np.ndarray | None = None  # [B] its rows no request's end cut (None: all)
        # [B] the last plan's requests' weights in a draining batch (`drain_weights`; None: alike).
        self._row_weights: np.ndarray | None = None
        self._last_step: BudgetStep | None = None
        # A drafting cruise's step, its record not yet made (`cruised`): trees, accepted draft
        # tokens per request, ceiling and the calibration then.
        self._cruise_record: tuple[TreeBatch, tuple[int, ...], int, Callable] | None = None
        # Whole cruising steps' trees, not yet taught to the gate (`_learn_cruise`).
        self._cruise_lessons: list[_CruiseLesson] = []
        self._ceiling = 0
        self._draft_ms: float | None = None
        self._build_ms: float | None = None
        self._verify_ms: float | None = None
        self._allocation: Allocation | None = None
        self._lesson: _Lesson | None = None  # the last observed step's, until `learn`
        self._catching_up = False  # the step's draft took more context than one step's
        self._draft_with_plan = False  # the step's draft was launched before its plan
        self._drafts_unpriced = 0  # decisions in a row whose draft was launched ahead
        self._graph_capped = False  # captured verify graphs cut the step below its ceiling
        self._captured_graph = False  # the step's verify captured its graph (`record_verify_ms`)
        # A request's end cut some of the step's trees: its tokens say nothing of the ceiling's
        # whole trees, which the gate forecast (`DraftGate.token_residual`).
        self._depth_cut = False
        # The last observed step's accepted node indices per request (root = 0), for the
        # tokens its trees' prefixes would have made (`_tokens_within`).
        self._accepted_nodes: Sequence[Sequence[int]] = ()
        # Verified nodes (drafter probabilities, accepted or not) of drafted steps not yet taught
        # to the calibrator: it learns `CALIBRATION_STEPS` steps' at once (one update, one refit).
        self._calibration_batch: list[tuple[np.ndarray, np.ndarray]] = []
        self._num_calibrations = 0
        self._learning = True  # this step drafts to teach the calibrator (`LEARNING_STEPS`)
        self._num_drafted_steps = 0  # observed, for `NODE_LESSON_INTERVAL` and `SETTLED_LESSON_INTERVAL`
        # (ceiling, width) of the last weighing of widths but a neighbour probe's (None: none, or
        # caps or captured graphs cut it): a held streak's steps at that ceiling are `settled`
        # at that width.
        self._weighed: tuple[int, int] | None = None
        self.settled = False  # this step takes the last weighing's width without weighing
        # Host ms of this step's `plan` and `choose`, and of `choose` (module docstring: deciding time).
        self._deciding_ms = 0.0
        self._choose_ms = 0.0
        self._mean_deciding_ms = {False: 0.0, True: 0.0}  # plain, drafted (module docstring)
        self._cap_bucket = 0  # the power of two at or above the last `plan`'s widest cap
        self._cruise: _Cruise | None = None  # the steps a settled streak runs unasked (`cruise_width`)
        # The step under way planned (a step with the drafter lost does not: it arms no cruise).
        self._planned = False

    def plan(
        self, caps: Sequence[int], hidden: bool = False, steps_to_finish: Sequence[float] | None = None
    ) -> int:
        """Starts a step: its tree ceiling (0: decode plainly), from recent acceptance and costs.
        `hidden`: it runs while the device computes the step's draft, launched before it
        (`drafts_ahead`): its host time is not the step's, so no deciding time is counted.
        `steps_to_finish`: each request's expected steps to its end where the batch drains (no
        request waits: `SpecEngine`), in `caps`' order; the gate then weighs the requests the
        batch waits for (`DRAIN_POWER`). None: every request's tokens count alike."""
        started = time.perf_counter()
        self._row_weights = drain_weights(steps_to_finish, self.gate.drain_power)
        ceiling = self._plan(caps)
        self._planned = True
        self._choose_ms = 0.0
        self._deciding_ms = 0.0 if hidden else 1000.0 * (time.perf_counter() - started)
        return ceiling

    @property
    def weighs_drain(self) -> bool:
        """Whether `plan` reads a draining batch's `steps_to_finish` (`DRAIN_POWER` set)."""
        return self.gate.drain_power > 0.0

    @property
    def drafts_ahead(self) -> bool:
        """Whether the engine may launch the next step's draft before its `plan` (at the widest
        K its requests may use), so that the decision runs while the device drafts: the last
        planned step drafted, not as a probe after plain steps, and its gate found drafting
        well ahead of a plain step (`DraftGate.plain_far`), so the next decision all but surely
        drafts too. On the H200 `plan` took 0.5-0.8 ms of each decision and prefill step,
        before the draft was launched, at c = 1-2 (`bench/step_stages.py`). Where it does choose
        a plain step, the draft is spent unused (`record_step_ms`'s `draft_unused`). One
        decision in `AHEAD_DRAFT_LESSONS` launches after it, so the drafter's price is learned."""
        return (
            self.draft_ahead
            and self._ceiling > 0
            and not self.gate.probing
            and self.gate.plain_far
            and self._drafts_unpriced < AHEAD_DRAFT_LESSONS
        )

    def _plan(self, caps: Sequence[int]) -> int:
        self._learn_cruise()  # before the gate weighs the ratios it teaches
        self._cruise = None
        self._cap_bucket = batch_bucket(max(caps, default=0))
        self._draft_ms = self._build_ms = self._verify_ms = self._allocation = None
        self._catching_up = self._graph_capped = self._depth_cut = self._draft_with_plan = False
        self._captured_graph = False
        if (
            self.gate.curve is None
            or self._num_calibrations < self.learning_steps
            or (self._lesson is not None and self._lesson.probe)
        ):
            # The first drafted steps' trees give the gate its curve and the calibrator its
            # first data, and a probe's tell it whether to draft again, before it decides (else
            # the lesson waits for the next verify).
            self.learn()
        self._learning = self._num_calibrations < self.learning_steps
        self._ceiling = self.gate.ceiling(
            caps,
            self.cost,
            self.build,
            self.layout,
            self.overhead,
            learning=self._learning,
            calibrate=self.calibrator.calibrate,
            weights=self._row_weights,
        )
        # A streak's step takes the width its last weighing at this ceiling took, unweighed
        # (`choose`), until the gate decides again (at most `recheck_steps` later): on
        # the H200 the weighing was a quarter of the adaptive step's extra host time at batch 1,
        # where it kept 31 of 32 nodes (the 32-token graph) step after step. So do the steps of
        # a streak whose batch shrinks within its bucket (requests finishing: a third of the
        # steps at c = 16, each built at the ceiling and weighed), and a step that teaches its
        # nodes (one in `SETTLED_LESSON_INTERVAL`), from the trees it verified.
        self.settled = (
            self.gate.kept
            and self._weighed is not None
            and self._weighed[0] == self._ceiling
            and self._num_calibrations >= EARLY_CALIBRATIONS
        )
        return self._ceiling

    @property
    def ceiling(self) -> int:
        """The tree ceiling `plan` chose for the step under way."""
        return self._ceiling

    @property
    def settled_width(self) -> int | None:
        """The draft nodes per tree a `settled` step verifies at most (None: not settled): the
        engine drafts and builds that wide, not at the ceiling. A best-first tree's first w
        nodes use ranks below w only and are the tree a budget of w builds, so the step verifies
        the trees it would have cut from the ceiling's, for a narrower draft and build (on the
        H200 at batch 64 the build at ceiling 16 for 9-12 kept nodes cost 0.6 ms a step more
        than fixed-8's)."""
        return self._weighed[1] if self.settled and self._weighed is not None else None

    def cruise_width(self, batch_size: int, cap: int, longest_left: int | None = None) -> int | None:
        """The draft nodes per tree of a step that cruises (None: this step plans).

        A settled step whose lessons are not cheap (`LESSON_SHARE`) arms a cruise for the steps
        its streak keeps without deciding (`DraftGate.steps_held_ahead`): they draft and build
        at its width, verify, and report a `BudgetStep` (`cruised`), with no `plan`, `choose`,
        lesson or step-time lesson. On the fake-device replay of the H200's costs at batch 64 a
        settled step spent 0.48 ms over fixed-16's 6.5 ms, 0.29 of it in those calls. A batch
        that grows past the streak's bucket (newcomers: their prompts' catch-up is no cruise's
        step), or a widest cap in another power of two, ends it (the gate would decide there);
        so does the engine's own condition (a lost drafter: `end_cruise`). A batch draining
        below the bucket (requests finishing) keeps a drafting cruise to its end, as a fixed
        budget keeps its width: on the H200 at c = 16 the steps after a run's first request
        finished were 60% of its steps, each leaving the cruise at a new bucket or at a request
        with no draft token to keep, and they decided and weighed at 5.3-5.6 ms where fixed-32's
        took 4.7; the next decision, at most `recheck_steps` later, is at the batch then.
        A plain cruise holds at its batch exactly (its price is read at the batch now).
        A drafting cruise whose steps are spent keeps on while every request ends within the
        gate's tail (`longest_left`: the most tokens any running request may still emit;
        `DraftGate.ends_within_tail`)."""
        cruise = self._cruise
        if cruise is None:
            return None
        spent = cruise.steps_left <= 0
        if spent and cruise.width > 0 and longest_left is not None:
            spent = not self.gate.ends_within_tail(longest_left)
            cruise.in_tail = cruise.in_tail or not spent
        if (
            spent
            or batch_bucket(batch_size) > cruise.batch_bucket
            or batch_bucket(cap) != cruise.cap_bucket
            or (cruise.batch_size is not None and batch_size != cruise.batch_size)
        ):
            if cruise.in_tail:  # the wave it held to its end is over: the next load decides anew
                self.gate.end_wave()
            self._cruise = None
            return None
        return cruise.width

    @property
    def cruising(self) -> bool:
        """A cruise is armed: the engine asks `cruise_width` before planning."""
        return self._cruise is not None

    @property
    def cruise_drafts(self) -> bool:
        """The armed cruise drafts (a settled streak's): only its `cruise_width` reads the
        requests' `longest_left`, and only its build their keepable depths."""
        return self._cruise is not None and self._cruise.width > 0

    def end_cruise(self) -> None:
        """No more cruising steps: the next step plans."""
        self._cruise = None

    def cruised(
        self, trees: TreeBatch, accepted: Sequence[int], accept_index: np.ndarray | None = None
    ) -> None:
        """Ends a cruising step (`cruise_width`): its verified trees and each one's accepted
        draft tokens; its record (made, and its forecast worked out, when read) is `last_step`.
        `accept_index` (the verdict's [B, 1 + depth] accepted node indices, root first), given
        when no tree was cut below the cruise's width (by a request's end or a graph's width):
        the tokens the step made teach the streak's tokens ratio, and its trees' prefixes the
        narrower ceilings' and the marginal gains (`DraftGate.record_cruise_tokens`).
        Taught at the steps that decide or hold only, a narrower ceiling's ratio was a streak
        older than the choice's: on an H100 at batch 1, where each run is another prompt, the
        gate took 16 and 32 in turn, each decision finding the choice's ratio (this prompt's)
        under the other's (the last prompt's). The lesson waits for `learn` (the next verify's,
        on a device), which teaches a cruise's lessons `CRUISE_LESSON_BATCH` at a time and the
        rest once the cruise ends, or for the next `plan`: taught here, it cost 0.07 ms of a 3.7 ms
        cruising step at batch 8 on the virtual H100 (`bench/virtual_device.py`); its array work
        (the widest tree's `max`, the accepted nodes' lists) waits too: the lists cost the H100's
        host 0.03 ms of every cruising step at batch 1-2."""
        cruise = self._cruise
        assert cruise is not None, "cruised without a cruise_width"
        cruise.steps_left -= 1
        self.gate.hold_unchecked(plain=cruise.width == 0)
        if cruise.width == 0:  # a plain step's record (a new one: readers tell steps apart by it)
            zeros = (0,) * trees.batch_size
            self.last_step = BudgetStep(False, zeros, (0.0,) * trees.batch_size, zeros)
            return
        accepted = tuple(accepted)
        if accept_index is not None:
            lesson = _CruiseLesson(cruise.ceiling, trees.num_nodes, accepted, accept_index)
            self._cruise_lessons.append(lesson)
        # Made when read (`last_step`): the in-process engine reads none, a served one every
        # step, and the record's array work was 50 of a cruising step's 90 us of policy time
        # on the CI CPU at batch 4 (the H100's host spent 0.05 ms a step in `cruised`).
        self._cruise_record = (trees, accepted, cruise.ceiling, self.calibrator.frozen())

    @property
    def last_step(self) -> BudgetStep | None:
        """The record of the step the policy ended last (`observe`, `cruised`)."""
        if self._cruise_record is not None:
            trees, accepted, ceiling, calibrate = self._cruise_record
            self._cruise_record = None
            num_nodes = trees.num_nodes - 1
            logws = trees.logws[:, 1 : 1 + int(num_nodes.max(initial=0))]
            self._last_step = BudgetStep(
                drafted=True,
                num_nodes=tuple(num_nodes.tolist()),
                forecast=functools.partial(_forecast, logws, num_nodes, calibrate),
                accepted_per_request=accepted,
                ceiling=ceiling,
            )
        return self._last_step

    @last_step.setter
    def last_step(self, step: BudgetStep | None) -> None:
        self._cruise_record = None
        self._last_step = step

    @property
    def probing(self) -> bool:
        """This step drafts only to refresh the acceptance curve, after plain steps: the engine
        may draft a few of its requests (the others verify root-only trees)."""
        return self.gate.probing

    def record_draft_ms(self, draft_ms: float, catching_up: bool = False, with_plan: bool = False) -> None:
        """The drafter call's milliseconds (this step's choice counts them). `catching_up`: it
        also took context beyond one step's (a newcomer's prompt, steps skipped): neither it nor
        its step's wall time teaches a cost (the drafter's curve, the step overhead, the
        ceiling's ratio). `with_plan`: launched before `plan` (`drafts_ahead`), its time holds
        the plan's: the drafter's curve learns nothing from it, the step's wall time does."""
        self._catching_up = catching_up
        self._draft_ms = draft_ms
        self._draft_with_plan = with_plan
        if with_plan:
            self._drafts_unpriced += 1
        elif not catching_up:
            self._drafts_unpriced = 0

    def record_build_ms(self, build_ms: float) -> None:
        """The build stage's milliseconds, `choose` included: the build's price learns them
        without the choice (module docstring: deciding time)."""
        self._build_ms = max(build_ms - self._choose_ms, 0.0)

    def record_verify_ms(self, verify_ms: float, captured_graph: bool = False) -> None:
        """The verify call's milliseconds. `captured_graph`: the target captured the call's
        CUDA graph in it (a graph key met first, `VerifyGraphShapes.record`), so neither its
        time nor its step's teaches a cost (the cost curve, the drift, the step overhead, the
        ceiling's ratio). Clamped as an outlier, a capture still moved its cell of the cost
        curve by 30% (and the drift by 5%), and a cell the allocator then avoids keeps that
        price: simulated (`bench/virtual_device.py`, the H100's costs, 18 ms captures), 256-token
        runs at c = 1-2 left the cells of the first widths verified past the 256 cache rows
        (33 tokens at batch 1, 66 at batch 2) 29-30% over their start-up price, and none moved
        by more than 12% with this rule."""
        self._captured_graph = captured_graph
        self._verify_ms = None if captured_graph else verify_ms

    def choose(
        self,
        trees: TreeBatch,
        caps: Sequence[int],
        captured: Sequence[int] | None = None,
        cut_rows: np.ndarray | None = None,
    ) -> Allocation:
        """Draft nodes per request (`_choose`); its host time is kept apart (module docstring:
        deciding time)."""
        started = time.perf_counter()
        allocation = self._choose(trees, caps, captured, cut_rows)
        self._choose_ms = 1000.0 * (time.perf_counter() - started)
        self._deciding_ms += self._choose_ms
        return allocation

    def _choose(
        self,
        trees: TreeBatch,
        caps: Sequence[int],
        captured: Sequence[int] | None,
        cut_rows: np.ndarray | None,
    ) -> Allocation:
        """Draft nodes per request for trees built at their ceiling (`caps[i]` at most).

        `captured`: the tree-token buckets a graphed target may verify this step's batch in
        (`graph_shapes.allowed_buckets`: its captured graphs and the ceiling's own; None: any of
        `token_buckets`): the widest tree then fills one of them, so the step captures no graph
        but the ceiling's; a step they cut below the gate's ceiling teaches that ceiling no
        step time (it ran a narrower verify).
        `cut_rows[b]`: row b lost its deeper nodes to its request's end (`TreeBatch.within_depth`):
        its nodes still teach the calibrator (a node's acceptance is its path's), but not the
        gate's curve, which stands for whole trees. Cut trees hold shallow siblings where deep
        nodes were, so their positions read low: on the CPU at c = 2 the last steps of one
        batch, learned so, turned the gate plain for the next batch's first 16 steps (a tenth of
        its tokens/s, where drafting wins by a tenth).
        The batch is one matrix (row b: request b's built nodes, best-first, zeros past them):
        the choice runs every step, so its work is a few array operations whatever the batch.
        It chooses from the models as the step before the last left them: the last one's
        lesson waits for this step's verify, whose device work hides it (`learn`)."""
        widest = min(self._ceiling, max(caps, default=0))  # what the step's trees may reach
        self._graph_capped = captured is not None and captured[-1] - 1 < widest
        self._depth_cut = cut_rows is not None and bool(np.any(cut_rows))
        if self.settled and self._weighed is not None and self.layout == "padded":
            settled = self._settled_choice(trees, caps, captured, self._weighed[1])
            if settled is not None:
                self._allocation = settled
                return settled
        lengths = trees.num_nodes - 1
        width = int(lengths.max(initial=0))
        raw = _first_probs(trees.logws[:, 1 : 1 + width], lengths)
        calibrated = self.calibrator.calibrate(raw)  # 0 stays 0: the map is anchored there
        # What `observe` teaches the calibrator and the gate's recent curve (`learn`).
        self._raw_probs, self._built_lengths = raw, lengths
        self._whole_rows = None if cut_rows is None or not np.any(cut_rows) else ~np.asarray(cut_rows)
        draft_ms = self._drafted_step_ms(trees.batch_size)
        if self.layout == "padded":
            caps_np = _row_caps(caps, captured)
            # A row's cap cuts only its own tree: a request at its last token (cap 0) has a
            # root-only tree, which leaves the others' weighing and width as they are.
            uncut = bool(np.all(caps_np >= lengths))
            usable = lengths if uncut else np.minimum(lengths, caps_np)
            self._allocation = allocate_padded_rows(
                calibrated,
                usable,
                self.cost,
                draft_ms=draft_ms,
                token_buckets=self.token_buckets if captured is None else tuple(captured),
                ordered=uncut,  # the calibrated map is monotone: each row keeps its tree's order
                whole=self._learning,  # verified whole: the calibrator learns every built node
            )
            # Every request takes min(width, its nodes): a cut row's count is the width.
            kept_whole = np.array_equal(self._allocation.num_nodes, lengths)
            width = self._ceiling if kept_whole else max(self._allocation.num_nodes)
            if not self.gate.probing_neighbour:
                # A neighbour probe's weighing is its own: the streak it resumes keeps its
                # choice's, so the step after the probe is settled and may arm its cruise at
                # once. Taking the probe's, it weighed again, and only the step after armed it:
                # on an H100 at c = 1-2 each probe was followed by a step that weighed (0.28 ms
                # over a cruise) and a settled one (0.22 ms), every 17 steps.
                # A weighing that kept no draft node (each tree's first node not worth its
                # verify: a steep per-token cost, a tree the drafter doubts) is no width for the
                # streak's steps to reuse unweighed: settled at 0, a drafting streak verified
                # roots only until its recheck (64 steps at batch 1), whatever its trees.
                # Nor is a step so long that weighing it costs little (`SETTLE_BELOW_MS`).
                settles = uncut and width > 0 and self._allocation.step_ms < SETTLE_BELOW_MS
                self._weighed = (self._ceiling, width) if settles else None
        else:
            accept_probs = [row[:length] for row, length in zip(calibrated, lengths.tolist(), strict=True)]
            self._allocation = allocate(accept_probs, caps, self.cost, draft_ms=draft_ms, layout=self.layout)
        return self._allocation

    def _settled_choice(
        self, trees: TreeBatch, caps: Sequence[int], captured: Sequence[int] | None, width: int
    ) -> Allocation | None:
        """A settled step's choice: each request its first min(`width`, built) nodes, unweighed;
        None where a cap (or the widest captured graph) cuts a tree, which the weighing handles.
        Only these nodes are read, their probabilities and forecast not even that until a lesson
        (one settled step in `SETTLED_LESSON_INTERVAL`) or metrics read them: the step is as
        lean as the choice allows."""
        lengths = trees.num_nodes - 1
        if np.any(_row_caps(caps, captured) < lengths):
            return None
        batch_size = len(lengths)
        num_nodes = np.minimum(lengths, width)
        widest = int(num_nodes.max(initial=0))
        logws = trees.logws[:, 1 : 1 + widest]
        # The drafter's probabilities, and the forecast from them, are worked out only where
        # read: by a node lesson (one settled step in `SETTLED_LESSON_INTERVAL`), by metrics.
        self._raw_probs, self._built_lengths, self._whole_rows = None, num_nodes, None
        self._settled_logws = logws
        return Allocation(
            num_nodes=tuple(num_nodes.tolist()),
            forecast=functools.partial(_forecast, logws, num_nodes, self.calibrator.frozen()),
            step_ms=self._drafted_step_ms(batch_size)
            + float(self.cost.verify_ms(batch_size, batch_size * (widest + 1))),
        )

    def _drafted_step_ms(self, batch_size: int) -> float:
        """What a drafted step costs whatever its widths: the drafter's call (this step's, else
        predicted) and the step overhead, which moves the best width."""
        draft_ms = self.cost.draft_ms(batch_size) if self._draft_ms is None else self._draft_ms
        return draft_ms + self.overhead.drafted_ms

    def observe(
        self, trees: TreeBatch, accepted_nodes: Sequence[Sequence[int]], padded_num_nodes: int | None = None
    ) -> BudgetStep:
        """Ends a step: the verified trees and each one's accepted draft nodes (root excluded).
        `padded_num_nodes`: the nodes per tree the verify ran (default: the widest tree's).

        The step's record is made now; what it teaches (only drafted steps teach the calibrator,
        every timed call refreshes the cost curve) waits for `learn`, which a CUDA target runs
        while the next step's verify computes (`AsyncDeviceTarget`), hiding what the device's
        work outlasts; elsewhere the next `observe` learns it.
        """
        self.learn()  # a lesson never waits behind another: they are learned in step order
        batch_size = trees.batch_size
        drafted = self._allocation is not None
        verified = (trees.num_nodes - 1).tolist()  # draft nodes each tree verified
        accepted = tuple(len(nodes) for nodes in accepted_nodes)
        self._accepted_nodes = accepted_nodes
        self.last_step = BudgetStep(
            drafted=drafted,
            num_nodes=tuple(verified),
            # The allocation's own forecast, worked out once for both (a settled step's lazily).
            forecast=(0.0,) * batch_size if self._allocation is None else _forecast_of(self._allocation),
            accepted_per_request=accepted,
            ceiling=self._ceiling if drafted else 0,
        )
        nodes = None
        if drafted:
            self._num_drafted_steps += 1
        interval = SETTLED_LESSON_INTERVAL if self.settled else NODE_LESSON_INTERVAL
        teaches_nodes = drafted and (
            self._num_calibrations < EARLY_CALIBRATIONS
            or self.probing
            or self.gate.probing_neighbour
            or self._learning
            or self._num_drafted_steps % interval == 0
            or self._lessons_are_cheap()
        )
        if teaches_nodes:
            nodes = _DraftedNodes(
                build_ms=self._build_ms,
                built_lengths=self._built_lengths,
                raw_probs=(
                    self._raw_probs
                    if self._raw_probs is not None
                    else _first_probs(self._settled_logws, self._built_lengths)
                ),
                verified=verified,
                accepted_nodes=accepted_nodes,
                whole_rows=self._whole_rows,
                row_weights=self._row_weights,
            )
        # A settled step teaches nothing but its wall time (`record_step_ms`, the gate's ratio
        # of its ceiling): its forwards' times are the streak's, which its other steps teach the
        # cost curve, and on the H200's host at batch 1 the lesson was 0.1 ms of a 2.8 ms step
        # that the launch-bound verify did not hide.
        self._lesson = (
            None
            if self.settled and drafted and nodes is None
            else _Lesson(
                batch_size=batch_size,
                target_tokens=batch_size * (padded_num_nodes or max(verified) + 1),  # the verify's forward
                draft_ms=None if self._catching_up or self._draft_with_plan else self._draft_ms,
                verify_ms=self._verify_ms,
                nodes=nodes,
                probe=self.probing,
            )
        )
        # Not while a lesson waits: learned inside the next verify (on CUDA), it may move the
        # prices the held steps ahead were counted with.
        if (
            self.settled
            and drafted
            and self._weighed is not None
            and self._lesson is None
            and not self._lessons_are_cheap()
        ):
            ahead = self.gate.steps_held_ahead()
            if ahead > 0:
                self._cruise = _Cruise(
                    self._ceiling, self._weighed[1], batch_bucket(batch_size), self._cap_bucket, ahead
                )
        self._priced_ms = None
        if not self._catching_up and not self._captured_graph:
            self._priced_ms = sum(ms for ms in (self._draft_ms, self._build_ms, self._verify_ms) if ms)
        self._draft_ms = self._build_ms = self._verify_ms = self._allocation = None
        self._catching_up = self._captured_graph = False
        return self.last_step

    def _tokens_within(self, step: BudgetStep) -> dict[int, int]:
        """Tokens the observed step's trees would have made cut to each power of two below its
        ceiling (`_tokens_within_nodes`; `DraftGate.record_step_ms`)."""
        return self._tokens_within_nodes(self._ceiling, max(step.num_nodes, default=0), self._accepted_nodes)

    def _tokens_within_nodes(
        self, ceiling: int, widest_tree: int, accepted_nodes: Sequence[Sequence[int]]
    ) -> dict[int, int]:
        """Tokens a step's trees would have made cut to each power of two below `ceiling` (and
        within `widest_tree`, the most draft nodes a tree verified, whose prefixes they are): a
        best-first tree's first c nodes are the tree ceiling c builds, and its path's nodes
        inside them (their indices rise along the path) are what that tree accepts, the target's
        walk and coins being the same up to them; each request adds its bonus. Padded trees
        only: a packed allocation's rows are not prefixes of one width."""
        if self.layout != "padded":
            return {}
        widest = min(ceiling - 1, widest_tree)
        ceilings = [c for c in powers_of_two_upto(widest) if c <= widest]
        if not ceilings:
            return {}
        # A few accepted nodes a request: lists, not arrays (on the CI CPU the arrays' sort and
        # search took 60 us of a step's policy time, in a step that does not otherwise use them).
        accepted = sorted(itertools.chain.from_iterable(accepted_nodes))
        batch_size = len(accepted_nodes)
        return {c: bisect.bisect_right(accepted, c) + batch_size for c in ceilings}

    def _lessons_are_cheap(self) -> bool:
        """Whether a node lesson costs at most `lesson_share` of a drafted step (`LESSON_SHARE`)."""
        known = self._lesson_ms > 0.0 and self._drafted_step_wall_ms > 0.0
        return known and self._lesson_ms <= self.lesson_share * self._drafted_step_wall_ms

    def learn(self) -> None:
        """Apply the last observed step's lesson, if it is still pending: the cost curve and the
        build cost from its timings, the calibrator from its verified nodes; and a drafting
        cruise's waiting lessons, once `CRUISE_LESSON_BATCH` of them wait or the cruise is over.
        The engine calls it while the device computes: with a CUDA draft, between the drafter's
        launch and the copy of its top-K (lessons come one drafted step in
        `NODE_LESSON_INTERVAL`, so its mean is under a tenth of a millisecond on the H200's host;
        the verify, launch-bound at small batches, hid it only in part), else during the next
        step's verify (an `AsyncDeviceTarget`'s wait) or at the next `observe`, so `plan` decides
        one step behind, but learns first for the first curve and after a probe; `observe` calls
        it first, so lessons are learned in step order.
        A cruise's last planned step (`steps_left == 1`: the next one decides) teaches the
        lessons still waiting here, inside its own draft or verify, so that `plan` does not: on
        the H200 at c = 2 the lessons `plan` taught first were part of its 0.6-0.8 ms at each
        decision after a cruise, before the draft was launched (`bench/step_stages.py`)."""
        if (
            self._cruise is None
            or len(self._cruise_lessons) >= CRUISE_LESSON_BATCH
            or self._cruise.steps_left == 1
        ):
            self._learn_cruise()
        lesson, self._lesson = self._lesson, None
        if lesson is None:
            return
        if lesson.verify_ms is not None:
            self.cost.observe_verify(lesson.batch_size, lesson.target_tokens, lesson.verify_ms)
        if lesson.draft_ms is not None:
            self.cost.observe_draft(lesson.batch_size, lesson.draft_ms)
        nodes = lesson.nodes
        if nodes is None:
            return
        started = time.perf_counter()
        self._learn_nodes(lesson, nodes)
        self._lesson_ms = _ema_from_first(self._lesson_ms, 1000.0 * (time.perf_counter() - started))

    def _learn_cruise(self) -> None:
        """Teach the gate the waiting whole cruising steps' tokens and their prefixes', in step
        order (`cruised`)."""
        lessons, self._cruise_lessons = self._cruise_lessons, []
        for lesson in lessons:
            widest_tree = int(lesson.num_nodes.max()) - 1
            rows = lesson.accept_index.tolist()
            accepted_nodes = [row[1 : 1 + n] for row, n in zip(rows, lesson.accepted, strict=True)]
            within = self._tokens_within_nodes(lesson.ceiling, widest_tree, accepted_nodes)
            batch_size = len(lesson.accepted)
            self.gate.record_cruise_tokens(batch_size, sum(lesson.accepted) + batch_size, within)

    def _learn_nodes(self, lesson: "_Lesson", nodes: "_DraftedNodes") -> None:
        """A drafted step's nodes: the gate's curve, the build cost and the calibrator."""
        rows = slice(None) if nodes.whole_rows is None else nodes.whole_rows  # all cut: no lesson
        weights = nodes.row_weights
        if lesson.probe or (weights is not None and len(weights) != len(nodes.built_lengths)):
            weights = None  # a probe's rows: its drafted requests first, in another order
        self.gate.record_curve(
            nodes.raw_probs[rows],
            nodes.built_lengths[rows],
            self.calibrator.calibrate,
            weights=None if weights is None else weights[rows],
        )
        if nodes.build_ms is not None:
            built = nodes.built_lengths
            self.build.observe(lesson.batch_size, int(built.sum()), int(built.max(initial=0)), nodes.build_ms)
        # The verified trees are prefixes of the built ones: their nodes' drafter
        # probabilities are the first `num_nodes - 1` of each built tree's row.
        lengths = np.asarray(nodes.verified)
        assert len(lengths) == len(nodes.built_lengths) and np.all(lengths <= nodes.built_lengths), (
            "observe takes prefixes of the trees `choose` saw, in its order"
        )
        verified_mask = np.arange(nodes.raw_probs.shape[1]) < lengths[:, None]
        hits = np.zeros(nodes.raw_probs.shape, dtype=bool)
        rows = [row for row, accepted in enumerate(nodes.accepted_nodes) for _ in accepted]
        # Node indices count from the root.
        cols = [node - 1 for accepted in nodes.accepted_nodes for node in accepted]
        hits[rows, cols] = True
        self._calibration_batch.append((nodes.raw_probs[verified_mask], hits[verified_mask]))
        # Early on, and at a probe between plain steps, each step is much of what is known: it
        # is learned at once (a plain streak would otherwise wait four probes for its update).
        early = self._num_calibrations < EARLY_CALIBRATIONS
        if early or lesson.probe or len(self._calibration_batch) >= CALIBRATION_STEPS:
            self._num_calibrations += 1
            probs, accepted = (np.concatenate(parts) for parts in zip(*self._calibration_batch, strict=True))
            self.calibrator.observe(probs, accepted, steps=len(self._calibration_batch))
            self.calibrator.refresh()
            self._calibration_batch = []

    def record_step_ms(self, step_ms: float, draft_unused: bool = False) -> None:
        """The observed step's wall time (after its prefills): teaches the step overhead, and a
        probe after plain steps its cost (`DraftGate.record_probe_ms`). A plain streak's step
        arms a cruise of the steps it keeps unasked (`PLAIN_CRUISE_STEPS`). `draft_unused`: the
        step's draft was launched ahead of a plan that chose a plain step (`drafts_ahead`):
        the drafter call's price comes off its time, which is taught as a plain step's."""
        if draft_unused and self.last_step is not None:
            step_ms = max(step_ms - self.cost.draft_ms(len(self.last_step.num_nodes)), 0.0)
        if self.last_step is not None and self.last_step.drafted:
            self.gate.record_probe_ms(len(self.last_step.num_nodes), step_ms)  # a probe's only
            self._drafted_step_wall_ms = _ema_from_first(self._drafted_step_wall_ms, step_ms)
        if self.last_step is not None and self._priced_ms is not None:
            self.overhead.observe(self.last_step.drafted, step_ms - self._priced_ms)
            drafted = self.last_step.drafted
            mean = self._mean_deciding_ms[drafted]
            mean += DECIDING_MEAN_WEIGHT * (self._deciding_ms - mean)
            self._mean_deciding_ms[drafted] = mean
            # Not when the drafter was lost, nor when captured graphs cut the ceiling's trees.
            if drafted == (self._ceiling > 0) and not self._graph_capped:
                step = self.last_step
                tokens = None if self._depth_cut else step.accepted + len(step.num_nodes)
                within = None if tokens is None or not drafted else self._tokens_within(step)
                self.gate.record_step_ms(step_ms - self._deciding_ms + mean, tokens, within)
        self._priced_ms = None
        self._deciding_ms = self._choose_ms = 0.0  # a step without `plan` (drafter lost) decides nothing
        planned, self._planned = self._planned, False
        if planned and self.last_step is not None and not self.last_step.drafted and self._ceiling == 0:
            # The step's verify time first: the cruise holds the price it moves (a plain lesson
            # is the cost curve's only). Its batch exactly: a plain streak's price is read at
            # the batch now (`DraftGate`).
            self.learn()
            ahead = min(self.gate.plain_steps_held_ahead(self.cost, self.overhead), PLAIN_CRUISE_STEPS)
            batch_size = len(self.last_step.num_nodes)
            if ahead > 0:
                self._cruise = _Cruise(0, 0, batch_bucket(batch_size), self._cap_bucket, ahead, batch_size)


def _forecast_of(allocation: Allocation) -> Forecast:
    """What a step's record reads its forecast from: the allocation's tuple, or its cached
    `expected_accepted` when first read (one computation for both)."""
    forecast = allocation.forecast
    return (
        forecast
        if isinstance(forecast, tuple)
        else functools.partial(getattr, allocation, "expected_accepted")
    )


def _row_caps(caps: Sequence[int], captured: Sequence[int] | None) -> np.ndarray:
    """Each request's draft nodes at most: its cap, and the widest tree a captured verify graph
    holds (`captured`: the step's allowed buckets, None: any). A row's cap cuts its own tree only."""
    row_caps = np.maximum(np.asarray(caps), 0)
    return row_caps if captured is None else np.minimum(row_caps, captured[-1] - 1)


def _first_probs(logws: np.ndarray, num_nodes: np.ndarray) -> np.ndarray:
    """Drafter probabilities of row b's first `num_nodes[b]` draft nodes, zeros past them
    (`logws`: each row's draft nodes' log-weights, best-first)."""
    return np.exp(logws) * (np.arange(logws.shape[1]) < num_nodes[:, None])


def _forecast(
    logws: np.ndarray, num_nodes: np.ndarray, calibrate: Callable[[np.ndarray], np.ndarray]
) -> tuple[float, ...]:
    """Calibrated expected accepted draft tokens of each row's first `num_nodes[b]` nodes."""
    return tuple(calibrate(_first_probs(logws, num_nodes)).sum(axis=1).tolist())


def _ema_from_first(mean: float, sample: float) -> float:
    """`LESSON_WEIGHT`'s EMA of milliseconds, its first sample taken whole (0: none yet)."""
    return mean + LESSON_WEIGHT * (sample - mean) if mean else sample


@dataclass
class _Cruise:
    """A settled or plain streak's steps run without deciding (`AdaptiveBudget.cruise_width`)."""

    ceiling: int
    width: int  # draft nodes per tree, the streak's last weighing's (0: a plain streak's)
    batch_bucket: int  # the batch bucket the streak holds in (or below) and its widest cap's
    cap_bucket: int
    steps_left: int
    batch_size: int | None = None  # the batch it holds at exactly (a plain streak's), None: any to its bucket
    in_tail: bool = False  # kept past its steps to its requests' ends (`DraftGate.ends_within_tail`)


@dataclass(frozen=True)
class _CruiseLesson:
    """A whole cruising step's trees as the gate learns them (`AdaptiveBudget.cruised`)."""

    ceiling: int  # the streak's
    num_nodes: np.ndarray  # each tree's verified nodes, root included
    accepted: tuple[int, ...]  # accepted draft tokens per request
    accept_index: np.ndarray  # [B, 1 + depth] accepted node indices, root first


@dataclass(frozen=True)
class _DraftedNodes:
    """What a drafted step's trees teach: the build's time and the calibrator's nodes."""

    build_ms: float | None
    built_lengths: np.ndarray  # draft nodes built per request
    raw_probs: np.ndarray  # their drafter probabilities [B, built]
    verified: list[int]  # draft nodes each request verified (a prefix of its built ones)
    accepted_nodes: Sequence[Sequence[int]]  # per request, accepted node indices (root = 0)
    whole_rows: np.ndarray | None = None  # [B] rows no request's end cut, the curve's (None: all)
    row_weights: np.ndarray | None = None  # [B] the rows' weights in a draining batch (None: alike)


@dataclass(frozen=True)
class _Lesson:
    """What one observed step teaches the models, kept from `observe` until `learn`."""

    batch_size: int
    target_tokens: int
    draft_ms: float | None
    verify_ms: float | None
    nodes: _DraftedNodes | None  # None: a plain step (it teaches the cost curve only)
    probe: bool  # a probe after plain steps
