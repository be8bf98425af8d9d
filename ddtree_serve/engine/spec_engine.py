"""`SpecEngine`: the speculative decoding step loop over a `Drafter` and a `Target`.

One step, for every running request at once, in the stages of `STEP_STAGES`:
    schedule -> prefill newcomers -> draft -> build trees -> verify (the target walks the
    trees and commits the accepted KV) -> append (accepted tokens to the requests, check stops)
    -> postprocess (free finished slots, outputs)
Mode "ar" skips the drafter: each tree is its root alone, verified through the same path, so
one loop serves plain decoding, chains and DDTrees. With `budget_policy="adaptive"` (ddtree) an
`AdaptiveBudget` decides per step how wide to draft and build (the ceiling; 0 = do not draft)
and how many of each request's best-first nodes to verify (a prefix of the tree built at the
ceiling); a step that does not draft verifies root-only trees, and the drafter later takes
every context slice it missed.

Over a transport that chains a draft to a verify (`DraftChainingTarget`: the compiled step
graph) and with `chain_drafts`, the serial step with a fixed budget hands each verify the next
draft of its requests, which the drafter runs from the verdict before the step returns: the
next step starts with its draft done (newcomers draft on their own), and a step costs one round
trip to the actors.

A lost drafter (`DrafterUnavailableError`) costs speed only: the loop goes on as in mode "ar"
until the drafter is available again, then the target re-encodes every running request's
cached text into a whole new context for it (`_restore_drafter`), and speculation resumes.
"""

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch
from tokenizers import Tokenizer

from ddtree_serve.engine.budget import (
    AdaptiveBudget,
    ModelCostProbe,
    buckets_upto,
    load_cost_curve,
    measure_build_cost,
    measure_cost_curve,
    powers_of_two_upto,
)
from ddtree_serve.engine.graph_shapes import VerifyGraphShapes
from ddtree_serve.engine.graph_warmup import WARMUP_PROMPT_TOKENS, warm_up_graphs, warmup_shapes
from ddtree_serve.engine.interfaces import (
    AsyncDeviceTarget,
    ContextSlice,
    DraftChainingTarget,
    Drafter,
    DrafterUnavailableError,
    DraftInput,
    DraftOutput,
    EncodeInput,
    Pending,
    PipelinedDrafter,
    PipelinedTarget,
    PrefillInput,
    Ready,
    SamplingBatch,
    Target,
    VerifyInput,
    VerifyOutput,
)
from ddtree_serve.engine.request import Request, RequestOutput
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.scheduler import ScheduledStep, Scheduler
from ddtree_serve.engine.settings import EngineSettings
from ddtree_serve.engine.stop import StopChecker
from ddtree_serve.engine.timing import Stage, StageTimer
from ddtree_serve.engine.tree_builder import (
    BuiltTrees,
    TreeBuilder,
    build_host_tree_batch,
    topk_on_host,
)
from ddtree_serve.models.cuda_graphs import BATCH_BUCKETS
from ddtree_serve.tree import TreeBatch

logger = logging.getLogger(__name__)


PROBE_REQUESTS = 4
"""Requests a probe after plain steps drafts (`SpecEngine._probe_requests` picks them)."""

DRAIN_QUIET_STEPS = 4
"""Steps without a request added, and none waiting, after which the running batch counts as
draining: an adaptive policy that weighs a drain (`AdaptiveBudget.weighs_drain`, `DRAIN_POWER`)
is then told each request's expected steps to finish (`AdaptiveBudget.plan`), since what is left
ends with its slowest request. A server held at its load adds a request every step or two (a
finished one's slot taken); a closed batch adds none after its first."""


class SpecEngine:
    """Continuous-batching speculative decoding; not thread-safe (drive it from one thread)."""

    def __init__(
        self,
        settings: EngineSettings,
        target: Target,
        drafter: Drafter | None,
        tokenizer: Tokenizer,
        timer: StageTimer | None = None,
        tree_builder: TreeBuilder | None = None,
        overlap: bool = False,
        budget_policy: AdaptiveBudget | None = None,
        chain_drafts: bool = False,
    ) -> None:
        """`tree_builder`: where the build stage runs (default: the host; `TreeBuilder("device")`
        builds where the draft lies). `overlap`: two micro-batches in flight (`_overlapped_step`),
        for a target and a drafter that run at the same time (`PipelinedTarget` /
        `PipelinedDrafter`); over blocking seams it only reorders the same calls.
        `budget_policy`: the adaptive policy of an engine this one replaces over the same workers
        (its measured costs and calibration carry over); None = calibrate anew. `chain_drafts`:
        chain each serial step's next draft to its verify where the target can
        (`DraftChainingTarget`, fixed budget, no overlap); False: two calls a step."""
        if settings.mode != "ar" and drafter is None:
            raise ValueError(f"mode {settings.mode!r} needs a drafter")
        self.settings = settings
        self.target = target
        self.drafter = drafter if settings.mode != "ar" else None
        self.tokenizer = tokenizer
        self.timer = timer or StageTimer(enabled=settings.record_timings)
        self.tree_builder = tree_builder or TreeBuilder()
        self.vocab_size = target.vocab_size
        self.block_size = 1 if self.drafter is None else self.drafter.block_size
        # Cache rows one step's padded tree may take past the cached prefix (root included).
        self.max_tree_tokens = {"ar": 1, "chain": self.block_size}.get(settings.mode, settings.budget + 1)
        self.max_seq_len = min(settings.max_seq_len, target.max_seq_len)
        # Longest prompt that leaves room for one step's tree: the one limit servers enforce too.
        self.max_prompt_tokens = self.max_seq_len - self.max_tree_tokens
        if self.max_prompt_tokens < 1:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} leaves no room for a prompt beside one step's tree "
                f"of {self.max_tree_tokens} positions (mode {settings.mode!r}): raise max_seq_len"
                + (" or lower budget" if settings.mode == "ddtree" else "")
            )
        self.scheduler = Scheduler(
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_queue_len=settings.max_queue_len,
            tree_tokens=self._tree_tokens,
        )
        self.stop_checker = StopChecker(tokenizer, target.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        # The drafter holds every running request's context up to its last draft; False from a
        # `DrafterUnavailableError` until `_restore_drafter` has handed it whole contexts again.
        self._drafter_in_sync = self.drafter is not None
        self.num_drafter_losses = 0
        # Called with the first-token outputs of a step's prefills as soon as they exist, before
        # the step drafts and verifies (a streaming caller's time to first token); None: they come
        # with the step's other outputs.
        self.on_first_tokens: Callable[[list[RequestOutput]], None] | None = None
        self.budget_policy = None
        # An adaptive policy calibrated here has run every verify and draft shape (its graphs
        # captured); a fixed budget, a cost file's policy or one kept over a restarted target
        # (whose graphs died with it) captures them now.
        calibrated = False
        if settings.budget_policy == "adaptive":
            calibrated = budget_policy is None and settings.cost_curve is None
            self.budget_policy = budget_policy or self._adaptive_budget()
            self.budget_policy.end_cruise()  # a kept policy's cruise was another engine's streak
            if self.budget_policy.graph_shapes is None and target.verify_token_buckets is not None:
                shapes = VerifyGraphShapes(target.verify_token_buckets, target.max_seq_len)
                self.budget_policy.graph_shapes = shapes
        if target.verify_token_buckets is not None and not calibrated:
            self._warm_up_graphs(target.verify_token_buckets)
        if overlap and (self.drafter is None or self.budget_policy is not None):
            raise ValueError("overlap needs a drafter and the fixed budget policy")
        self.overlap = overlap
        self.chains_drafts = (
            chain_drafts
            and isinstance(target, DraftChainingTarget)
            and self.drafter is not None
            and self.budget_policy is None
            and not overlap
        )
        # The draft in flight for the next step: overlap's first micro-batch, or the draft chained
        # to the last serial verify (None: none yet).
        self._carried: _CarriedDraft | None = None
        # The adaptive step's requests, their keepable depths and caps (`_adaptive_inputs_of`).
        self._adaptive_inputs: tuple[list[Request], list[int], list[int]] | None = None
        self._cruise_step: _CruiseStep | None = None  # this step's, when the policy cruises
        # The last draft came back on a device (its kernels queued, not done): the adaptive step
        # may launch its draft before it plans (`_draft`).
        self._device_drafts = False
        self._draft_unused = False  # this step's draft, launched before its plan, went unused
        # This step's verify met a graph key first: the target captured it, and the policy
        # learns no price from its time (`AdaptiveBudget.record_verify_ms`).
        self._verify_captures = False
        self._steps_since_arrival = 0  # steps since a request was last added (`DRAIN_QUIET_STEPS`)

    def _warm_up_graphs(self, token_buckets: tuple[int, ...]) -> None:
        """Capture the graphs every step shape meets (`graph_warmup`); an adaptive policy learns
        that they exist (`VerifyGraphShapes`), as its calibration's would."""
        shapes = warmup_shapes(
            token_buckets,
            self.settings.max_num_seqs,
            self.max_tree_tokens,
            drafts=self.drafter is not None,
            vocab_size=self.vocab_size,
        )
        warm_up_graphs(self.target, self.drafter, shapes)
        if self.graph_shapes is not None:
            self.graph_shapes.record_all(shapes.verifies, WARMUP_PROMPT_TOKENS)

    @property
    def graph_shapes(self) -> VerifyGraphShapes | None:
        """The verify graphs a graphed target holds, for the adaptive choice to keep to (the
        policy's record: they are the target's)."""
        return None if self.budget_policy is None else self.budget_policy.graph_shapes

    def _adaptive_budget(self) -> AdaptiveBudget:
        """The adaptive policy over the configured cost file, or a curve measured now (slots empty)."""
        if self.settings.mode != "ddtree" or self.drafter is None:
            raise ValueError("budget_policy 'adaptive' needs mode 'ddtree'")
        probe = ModelCostProbe(self.target, self.drafter, top_k=min(self.settings.budget, self.vocab_size))
        buckets = self.target.verify_token_buckets
        batch_sizes = powers_of_two_upto(self.settings.max_num_seqs)
        build = measure_build_cost(probe, batch_sizes, powers_of_two_upto(self.settings.budget))
        if self.settings.cost_curve is not None:  # no graph captured yet: the caller records them
            return AdaptiveBudget(load_cost_curve(self.settings.cost_curve), build, token_buckets=buckets)
        shapes = None if buckets is None else VerifyGraphShapes(buckets, self.target.max_seq_len)
        tree_tokens = powers_of_two_upto(self.max_tree_tokens)
        if buckets is not None:
            # A graphed target: calibrate at its graphs' own buckets, which captures now every
            # graph a step can meet (one captured mid-run costs a dozen plain steps).
            batch_sizes = buckets_upto(BATCH_BUCKETS, self.settings.max_num_seqs)
            tree_tokens = buckets_upto(buckets, self.max_tree_tokens)
        cost = measure_cost_curve(probe, batch_sizes, tree_tokens)
        if shapes is not None:  # the calibration's verifies captured these graphs
            shapes.record_all(itertools.product(batch_sizes, tree_tokens), len(probe.prompt))
        return AdaptiveBudget(cost, build, token_buckets=buckets, graph_shapes=shapes)

    # ----------------------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> None:
        """Queue a request; raises `QueueFullError` when the queue is full, ValueError if invalid."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = (
            self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else [int(t) for t in prompt]
        )
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(prompt_ids) > self.max_prompt_tokens:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room to generate within "
                f"max_seq_len={self.max_seq_len} (one step's tree takes {self.max_tree_tokens} of "
                f"its positions: at most {self.max_prompt_tokens} prompt tokens fit)"
            )
        # max_tokens capped so every padded tree still fits in the slot: before a step the slot
        # caches prompt + output - 1 tokens and the verify pass writes up to `max_tree_tokens`
        # rows after them.
        room = self.max_seq_len - len(prompt_ids) - self.max_tree_tokens + 1
        budget = self.settings.budget  # the engine's budget is also the ceiling (cache room)
        request = Request(
            request_id,
            prompt_ids,
            params,
            max_output_tokens=max(1, min(params.max_tokens, room)),
            tree_budget=min(params.draft_budget or budget, budget),
        )
        self.scheduler.add(request)
        self._requests[request_id] = request
        self._steps_since_arrival = 0

    def abort_request(self, request_id: str) -> None:
        """End a request now; its final output (reason "abort") comes with the next step."""
        request = self._requests.get(request_id)
        if request is None or request.finished:
            return
        if request.slot is None:
            self.scheduler.remove_waiting(request)
        else:
            self._release(request)
        request.finish("abort")
        self._aborted.append(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def speculating(self) -> bool:
        """Whether steps draft (False in mode "ar" and while the drafter is lost)."""
        return self._drafter_in_sync

    # ----------------------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """Advance every running request by one verify step; return their new outputs (less the
        prefills' first tokens when `on_first_tokens` took them already)."""
        self._adaptive_inputs = None  # worked out again for this step's requests
        self._cruise_step = None
        self._draft_unused = False
        self._steps_since_arrival += 1
        with self.timer.stage(Stage.SCHEDULE):
            scheduled = self.scheduler.schedule()
        if scheduled.prefills:
            with self.timer.stage(Stage.PREFILL):
                self._prefill(scheduled.prefills)
            if self.on_first_tokens is not None:
                # A request that finished at its first token is reported (and freed) at the end.
                first = [r.take_output() for r in scheduled.prefills if not r.finished]
                if first:
                    self.on_first_tokens(first)
        running = [r for r in scheduled.running if not r.finished]  # some stop at their first token
        started = time.perf_counter()
        if running and self.overlap and self._drafter_in_sync:
            self._overlapped_step(running)
        elif running:
            with self.timer.stage(Stage.DRAFT):
                running, draft = self._serial_draft(running)
            with self.timer.stage(Stage.BUILD):
                trees = self._build(running, draft)
            with self.timer.stage(Stage.VERIFY):
                verdict = self._verify(running, trees)
            with self.timer.stage(Stage.APPEND):
                self._append(running, trees, verdict)
        outputs = self._postprocess(scheduled)
        if running and self.budget_policy is not None and self._cruise_step is None:
            step_ms = 1000.0 * (time.perf_counter() - started)
            self.budget_policy.record_step_ms(step_ms, draft_unused=self._draft_unused)
        return outputs

    def _prefill(self, requests: list[Request]) -> None:
        """Cache the newcomers' prompts, take their first token and their drafter context."""
        sampling = _sampling_batch([r.params for r in requests], self.vocab_size)
        coins = None if sampling.all_greedy else torch.stack([_uniforms(r, 1)[0] for r in requests])
        slots, prompts = [_slot(r) for r in requests], [r.prompt_token_ids for r in requests]
        output = self.target.prefill(PrefillInput(slots, prompts, sampling, coins))
        first_tokens = output.first_tokens.tolist()
        for i, request in enumerate(requests):
            request.num_cached_tokens = output.num_cached_tokens[i]
            request.bonus_token = first_tokens[i]
            request.pending_contexts = [ContextSlice(output.context, i)]
            self.stop_checker.append(request, [first_tokens[i]], request.max_output_tokens)

    def _serial_draft(self, running: list[Request]) -> tuple[list[Request], DraftOutput | None]:
        """The serial step's requests (the chained draft's first) and their draft.

        With a draft chained to the last verify, its requests still running take their rows of
        it and the rest (newcomers) draft in one call of their own at the same fixed K."""
        if self._carried is None or not self.chains_drafts:
            self._carried = None  # overlap's, after a lost drafter: the restore hands new contexts
            return self._draft(running)
        first, draft = self._take_carried(running)
        in_first = {id(r) for r in first}
        rest = [r for r in running if id(r) not in in_first]
        if rest and self._drafter_in_sync:  # else lost with the chained draft: draft is None
            extra = self._await_draft(rest, self._submit_draft(rest))
            draft = None if draft is None and first else _cat_drafts(draft, extra)
        return [*first, *rest], draft

    def _draft(self, running: list[Request]) -> tuple[list[Request], DraftOutput | None]:
        """The step's requests and one drafter call's draft for them, or for the first of them
        (a probe's); K is the largest any request's tree can use.

        No draft (root-only trees: plain decoding) without a drafter, or while it is lost.
        Where the adaptive policy all but surely drafts again (`AdaptiveBudget.drafts_ahead`)
        and the drafter computes on a device, the draft is launched before `plan`, at the
        widest K, and cut to the plan's K after it (the ranks come descending): the decision's
        host time runs while the device drafts.
        """
        requests = running
        restoring = not self._drafter_in_sync  # a drafter back from a loss takes whole contexts
        if self.drafter is None or not self._drafter_ready(self.drafter, requests):
            return running, None
        policy = self.budget_policy
        cruise = None if policy is None else self._start_cruise(requests)
        if cruise is not None and cruise.width == 0:
            return running, None  # a plain streak's cruise
        top_k = 1 if self.settings.mode == "chain" else max(self._top_k(r) for r in requests)
        # A draft that takes a prompt's context (a newcomer's first) or several steps' (after
        # plain steps) is not what a step at its ceiling costs: the policy learns no cost from it.
        catching_up = restoring or any(r.steps == 0 or len(r.pending_contexts) > 1 for r in requests)
        if cruise is not None:
            top_k = min(top_k, cruise.width)
        elif policy is not None:
            caps = self._adaptive_inputs_of(requests)[1]
            # Not for a drafter back from a loss (whole contexts), nor where no request can keep
            # a draft token (the plan can only be plain).
            ahead = self._device_drafts and not restoring and policy.drafts_ahead and any(caps)
            started = time.perf_counter()
            draft = self._call_drafter(requests, top_k) if ahead else None
            if ahead and draft is None:
                return running, None  # the drafter was lost
            steps_to_finish = self._steps_to_finish(requests) if policy.weighs_drain else None
            ceiling = policy.plan(caps, hidden=ahead, steps_to_finish=steps_to_finish)
            if draft is not None and ceiling == 0:  # a plain step after all: the draft goes unused
                self._draft_unused = True
                # Its end awaited here, so that the plain verify's time is the verify's alone.
                topk_on_host(draft.logp[..., :1], draft.ids[..., :1])
                if catching_up:  # its time is no one step's draft: the step teaches no cost
                    policy.record_draft_ms(0.0, catching_up=True)
                self._take_contexts(requests, draft)
                return running, None
            top_k = min(top_k, policy.settled_width or ceiling)
            if draft is not None:  # its best ranks, as a draft at the plan's K would have
                draft = DraftOutput(draft.logp[..., :top_k], draft.ids[..., :top_k], draft.num_context_tokens)
                return running, self._drafted(requests, draft, started, catching_up, with_plan=True)
            if ceiling == 0:
                return running, None
            if policy.probing:
                # A probe after plain steps only refreshes the acceptance curve: a few requests
                # tell it, and only they pay the drafter's catch-up on the context they skipped.
                requests = self._probe_requests(running)
                drafted = {id(r) for r in requests}
                running = [*requests, *(r for r in running if id(r) not in drafted)]
        started = time.perf_counter()
        draft = self._call_drafter(requests, top_k)
        if draft is None:
            return running, None
        return running, self._drafted(requests, draft, started, catching_up)

    def _call_drafter(self, requests: list[Request], top_k: int) -> DraftOutput | None:
        """One drafter call over `requests`' undrafted contexts (None: the drafter was lost,
        the step is a plain one now)."""
        contexts = [tuple(r.pending_contexts) for r in requests]
        assert all(contexts), "every running request has undrafted context"
        bonus_tokens = torch.tensor([r.bonus_token for r in requests], dtype=torch.int64)
        draft_input = DraftInput([_slot(r) for r in requests], bonus_tokens, contexts, top_k)
        try:
            draft = self.drafter.draft(draft_input)
        except DrafterUnavailableError as error:
            self._lose_drafter(error)
            self._cruise_step = None  # the step is a plain one now, recorded as such
            return None
        self._device_drafts = draft_on_device(draft)
        return draft

    def _drafted(
        self,
        requests: list[Request],
        draft: DraftOutput,
        started: float,
        catching_up: bool,
        with_plan: bool = False,
    ) -> DraftOutput:
        """A drafter call's draft, its contexts taken: with the adaptive policy (not cruising)
        its top-K on the host and its time recorded, from `started` (the call's launch;
        `with_plan`: the plan ran within it)."""
        policy = self.budget_policy
        if policy is not None and self._device_drafts:  # `_call_drafter`'s word on this draft
            # The last step's lesson while the drafter's kernels run: the top-K copy waits for
            # them (on the H200 at batch 1 half a millisecond), and the verify, launch-bound
            # there, hid it only in part. A cruising step's too (the cruise before it): learned
            # in the verify, it took 0.14 ms of an H100 cruising step's verify at batch 1.
            policy.learn()
        if policy is not None and self._cruise_step is None:
            # The top-K to the host (the build's one copy, made here), so the drafter's time is
            # the draft stage's.
            logp, ids = topk_on_host(draft.logp, draft.ids)
            draft = DraftOutput(logp, ids, draft.num_context_tokens)
            draft_ms = 1000.0 * (time.perf_counter() - started)
            policy.record_draft_ms(draft_ms, catching_up=catching_up or policy.probing, with_plan=with_plan)
        self._take_contexts(requests, draft)
        return draft

    @staticmethod
    def _take_contexts(requests: list[Request], draft: DraftOutput) -> None:
        """The drafter holds `requests`' contexts up to this draft: none is pending any more."""
        for request in requests:
            request.pending_contexts = []
        _check_positions(requests, draft.num_context_tokens)

    # ------------------------------------------------------------------ the overlapped step

    def _overlapped_step(self, running: list[Request]) -> None:
        """Draft, build, verify and append every running request once, in two micro-batches.

        The first micro-batch's draft was submitted at the end of the previous step (the
        carried draft, plus a top-up draft when the second outnumbers it); the target verifies
        the first while the drafter drafts the second, then verifies the second while the
        drafter drafts the first's next block. Each request's draft, tree, coins and verify are
        the ones the plain step makes (K is fixed at the engine's budget so drafts of different
        calls share a shape), so the tokens are too; only the calls interleave.
        """
        with self.timer.stage(Stage.DRAFT):
            first, first_draft = self._take_carried(running)
            in_first = {r.request_id for r in first}
            second = [r for r in running if r.request_id not in in_first]
            top_up = second[: (len(second) - len(first)) // 2] if self._drafter_in_sync else []
            if top_up:
                second = second[len(top_up) :]
                extra = self._await_draft(top_up, self._submit_draft(top_up))
                first_draft = None if first_draft is None and first else _cat_drafts(first_draft, extra)
                first = [*first, *top_up]
        pending_second = self._submit_draft(second) if second and self._drafter_in_sync else None
        if first:
            with self.timer.stage(Stage.BUILD):
                first_trees = self._build(first, first_draft)
            with self.timer.stage(Stage.VERIFY):
                first_verdict = self._submit_verify(first, first_trees).result()
            with self.timer.stage(Stage.APPEND):
                self._append(first, first_trees, first_verdict)
        pending_verify = None
        if second:
            second_draft = None if pending_second is None else self._await_draft(second, pending_second)
            with self.timer.stage(Stage.BUILD):
                second_trees = self._build(second, second_draft)
            pending_verify = self._submit_verify(second, second_trees)
        # The first micro-batch's next draft runs while the target verifies the second; it
        # takes at most half the batch, the rest join the second micro-batch next step.
        next_first = [r for r in first if not r.finished][: (len(running) + 1) // 2]
        if next_first and self._drafter_in_sync:
            self._carried = _CarriedDraft(next_first, self._submit_draft(next_first))
        if pending_verify is not None:
            with self.timer.stage(Stage.VERIFY):
                second_verdict = pending_verify.result()
            with self.timer.stage(Stage.APPEND):
                self._append(second, second_trees, second_verdict)

    def _take_carried(self, running: list[Request]) -> tuple[list[Request], DraftOutput | None]:
        """The carried draft's requests still running, and their rows of it."""
        carried, self._carried = self._carried, None
        if carried is None:
            return [], None
        draft = self._await_draft(carried.requests, carried.pending)
        # By identity: a finished request's id may come back as a new request.
        running_ids = {id(r) for r in running}
        rows = [i for i, r in enumerate(carried.requests) if id(r) in running_ids]
        requests = [carried.requests[i] for i in rows]
        return requests, None if draft is None or not rows else _draft_rows(draft, rows)

    def _submit_draft(self, requests: list[Request]) -> Pending[DraftOutput | None]:
        """Submit one draft call at the engine's fixed K; the requests' contexts go with it."""
        assert self.drafter is not None
        top_k = self._fixed_top_k()
        bonus_tokens = torch.tensor([r.bonus_token for r in requests], dtype=torch.int64)
        contexts = [tuple(r.pending_contexts) for r in requests]
        assert all(contexts), "every running request has undrafted context"
        inputs = DraftInput([_slot(r) for r in requests], bonus_tokens, contexts, top_k)
        for request in requests:
            request.pending_contexts = []
        if isinstance(self.drafter, PipelinedDrafter):
            return self.drafter.submit_draft(inputs)
        try:
            return Ready(self.drafter.draft(inputs))
        except DrafterUnavailableError as error:
            return _Raising(error)

    def _await_draft(
        self, requests: list[Request], pending: Pending[DraftOutput | None]
    ) -> DraftOutput | None:
        """The submitted draft, checked; None (root-only trees) when the drafter was lost."""
        try:
            draft = pending.result()
        except DrafterUnavailableError as error:
            self._lose_drafter(error)
            return None
        if draft is not None and self._drafter_in_sync:
            _check_positions(requests, draft.num_context_tokens)
        return draft if self._drafter_in_sync else None

    def _submit_verify(self, requests: list[Request], trees: BuiltTrees) -> Pending[VerifyOutput]:
        inputs = self._verify_input(requests, trees)
        if isinstance(self.target, PipelinedTarget):
            return self.target.submit_verify(inputs)
        return Ready(self.target.verify_and_commit(inputs))

    def _drafter_ready(self, drafter: Drafter, requests: list[Request]) -> bool:
        """True when the drafter can draft for `requests` (every running request) this step."""
        if self._drafter_in_sync:
            return True
        if not drafter.is_available():
            return False
        self._restore_drafter(drafter, requests)
        return True

    def _restore_drafter(self, drafter: Drafter, requests: list[Request]) -> None:
        """Give a drafter that is back each running request's whole context, from the target.

        It may be a fresh process or the old one: every slot is released first, then each
        request's pending context becomes its cached text re-encoded, so after the next draft
        its context length equals the target's cache again (checked there).
        """
        for slot in range(self.settings.max_num_seqs):
            drafter.release(slot)
        slots = [_slot(r) for r in requests]
        context = self.target.encode_context(EncodeInput(slots, [_cached_token_ids(r) for r in requests]))
        for i, request in enumerate(requests):
            request.pending_contexts = [ContextSlice(context, i)]
            request.num_drafter_context_tokens = 0
        self._drafter_in_sync = True
        logger.warning("the drafter is back: speculation resumes for %d running requests", len(requests))

    def _lose_drafter(self, error: DrafterUnavailableError) -> None:
        """Decode plainly from now on, until the drafter is available again."""
        self._drafter_in_sync = False
        self.num_drafter_losses += 1
        if self.budget_policy is not None:  # its streak's steps are no longer the ones it settled
            self.budget_policy.end_cruise()
        logger.warning("drafter lost (%s): decoding without drafts until it is back", error)

    def _build(self, requests: list[Request], draft: DraftOutput | None) -> BuiltTrees:
        """One tree per request from its draft, padded into the verify batch (host or device).

        With the adaptive policy each host tree, built at the step's ceiling, is cut to the
        best-first prefix the policy allocates (a prefix of a best-first tree is itself a DDTree).
        """
        if self._cruise_step is not None and draft is not None:
            return self._build_cruising(requests, draft, self._cruise_step)
        if self.budget_policy is not None and draft is not None:
            return self._build_allocated(requests, draft, self.budget_policy)
        return self.tree_builder.build(
            None if draft is None else draft.logp,
            None if draft is None else draft.ids,
            [r.tree_budget for r in requests],
            [_bonus(r) for r in requests],
            chain=self.settings.mode == "chain",
        )

    def _build_allocated(
        self, requests: list[Request], draft: DraftOutput, policy: AdaptiveBudget
    ) -> BuiltTrees:
        """Host trees at the ceiling, without the nodes deeper than each request can keep, cut
        to the allocation; the stage's time prices the next ceilings.

        The draft covers the first requests only (all, but for a probe): the rest verify their root."""
        started = time.perf_counter()
        drafted = len(draft.num_context_tokens)  # checked against the drafted requests in `_draft`
        keepable, request_caps = self._adaptive_inputs_of(requests)
        self._adaptive_inputs = None
        ceiling = policy.ceiling
        if drafted == len(requests) and min(request_caps) >= ceiling:
            ceiling_caps = [ceiling] * drafted  # most steps: one figure (per request, 0.1 ms at batch 64)
        else:
            ceiling_caps = [min(cap, ceiling) if i < drafted else 0 for i, cap in enumerate(request_caps)]
        # A settled step builds no wider than the width it will verify (`settled_width`); the
        # graphs it may run are still its ceiling's (no capture at the width's own bucket).
        width = policy.settled_width
        caps = ceiling_caps if width is None else [min(cap, width) for cap in ceiling_caps]
        captured = self._allowed_buckets(requests, max(ceiling_caps))
        # `choose` cuts the caps to the widest graph alike, and tells the gate when that cut its
        # ceiling.
        widest = _within_graphs(caps, captured)
        roots = [_bonus(r) for r in requests]
        whole = build_host_tree_batch(draft.logp, draft.ids, widest[:drafted], roots[:drafted])
        whole = whole.with_root_only(roots[drafted:])
        built = whole.within_depth(keepable)  # itself where no request is near its end
        cut_rows = None if built is whole else built.num_nodes < whole.num_nodes
        allocation = policy.choose(built, caps, captured, cut_rows=cut_rows)
        batch = _padded_to_graphs(built.prefix(allocation.num_nodes), captured)
        policy.record_build_ms(1000.0 * (time.perf_counter() - started))
        return batch

    def _start_cruise(self, requests: list[Request]) -> "_CruiseStep | None":
        """This step's cruise (`AdaptiveBudget.cruise_width`), None: it plans. A request that can
        keep no draft token (its last) verifies its root only, as a fixed budget's does."""
        policy = self.budget_policy
        if policy is None or not policy.cruising:
            return None
        cap = max(r.tree_budget for r in requests)
        keepable = self._keepable_depths(requests) if policy.cruise_drafts else []
        longest_left = max(keepable) + 1 if keepable else None
        width = policy.cruise_width(len(requests), cap, longest_left=longest_left)
        self._cruise_step = None if width is None else _CruiseStep(width, keepable, cap)
        return self._cruise_step

    def _build_cruising(
        self, requests: list[Request], draft: DraftOutput, cruise: "_CruiseStep"
    ) -> BuiltTrees:
        """A cruising step's trees: each request's best-first tree of at most the cruise's
        width, less the nodes deeper than it can keep, padded as the settled step's were (its
        verify graph is the ceiling's)."""
        policy = self.budget_policy
        assert policy is not None
        captured = self._allowed_buckets(requests, min(cruise.cap, policy.ceiling))
        widths = [min(r.tree_budget, cruise.width) for r in requests]
        budgets = _within_graphs(widths, captured)
        built = build_host_tree_batch(draft.logp, draft.ids, budgets, [_bonus(r) for r in requests])
        kept = built.within_depth(cruise.keepable)
        # Trees neither a graph's width nor a request's end cut: the step's tokens teach the gate.
        self._cruise_step = replace(cruise, whole=budgets is widths and kept is built)
        return _padded_to_graphs(kept, captured)

    def _allowed_buckets(self, requests: list[Request], ceiling: int) -> tuple[int, ...] | None:
        """The tree-token buckets an adaptive step of trees up to `ceiling` nodes may verify in
        (`VerifyGraphShapes.allowed_buckets`); None: any (an eager target, no graphs for the
        batch, or free widths near the cache's end)."""
        if self.graph_shapes is None:
            return None
        max_start = max(r.num_cached_tokens for r in requests)
        return self.graph_shapes.allowed_buckets(len(requests), max_start, ceiling)

    def _fixed_top_k(self) -> int:
        """K of the drafts that are joined across calls (overlap, chained): one shape for all."""
        return 1 if self.settings.mode == "chain" else min(self.settings.budget, self.vocab_size)

    def _verify(self, requests: list[Request], trees: BuiltTrees) -> VerifyOutput:
        """One target call: forward over every tree, accept a path, commit its KV (and, chained,
        the requests' next draft, kept for the next step)."""
        inputs = self._verify_input(requests, trees)
        if self.chains_drafts and inputs.return_context:
            assert isinstance(self.target, DraftChainingTarget)
            assert not any(r.pending_contexts for r in requests), "the verify's context is the only new one"
            pending_verdict, pending_draft = self.target.submit_verify_then_draft(inputs, self._fixed_top_k())
            verdict = pending_verdict.result()
            self._carried = _CarriedDraft(list(requests), pending_draft)
            return verdict
        policy = self.budget_policy
        # `hasattr`, not `isinstance` against the runtime-checkable protocol (13 us a step).
        device_target = (
            cast(AsyncDeviceTarget, self.target)
            if policy is not None and hasattr(self.target, "while_verifying")
            else None
        )
        if device_target is not None and policy is not None:
            device_target.while_verifying = policy.learn
        started = time.perf_counter()
        try:
            verdict = self.target.verify_and_commit(inputs)
        finally:
            if device_target is not None:
                device_target.while_verifying = None  # another engine may share the target
        if policy is not None:
            # On CUDA this includes the lesson where it outlasts the device's work (most at
            # small batches): the cost curve's verify price carries that much of it.
            verify_ms = 1000.0 * (time.perf_counter() - started)
            policy.record_verify_ms(verify_ms, captured_graph=self._verify_captures)
        return verdict

    def _verify_input(self, requests: list[Request], trees: BuiltTrees) -> VerifyInput:
        """The verify call of `requests`: their trees, sampling knobs and coins."""
        self._verify_captures = False
        if self.graph_shapes is not None:
            max_start = max(r.num_cached_tokens for r in requests)
            num_nodes = trees.batch.padded_num_nodes
            self._verify_captures = self.graph_shapes.record(len(requests), num_nodes, max_start)
        sampling = _sampling_batch([r.params for r in requests], self.vocab_size)
        coins = coin_final = None
        if not sampling.all_greedy:
            # Per request: one coin per real node then the final coin, all from its generator,
            # so a seeded request draws the same coins whatever batch it runs in.
            batch, num_nodes = trees.batch, trees.num_nodes
            coins = torch.zeros(batch.batch_size, batch.padded_num_nodes, dtype=torch.float32)
            coin_final = torch.zeros(batch.batch_size, dtype=torch.float32)
            for i, request in enumerate(requests):
                if request.params.greedy:
                    continue
                draws = _uniforms(request, num_nodes[i] + 1)
                coins[i, : num_nodes[i]] = draws[:-1]
                coin_final[i] = draws[-1]
        return VerifyInput(
            [_slot(r) for r in requests],
            trees.batch,
            sampling,
            coins,
            coin_final,
            return_context=self._drafter_in_sync,
        )

    def _append(self, requests: list[Request], trees: BuiltTrees, verdict: VerifyOutput) -> None:
        """Append each request's accepted tokens and bonus; stops drop what follows them."""
        accept_tokens = verdict.accept_tokens.tolist()
        accept_len = verdict.accept_len.tolist()
        bonus_tokens = verdict.bonus_token.tolist()
        if self.budget_policy is not None and trees.host is not None:
            if self._cruise_step is not None:
                # Whole trees' nodes teach the cruise's lesson, which reads them later (`learn`).
                whole_index = verdict.accept_index.numpy() if self._cruise_step.whole else None
                self.budget_policy.cruised(trees.host, accept_len, whole_index)
            else:
                accepted: list[list[int]] = [[] for _ in accept_len]  # a plain step's (all empty)
                if any(accept_len):
                    accept_index = verdict.accept_index.tolist()
                    accepted = [accept_index[i][1 : 1 + n] for i, n in enumerate(accept_len)]
                self.budget_policy.observe(trees.host, accepted, trees.batch.padded_num_nodes)
        for i, request in enumerate(requests):
            request.num_cached_tokens = verdict.num_cached_tokens[i]
            new_tokens = [*accept_tokens[i][1 : 1 + accept_len[i]], bonus_tokens[i]]
            request.steps += 1
            request.num_step_tokens += len(new_tokens)
            request.bonus_token = bonus_tokens[i]
            if verdict.context is not None:
                request.pending_contexts.append(ContextSlice(verdict.context, i))
            self.stop_checker.append(request, new_tokens, request.max_output_tokens)

    def _postprocess(self, scheduled: ScheduledStep) -> list[RequestOutput]:
        """Free finished requests' slots and report every request that changed."""
        outputs: list[RequestOutput] = []
        for request in scheduled.running:
            if request.finished:
                self._release(request)
                del self._requests[request.request_id]
            if request.finished or len(request.output_token_ids) > request.num_emitted_tokens:
                outputs.append(request.take_output())
        for request in self._aborted:
            self._requests.pop(request.request_id, None)
            outputs.append(request.take_output())
        self._aborted.clear()
        return outputs

    # ----------------------------------------------------------------------------- helpers

    def _release(self, request: Request) -> None:
        if request.slot is None:
            return
        slot = self.scheduler.free(request)
        self.target.release(slot)
        if self.drafter is not None and self._drafter_in_sync:  # a lost drafter is reset on return
            try:
                self.drafter.release(slot)
            except DrafterUnavailableError as error:
                self._lose_drafter(error)

    def _adaptive_inputs_of(self, requests: list[Request]) -> tuple[list[int], list[int]]:
        """The step's keepable depths (`_keepable_depths`) and adaptive caps (`_adaptive_caps`),
        worked out once: the draft's `plan` and the build read both, and per-request Python
        cost 0.1-0.2 ms a step at batch 64 on the H200's host. Kept for the same list of
        requests only (a probe's draft reorders them); the build drops them."""
        kept = self._adaptive_inputs
        if kept is not None and kept[0] is requests:
            return kept[1], kept[2]
        keepable = self._keepable_depths(requests)
        caps = self._adaptive_caps(requests, keepable)
        self._adaptive_inputs = (requests, keepable, caps)
        return keepable, caps

    def _steps_to_finish(self, requests: list[Request]) -> list[float] | None:
        """Each request's expected steps to its end (tokens it may still emit, its keepable
        draft tokens and one, over the tokens its steps made so far, each; the batch's mean for
        one that has taken no step yet), where the batch drains (`DRAIN_QUIET_STEPS`); None
        while requests wait or keep arriving."""
        if self.scheduler.waiting or self._steps_since_arrival < DRAIN_QUIET_STEPS:
            return None
        keepable = self._adaptive_inputs_of(requests)[0]
        stepped = [r for r in requests if r.steps]
        mean_rate = sum(r.num_step_tokens for r in stepped) / max(sum(r.steps for r in stepped), 1)
        return [
            (depth + 1) / max(r.num_step_tokens / r.steps if r.steps else mean_rate, 1.0)
            for r, depth in zip(requests, keepable, strict=True)
        ]

    def _adaptive_caps(self, requests: Sequence[Request], keepable: Sequence[int]) -> list[int]:
        """Draft nodes the adaptive policy may give each request: its budget, or none when it
        can keep no draft token (`keepable`, from `_keepable_depths`)."""
        return [r.tree_budget if depth > 0 else 0 for r, depth in zip(requests, keepable, strict=True)]

    def _keepable_depths(self, requests: Sequence[Request]) -> list[int]:
        """Draft tokens each request can still keep: a step commits its accepted tokens and one
        more, up to its `max_output_tokens`. Its tree's deeper nodes could only be cut off; the
        node count is not bounded by it (a wide shallow tree still raises the expected
        acceptance). One pass: the adaptive step reads every request's twice, and per-request
        calls cost 0.4-0.6 ms a step at batch 64 on the H200's host."""
        return [max(0, r.max_output_tokens - len(r.output_token_ids) - 1) for r in requests]

    def _probe_requests(self, running: list[Request]) -> list[Request]:
        """The `PROBE_REQUESTS` requests a probe drafts: those far enough from their end to
        keep a whole tree first (a tree cut to a request's last tokens teaches the gate nothing),
        then those whose drafter context lags the target's cache least.

        Each catches up on all the context it skipped: a request drafted at the last probe owes
        the plain steps since, one that joined during plain steps its whole prompt (thousands
        of tokens through the drafter, for a probe that may well find drafting still a loss).
        Ties keep the batch order."""

        keepable = dict(zip(map(id, running), self._keepable_depths(running), strict=True))

        def key(request: Request) -> tuple[bool, int]:
            cut = keepable[id(request)] < self.block_size
            return cut, request.num_cached_tokens - request.num_drafter_context_tokens

        return sorted(running, key=key)[:PROBE_REQUESTS]

    def _top_k(self, request: Request) -> int:
        return min(request.tree_budget, self.vocab_size)

    def _tree_tokens(self, request: Request) -> int:
        """Upper bound on the nodes (root included) one step verifies for `request`."""
        match self.settings.mode:
            case "ar":
                return 1
            case "chain":
                return self.block_size
            case _:
                return request.tree_budget + 1


@dataclass(frozen=True)
class _CarriedDraft:
    """A draft submitted for the next step (overlap's first micro-batch, or chained to the last
    serial verify); its rows follow `requests`."""

    requests: list[Request]
    pending: Pending[DraftOutput | None]


def draft_on_device(draft: DraftOutput) -> bool:
    """Whether `draft`'s kernels may still be running when the drafter call returns (a CUDA
    draft): the engine then learns, and may plan, while they run. `bench/virtual_device.py`
    replaces it to simulate a device's asynchronous drafter on the CPU."""
    return draft.logp.is_cuda


def _within_graphs(caps: list[int], captured: tuple[int, ...] | None) -> list[int]:
    """`caps` with no tree wider than the widest graph the step may run (`captured`: its
    buckets; None: any width)."""
    if captured is None or max(caps) < captured[-1]:
        return caps
    return [min(cap, captured[-1] - 1) for cap in caps]


def _padded_to_graphs(trees: TreeBatch, captured: tuple[int, ...] | None) -> BuiltTrees:
    """The step's verify batch, its trees padded to the captured bucket that holds the widest
    (None: the target's own padding), so the verify runs a graph that exists."""
    padded = VerifyGraphShapes.padded_nodes(int(trees.num_nodes.max()), captured)
    return BuiltTrees(trees.verify_batch(n_max=padded), trees.num_nodes.tolist(), trees)


@dataclass(frozen=True)
class _CruiseStep:
    """A cruising step's width, its requests' keepable depths and their widest cap; once built,
    whether its trees are whole (`whole`)."""

    width: int
    keepable: list[int]
    cap: int
    whole: bool = False


class _Raising:
    """A `Pending` whose blocking call already failed: `result()` raises its error."""

    def __init__(self, error: Exception) -> None:
        self._error = error

    def result(self) -> DraftOutput | None:
        raise self._error


def _draft_rows(draft: DraftOutput, rows: list[int]) -> DraftOutput:
    """The draft of a subset of its requests (rows in order)."""
    if rows == list(range(len(draft.num_context_tokens))):
        return draft
    index = torch.tensor(rows, dtype=torch.int64, device=draft.logp.device)
    return DraftOutput(
        draft.logp.index_select(0, index),
        draft.ids.index_select(0, index),
        tuple(draft.num_context_tokens[i] for i in rows),
    )


def _cat_drafts(head: DraftOutput | None, tail: DraftOutput | None) -> DraftOutput | None:
    """Two drafts at one K as one (`head` None: just `tail`; `tail` None: the drafter was lost)."""
    if tail is None or head is None:
        return tail if head is None else None
    return DraftOutput(
        torch.cat([head.logp, tail.logp]),
        torch.cat([head.ids, tail.ids]),
        (*head.num_context_tokens, *tail.num_context_tokens),
    )


def _sampling_batch(params: list[SamplingParams], vocab_size: int) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
        # top_k >= vocab means no filter; capping it keeps any int the caller sent within int64.
        top_k=torch.tensor([min(p.top_k, vocab_size) for p in params], dtype=torch.int64),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
        all_greedy=all(p.greedy for p in params),
    )


def _uniforms(request: Request, n: int) -> torch.Tensor:
    """`n` float32 draws in [0, 1) from the request's own generator: [n]."""
    return torch.rand(n, generator=request.generator, dtype=torch.float32)


def _check_positions(requests: list[Request], num_context_tokens: Sequence[int]) -> None:
    """The drafter drafts from exactly the text in the target's cache, for every request;
    each request then records that length as its drafter's.

    Both counts come from their owners (the drafter's and the target's caches), so a lost or
    doubled context append shows here, at the step it happens, not as silently worse drafts.
    """
    num_cached_tokens = [r.num_cached_tokens for r in requests]
    if list(num_context_tokens) != num_cached_tokens:
        raise RuntimeError(
            f"drafter context lengths {list(num_context_tokens)} differ from the target's cached "
            f"lengths {num_cached_tokens}"
        )
    for request in requests:
        request.num_drafter_context_tokens = request.num_cached_tokens


def _cached_token_ids(request: Request) -> list[int]:
    """The text in a running request's target cache: prompt and output less the newest token."""
    token_ids = [*request.prompt_token_ids, *request.output_token_ids[:-1]]
    assert len(token_ids) == request.num_cached_tokens, "the cache holds all but the newest token"
    return token_ids


def _slot(request: Request) -> int:
    assert request.slot is not None, "only running requests reach the models"
    return request.slot


def _bonus(request: Request) -> int:
    assert request.bonus_token is not None, "a running request has sampled its newest token"
    return request.bonus_token
