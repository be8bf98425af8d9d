"""Adaptive vs fixed tree budgets across concurrency, and a simulated sweep over a cost file.

Live mode (default): the in-process engine over one model pair (the bundled one by default) runs
the same greedy prompts at each concurrency with plain decoding (ar), DDTree at fixed budgets,
and the adaptive budget (`budget_policy="adaptive"`), and reports generated tokens per second:
each configuration's median over `--repeats` timed runs, taken round-robin across the
configurations after `--warmup-runs` untimed ones (so drift on a shared machine falls on all
alike, and one noisy run does not make a configuration the best), each round starting one
configuration later. Beside the ratio of medians, the table gives the median of adaptive over
the best configuration round by round (paired: the machine's drift between rounds cancels) and
the range of those ratios, which says how far one sweep's ratio can be trusted; the JSON keeps
every run's rate. The adaptive engine's start-up
cost calibration runs once, before the sweep (its curve is saved, for simulations); one adaptive
policy then lives through the whole sweep, as in a server whose load changes: what it learned at
one concurrency (acceptance calibration, live costs, step-time ratios per batch bucket) it keeps
at the next. After each level's timed rounds one more run at the largest fixed budget, untimed,
records per-step acceptance traces (each request's full best-first tree and the nodes
verification accepted), saved for the simulation: recording copies every draft to the host and
builds its tree in Python inside the step, which in timed runs cost fixed-64 0.8-1.4 ms a step on
an H100 at c = 8-16 (4.69 ms against 3.90 unrecorded at c = 8).

    python bench/budget_sweep.py --max-tokens 32                    # CPU, bundled pair
    python bench/budget_sweep.py --device cuda --dtype bfloat16 --max-tokens 256

The prompts are eight openings in the bundled pair's training style, the same in every run
(`--prompt-set bundled`): at c = 1 a level then measures one text, and "the best fixed budget"
is the best for that text (on an H100 prompt 0 takes 14 steps at 64 nodes and 16 at 32, where
the drafter's calibrated forecast says 64 gains a third of that). `--prompt-set heldout` takes
windows of the held-out standard library instead, each round the next `concurrency` of them
(every configuration the same ones in a round), so a level's rounds cover many texts.

A run is one closed batch by default: `concurrency` requests start together and the run ends
with the last. Its rate then rests on its slowest request (on the H200 at c = 8 and 16 fixed-32
and fixed-64 take the same 20 steps a run, where at c = 1-4 64 makes 13-14% more tokens a step).
`--requests-per-slot N` holds the concurrency instead, as a server at that load: each finished
request's slot takes the next, N requests a slot per run, the first wave's lengths staggered so
slots turn over one after another (`tokens_per_s`).

Simulation mode (`--simulate-cost FILE`): no model runs. Recorded traces (`--traces`, written
by a live sweep) are replayed at each concurrency against the cost curve in FILE: a fixed
budget b verifies each trace's first b nodes (greedy acceptance of a prefix is the accepted
path's part inside it), the adaptive policy (the engine's own `AdaptiveBudget`) chooses per
step, and time is the curve's prediction. It is a simulation: the acceptance is the bundled
drafter's, the cost is the file's (e.g. a Kimi K2.6 slice cost, bench/costs/).

    python bench/budget_sweep.py --simulate-cost bench/costs/kimi_k26_moe_layer_h200.json

Results: bench/out/budget_sweep[_sim].{md,json,png}.
"""

import argparse
import json
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
from acceptance import heldout_prompts, heldout_stream  # the held-out text's windows
from virtual_device import add_virtual_arguments, virtualize_from_args

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.budget import AdaptiveBudget, BudgetStep, BuildCost, CostCurve, load_cost_curve
from ddtree_serve.engine.builder import build_draft_step, build_target_step, target_dir
from ddtree_serve.engine.interfaces import DraftInput, DraftOutput, VerifyInput, VerifyOutput
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.models import load_tokenizer
from ddtree_serve.tree import DraftTree, TreeBatch, build_ddtree

OUT_DIR = Path(__file__).resolve().parent / "out"
HELDOUT_PROMPTS, HELDOUT_PROMPT_TOKENS = 64, 48  # `--prompt-set heldout`
# Openings in the style of the standard library the bundled pair was trained on.
PROMPTS = [
    "def _check_arg_types(funcname, *args):\n    hasstr = hasbytes = False\n    for s in args:\n",
    'class Error(Exception):\n    """Base class for exceptions in this module."""\n    pass\n\n\nclass ',
    "import os\nimport sys\nimport re\n\n__all__ = [",
    '    def __init__(self, stream, errors="strict"):\n        self.stream = stream\n',
    'if __name__ == "__main__":\n    import ',
    '    def close(self):\n        """Close the file."""\n        if self._file is not None:\n',
    "def _parse_header(line):\n    parts = line.split(';')\n    key = parts[0].strip()\n",
    "try:\n    import _thread\nexcept ImportError:\n    ",
]


@dataclass(frozen=True)
class TraceStep:
    """One request's step at the ceiling budget: its full best-first tree and what was accepted."""

    tree: DraftTree
    accepted: tuple[int, ...]  # accepted draft node indices (root excluded), path order

    def as_json(self) -> dict:
        tree = self.tree
        return {
            "token_ids": tree.token_ids.tolist(),
            "depths": tree.depths.tolist(),
            "parents": tree.parents.tolist(),
            "logws": tree.logws.tolist(),
            "accepted": list(self.accepted),
        }

    @staticmethod
    def from_json(data: dict) -> "TraceStep":
        tree = DraftTree(
            token_ids=np.array(data["token_ids"], dtype=np.int64),
            depths=np.array(data["depths"], dtype=np.int64),
            parents=np.array(data["parents"], dtype=np.int64),
            logws=np.array(data["logws"], dtype=np.float64),
        )
        return TraceStep(tree, tuple(data["accepted"]))


class TraceRecorder:
    """Wraps the drafter and target of a fixed-budget engine; pairs each draft with its verdict."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.steps: list[TraceStep] = []
        self._draft: tuple[DraftInput, DraftOutput] | None = None

    def drafted(self, inputs: DraftInput, output: DraftOutput) -> None:
        self._draft = (inputs, output)

    def verified(self, output: VerifyOutput) -> None:
        if self._draft is None:
            return
        inputs, draft = self._draft
        self._draft = None
        accept_index, accept_len = output.accept_index.tolist(), output.accept_len.tolist()
        for i, tree in enumerate(draft_trees(inputs, draft, self.budget)):
            self.steps.append(TraceStep(tree, tuple(accept_index[i][1 : 1 + accept_len[i]])))


def draft_trees(inputs: DraftInput, output: DraftOutput, budget: int) -> list[DraftTree]:
    """Each drafted request's full best-first tree at `budget` nodes, built on the host."""
    k = min(budget, output.logp.shape[-1])
    logp, ids = output.logp[..., :k].float().cpu(), output.ids[..., :k].cpu()
    bonuses = inputs.bonus_tokens.tolist()
    return [build_ddtree(logp[i], ids[i], budget, bonus) for i, bonus in enumerate(bonuses)]


class RecordingDrafter:
    def __init__(self, inner, recorder: TraceRecorder) -> None:
        self.inner, self.recorder = inner, recorder

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    def draft(self, inputs: DraftInput) -> DraftOutput:
        output = self.inner.draft(inputs)
        self.recorder.drafted(inputs, output)
        return output

    def release(self, slot: int) -> None:
        self.inner.release(slot)


class RecordingTarget:
    def __init__(self, inner, recorder: TraceRecorder) -> None:
        self.inner, self.recorder = inner, recorder
        self.vocab_size, self.eos_token_ids = inner.vocab_size, inner.eos_token_ids
        self.max_seq_len, self.verify_token_buckets = inner.max_seq_len, inner.verify_token_buckets

    def prefill(self, inputs):
        return self.inner.prefill(inputs)

    def verify_and_commit(self, inputs: VerifyInput) -> VerifyOutput:
        output = self.inner.verify_and_commit(inputs)
        self.recorder.verified(output)
        return output

    def release(self, slot: int) -> None:
        self.inner.release(slot)


# ----------------------------------------------------------------------------- live sweep


@dataclass
class StepLog:
    """Steps, tokens and seconds of one configuration's timed runs, and (adaptive) the ceilings
    its policy chose, step by step: why a configuration is as fast as it is."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    ceilings: Counter[int] = field(default_factory=Counter)
    # The adaptive policy's records of its drafted steps, read after the run (`summary`): a
    # settled step's forecast is worked out when read, and reading it in the step would time
    # host work the engine does not do.
    drafted_steps: list[BudgetStep] = field(default_factory=list)
    graphs_captured: int = 0  # CUDA graphs (target verify, drafter) captured during these runs

    def add(self, other: "StepLog") -> None:
        for item in fields(self):
            if item.name == "ceilings":
                self.ceilings.update(other.ceilings)
            else:
                setattr(self, item.name, getattr(self, item.name) + getattr(other, item.name))

    def summary(self) -> dict:
        steps = max(self.steps, 1)
        summary = {
            "tokens_per_step": self.tokens / steps,
            "ms_per_step": 1000.0 * self.seconds / steps,
            "graphs_captured": self.graphs_captured,
        }
        if self.ceilings:
            summary["ceiling_share"] = {
                str(c): n / sum(self.ceilings.values()) for c, n in sorted(self.ceilings.items())
            }
        steps = self.drafted_steps
        drafted_rows = sum(sum(n > 0 for n in step.num_nodes) for step in steps)  # a probe drafts a few
        if drafted_rows:
            summary["nodes_per_drafted_request"] = sum(sum(step.num_nodes) for step in steps) / drafted_rows
            predicted = sum(step.predicted_accepted for step in steps)
            summary["predicted_per_drafted_request"] = predicted / drafted_rows
            summary["accepted_per_drafted_request"] = sum(step.accepted for step in steps) / drafted_rows
        return summary


def _log_choices(policy: AdaptiveBudget, log: dict[str, StepLog]) -> None:
    """Counts each step's ceiling, planned or cruising, and each planned drafted step's verified,
    expected and accepted draft nodes, into `log["adaptive"]` (one policy lives through the
    sweep). Cruising steps (`AdaptiveBudget.cruise_width`) call no `plan`: counted from `plan`
    alone, an H100's c = 1 sweep that cruised at 64 through 15 steps of every 17 read as 47%
    ceiling 32 (its neighbour probes) and 53% 64. Their records are made only when read, and
    reading one in the step would time host work the engine does not do, so the node counts
    are the planned steps'."""
    plan, observe, cruised = policy.plan, policy.observe, policy.cruised

    def logged_plan(caps, *args, **kwargs):
        ceiling = plan(caps, *args, **kwargs)
        log.setdefault("adaptive", StepLog()).ceilings[ceiling] += 1
        return ceiling

    def logged_cruised(*args, **kwargs):
        log.setdefault("adaptive", StepLog()).ceilings[policy.ceiling] += 1
        return cruised(*args, **kwargs)

    def logged_observe(*args, **kwargs):
        step = observe(*args, **kwargs)
        if step.drafted:
            log.setdefault("adaptive", StepLog()).drafted_steps.append(step)
        return step

    policy.plan = logged_plan  # type: ignore[method-assign]
    policy.observe = logged_observe  # type: ignore[method-assign]
    policy.cruised = logged_cruised  # type: ignore[method-assign]


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `live_pair` reads: the model pair, where it runs, and the slots' length."""
    parser.add_argument("--target", default=None, help="target model dir (default: bundled)")
    parser.add_argument("--drafter", default=None, help="DFlash drafter dir (default: bundled)")
    parser.add_argument("--device", default="cpu", help="(default: %(default)s)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="(default: %(default)s)",
    )
    parser.add_argument("--max-seq-len", type=int, default=512, help="(default: %(default)s)")
    parser.add_argument(
        "--prompt-set",
        choices=["bundled", "heldout"],
        default="bundled",
        help="bundled: eight stdlib-style openings, the same each run (earlier results' set); "
        f"heldout: {HELDOUT_PROMPTS} windows of {HELDOUT_PROMPT_TOKENS} tokens of the held-out "
        "standard library (this interpreter's), each sweep round taking the next ones "
        "(default: %(default)s)",
    )
    add_virtual_arguments(parser)


def live_pair(args: argparse.Namespace, budget: int, max_num_seqs: int):
    """The model pair the live runs share (`args.target`, `.drafter`, `.device`, `.dtype`,
    `.max_seq_len`): the base engine config, the target and drafter steps, the tokenizer, and
    the sweep's prompts as token ids."""
    base = EngineConfig(
        target=args.target,
        drafter=args.drafter,
        device=args.device,
        dtype=args.dtype,
        budget=budget,
        max_num_seqs=max_num_seqs,
        max_seq_len=args.max_seq_len,
        max_num_batched_tokens=1 << 20,
    )
    target, drafter = build_target_step(base), build_draft_step(base)
    target, drafter = virtualize_from_args(target, drafter, args)
    tokenizer = load_tokenizer(target_dir(base))
    if args.prompt_set == "heldout":
        prompts = heldout_prompts(heldout_stream(tokenizer), HELDOUT_PROMPTS, HELDOUT_PROMPT_TOKENS)
    else:
        prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    return base, target, drafter, tokenizer, prompts


def round_prompts(prompts: list, run: int, per_round: int, rotate: bool) -> list:
    """The prompts round `run` gives every configuration alike (so a round's ratios stay
    paired): with `rotate`, the `per_round` after the last round's (a run's requests), so a
    level's rounds cover that many texts each instead of the same ones (at c = 1 one text,
    whose own best budget then is "the best fixed budget")."""
    if not rotate:
        return prompts
    offset = (run * per_round) % len(prompts)
    return prompts[offset:] + prompts[:offset]


def run_live(args: argparse.Namespace) -> tuple[list[dict], list[TraceStep], list[dict]]:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    base, target, drafter, tokenizer, prompts = live_pair(args, max(budgets), max(concurrencies))
    cost_path = args.out_dir / f"budget_cost_{args.device.split(':')[0]}.json"
    started = time.perf_counter()
    calibrating = SpecEngine(_settings(base, "adaptive", None), target, drafter, tokenizer)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    cost_path.write_text(json.dumps(calibrating.budget_policy.cost.to_json()) + "\n")
    build_path = args.out_dir / f"budget_build_cost_{args.device.split(':')[0]}.json"
    build_path.write_text(json.dumps(calibrating.budget_policy.build.to_json()) + "\n")
    print(
        f"start-up cost calibration: {time.perf_counter() - started:.1f} s -> {cost_path}, {build_path}",
        flush=True,
    )

    recorder = TraceRecorder(max(budgets))
    rows, diagnostics = [], []
    logs: dict[str, StepLog] = {}
    _log_choices(calibrating.budget_policy, logs)

    def adaptive_engine() -> SpecEngine:  # every level's adaptive engine shares one policy
        settings = _settings(base, "adaptive", str(cost_path))
        return SpecEngine(settings, target, drafter, tokenizer, budget_policy=calibrating.budget_policy)

    for run in range(args.policy_warmup_runs):  # other texts than the timed rounds' (rotated)
        for concurrency in concurrencies:
            logs["adaptive"] = StepLog()
            per_slot = args.requests_per_slot
            texts = round_prompts(prompts, run + 1, concurrency * per_slot, True)
            tokens_per_s(
                adaptive_engine(), texts, concurrency, args.max_tokens, f"warm{run}", StepLog(), per_slot
            )
    if args.policy_warmup_runs:
        print(f"adaptive policy warmed: {args.policy_warmup_runs} untimed run(s) at each level", flush=True)
    for concurrency in concurrencies:
        configs: list[tuple[str, SpecEngine]] = [("ar", _engine(base, "ar", target, None, tokenizer))]
        for budget in budgets:
            config = base.model_copy(update={"budget": budget})
            configs.append((f"ddtree-{budget}", _engine(config, "fixed", target, drafter, tokenizer)))
        configs.append(("adaptive", adaptive_engine()))
        row: dict = {"concurrency": concurrency}
        samples: dict[str, list[float]] = {name: [] for name, _ in configs}
        for run in range(args.warmup_runs + args.repeats):  # round-robin: drift falls on all alike
            # Each round starts one configuration later: none always runs after the same one.
            for name, engine in configs[run % len(configs) :] + configs[: run % len(configs)]:
                logs[name] = StepLog()
                graphs = _num_graphs(target, drafter)
                tag, per_slot = str(run), args.requests_per_slot
                per_round = concurrency * per_slot
                texts = round_prompts(prompts, run, per_round, args.prompt_set == "heldout")
                rate = tokens_per_s(engine, texts, concurrency, args.max_tokens, tag, logs[name], per_slot)
                logs[name].graphs_captured = _num_graphs(target, drafter) - graphs
                if run >= args.warmup_runs:
                    samples[name].append(rate)
                    logs.setdefault(f"timed-{name}", StepLog()).add(logs[name])
        record_traces(recorder, base, target, drafter, tokenizer, prompts, concurrency, args)
        row.update({name: float(np.median(rates)) for name, rates in samples.items()})
        rows.append(row)
        steps = {name: logs.pop(f"timed-{name}").summary() for name, _ in configs}
        diagnostics.append({"concurrency": concurrency, "steps": steps, "runs": samples})
        print(row_line(row), flush=True)
        print(_steps_line(steps), flush=True)
        print(_paired_line(row, samples), flush=True)
    return rows, recorder.steps, diagnostics


def record_traces(
    recorder: TraceRecorder,
    base: EngineConfig,
    target,
    drafter,
    tokenizer,
    prompts: list,
    concurrency: int,
    args: argparse.Namespace,
) -> None:
    """One untimed run at the recorder's budget, its drafts and verdicts kept as traces: kept out
    of the timed runs, whose fixed budget would carry the recording's host work."""
    config = base.model_copy(update={"budget": recorder.budget})
    engine = recording_engine(config, target, drafter, tokenizer, recorder)
    tokens_per_s(engine, prompts, concurrency, args.max_tokens, "trace", StepLog(), args.requests_per_slot)


def recording_engine(config: EngineConfig, target, drafter, tokenizer, recorder) -> SpecEngine:
    """A fixed-budget engine whose pair tells `recorder` each draft (`drafted(inputs, output)`)
    and each verdict (`verified(output)`); its start-up capture reports scratch slots too."""
    return _engine(
        config, "fixed", RecordingTarget(target, recorder), RecordingDrafter(drafter, recorder), tokenizer
    )


def _settings(config: EngineConfig, policy: str, cost_path: str | None):
    update = {"budget_policy": policy, "cost_curve": cost_path}
    return config.model_copy(update=update).to_settings()


def _engine(config: EngineConfig, policy: str, target, drafter, tokenizer) -> SpecEngine:
    if drafter is None:
        return SpecEngine(config.model_copy(update={"mode": "ar"}).to_settings(), target, None, tokenizer)
    return SpecEngine(_settings(config, policy, None), target, drafter, tokenizer)


class SlotLoad:
    """A run's requests over `prompts` (token ids, in turn), added to `engine` as `tokens_per_s`
    describes: `concurrency` at once (staggered when held), then, held (`requests_per_slot` > 1),
    each finished request's slot takes the next until `concurrency * requests_per_slot` have run."""

    def __init__(
        self,
        engine: SpecEngine,
        prompts: list[list[int]],
        concurrency: int,
        max_tokens: int,
        tag: str,
        requests_per_slot: int = 1,
    ) -> None:
        self.engine, self.prompts, self.tag = engine, prompts, tag
        self.params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.total = concurrency * requests_per_slot
        for i in range(concurrency):
            first_tokens = (
                max(1, max_tokens * (i + 1) // concurrency) if requests_per_slot > 1 else max_tokens
            )
            first = SamplingParams(max_tokens=first_tokens, ignore_eos=True)
            engine.add_request(f"{tag}-{i}", prompts[i % len(prompts)], first)
        self.added = concurrency

    def refill(self, outputs: list) -> int:
        """A step's outputs: the next requests take the finished ones' slots; how many joined."""
        joining = min(sum(out.finished for out in outputs), self.total - self.added)
        for _ in range(joining):
            request_id = f"{self.tag}-{self.added}"
            self.engine.add_request(request_id, self.prompts[self.added % len(self.prompts)], self.params)
            self.added += 1
        return joining


def tokens_per_s(
    engine: SpecEngine,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    tag: str,
    log: StepLog,
    requests_per_slot: int = 1,
) -> float:
    """Generated tokens/s of one run of `concurrency` requests of `max_tokens` tokens each (its
    steps, tokens and seconds added to `log`). `requests_per_slot` > 1: each finished request's
    slot takes the next one until `concurrency * requests_per_slot` have run (a server held at
    `concurrency` requests in flight, as a serving benchmark's `--max-concurrency` holds it),
    the first request of slot i making `max_tokens * (i + 1) // concurrency` tokens, so slots
    turn over one after another as a server's do: with one length for all, plain decoding's
    requests stayed in lockstep, all finishing in one step and prefilling together once every
    `max_tokens` steps, while drafting's spread out and paid a small prefill nearly every step
    (a forward of a few prompts costs 1.2-1.5 ms in the H200's cost file, its batch-1 floor);
    1: one closed batch, run until its last request finishes."""
    load = SlotLoad(engine, prompts, concurrency, max_tokens, tag, requests_per_slot)
    started = time.perf_counter()
    num_tokens = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        num_tokens += sum(out.num_new_tokens for out in outputs)
        log.steps += 1
        load.refill(outputs)
    elapsed = time.perf_counter() - started
    log.tokens += num_tokens
    log.seconds += elapsed
    return num_tokens / elapsed


def _num_graphs(target, drafter) -> int:
    """CUDA graphs the target's verify and the drafter's two forwards hold (0 when eager): a
    capture mid-run costs tens of milliseconds, which a short timed run feels and a server pays
    once per shape (a drafter after plain steps appends more context than one step's: new
    append buckets)."""
    forwards = []
    target_graphs = getattr(getattr(target, "runner", None), "graphs", None)
    if target_graphs is not None:
        forwards.append(target_graphs.forward)
    drafter_graphs = getattr(getattr(drafter, "drafter", None), "graphs", None)
    if drafter_graphs is not None:
        forwards += [drafter_graphs.append, drafter_graphs.block]
    return sum(forward.num_graphs for forward in forwards)


def paired_ratios(row: dict, runs: dict[str, list[float]]) -> list[float]:
    """Adaptive over the best configuration (`ar` or a fixed budget, by median), round by round:
    the two ran within seconds of each other, so drift in the machine's speed, which moves whole
    rounds (on the CI CPU `ar`'s step took 6.3 ms in one sweep and 5.4 in the next minute), cancels
    in each ratio where it does not between two medians taken over different rounds."""
    best = best_configuration(row)
    return [a / b for a, b in zip(runs["adaptive"], runs[best], strict=True)]


def best_configuration(row: dict) -> str:
    """The fastest of `ar` and the fixed budgets (`ddtree-B`) in a row: what adaptive is held to."""
    return max((name for name in row if name == "ar" or name.startswith("ddtree-")), key=row.__getitem__)


def _paired_line(row: dict, runs: dict[str, list[float]]) -> str:
    """The paired ratios' median and range (`paired_ratios`)."""
    ratios = paired_ratios(row, runs)
    return (
        f"  adaptive / best, round by round: median {float(np.median(ratios)):.2f}, "
        f"range {min(ratios):.2f}-{max(ratios):.2f} ({len(ratios)} rounds)"
    )


HELD_TOKENS_SHARE = 0.02
"""How near a fixed budget's tokens a step the adaptive runs' must be to read as held at it."""


def _held_at(steps: dict[str, dict]) -> str | None:
    """The one fixed budget whose tokens a step the adaptive runs made within
    `HELD_TOKENS_SHARE` (None: none, or several). The sweep decodes greedily, so a
    configuration's tokens a step are its trees' alone: a level the gate ran at one ceiling
    but for its probes makes about that fixed budget's tokens. An H100's misses at c = 1-4 were
    mostly levels held at 32 (4.00-4.03 tokens a step where fixed-32 made 4.00 and fixed-64
    4.57); the ceiling shares, which count the probes and decisions too, hid it."""
    adaptive = steps.get("adaptive")
    if adaptive is None:
        return None
    made = adaptive["tokens_per_step"]
    held = [
        name
        for name, fixed in steps.items()
        if name.startswith("ddtree-") and abs(fixed["tokens_per_step"] - made) <= HELD_TOKENS_SHARE * made
    ]
    return held[0] if len(held) == 1 else None


def _steps_line(steps: dict[str, dict]) -> str:
    """Tokens and milliseconds per engine step of each configuration, and the adaptive ceilings."""
    parts = [
        f"{n} {s['tokens_per_step']:.2f} tok / {s['ms_per_step']:.2f} ms"
        + (f" ({s['graphs_captured']} graphs captured)" if s["graphs_captured"] else "")
        for n, s in steps.items()
    ]
    adaptive = steps.get("adaptive", {})
    ceilings = ", ".join(f"{c}: {share:.0%}" for c, share in adaptive.get("ceiling_share", {}).items())
    line = "  per step: " + "; ".join(parts) + (f"; adaptive ceilings {ceilings}" if ceilings else "")
    if held := _held_at(steps):
        line += f"; adaptive made {held}'s tokens a step (within {HELD_TOKENS_SHARE:.0%})"
    if "nodes_per_drafted_request" in adaptive:
        line += (
            f"; per drafted request {adaptive['nodes_per_drafted_request']:.1f} nodes verified, "
            f"{adaptive['predicted_per_drafted_request']:.2f} expected / "
            f"{adaptive['accepted_per_drafted_request']:.2f} accepted"
        )
    return line


# ----------------------------------------------------------------------------- simulation


def run_simulation(args: argparse.Namespace, traces: list[TraceStep]) -> list[dict]:
    """Replay traces against the cost file; every time is the curve's prediction (a simulation)."""
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    rng = np.random.default_rng(args.seed)
    rows = []
    for concurrency in concurrencies:
        steps = [
            [traces[j] for j in rng.integers(0, len(traces), size=concurrency)] for _ in range(args.sim_steps)
        ]
        cost, build = _simulation_cost(args), _simulation_build_cost(args)
        row: dict = {"concurrency": concurrency}
        ar_ms = float(cost.verify_ms(concurrency, concurrency))
        row["ar"] = 1000.0 * concurrency / ar_ms
        for budget in budgets:
            tokens, ms = 0.0, 0.0
            for batch in steps:
                tokens += sum(_accepted_within(step, budget) + 1 for step in batch)
                ms += (
                    cost.draft_ms(concurrency)
                    + float(build.ms(concurrency, concurrency * budget, budget))
                    + float(cost.verify_ms(concurrency, concurrency * (budget + 1)))
                )
            row[f"ddtree-{budget}"] = 1000.0 * tokens / ms
        row["adaptive"] = _simulate_adaptive(steps, _simulation_cost(args), max(budgets), build, build)
        if build.per_node_ms or build.per_step_ms or build.per_request_ms or build.lockstep_per_pop_ms:
            # The policy as it was before it priced the build: the same steps, the same charge.
            row["adaptive-forwards-only"] = _simulate_adaptive(
                steps, _simulation_cost(args), max(budgets), build, BuildCost(0.0, 0.0, 0.0)
            )
        rows.append(row)
        print(row_line(row), flush=True)
    return rows


def _simulation_cost(args: argparse.Namespace) -> CostCurve:
    cost = load_cost_curve(args.simulate_cost)
    if args.draft_ms is None:
        return cost
    draft_ms = np.full(len(cost.batch_sizes), args.draft_ms)
    return CostCurve(cost.batch_sizes, cost.token_counts, cost.grid_ms, draft_ms=draft_ms)


def _simulation_build_cost(args: argparse.Namespace) -> BuildCost:
    """The host build's cost in the simulation: the file's, or free (only the forwards priced)."""
    if args.build_cost is None:
        return BuildCost(0.0, 0.0, 0.0)
    return BuildCost.from_json(json.loads(args.build_cost.read_text()))


def fit_build_cost(sweep: dict, traces: list[TraceStep], cost: CostCurve) -> BuildCost:
    """What a live sweep's drafted steps cost beyond their two forwards, as a `BuildCost`.

    Per concurrency c and fixed budget b: the measured step time (tau_b * c / tokens per s, tau_b
    from the traces' greedy acceptance within b nodes) minus the curve's draft and verify
    forwards, minus what a plain step costs beyond its forward (the same row's ar), fitted
    as `BuildCost.fit` does. A model of that machine's host work, for simulations.
    """
    points = []
    for row in sweep["rows"]:
        concurrency = row["concurrency"]
        plain_extra = 1000.0 * concurrency / row["ar"] - float(cost.verify_ms(concurrency, concurrency))
        for name in (k for k in row if k.startswith("ddtree-")):
            budget = int(name.removeprefix("ddtree-"))
            tau = 1.0 + float(np.mean([_accepted_within(step, budget) for step in traces]))
            measured = 1000.0 * tau * concurrency / row[name]
            forwards = cost.draft_ms(concurrency) + float(
                cost.verify_ms(concurrency, concurrency * (budget + 1))
            )
            points.append((concurrency, concurrency * budget, budget, measured - forwards - plain_extra))
    return BuildCost.fit(points)


def _simulate_adaptive(
    steps: list[list[TraceStep]], cost: CostCurve, ceiling: int, charged: BuildCost, known: BuildCost
) -> float:
    """The engine's own `AdaptiveBudget` per simulated step; times are the models' predictions.

    A step's build costs what `charged` predicts for its ceiling, as for the fixed budgets; the
    policy prices ceilings with `known`."""
    policy = AdaptiveBudget(cost, known)
    tokens, ms = 0.0, 0.0
    for batch in steps:
        caps = [ceiling] * len(batch)
        step_ceiling = policy.plan(caps)
        traced = TreeBatch.from_trees([step.tree for step in batch])
        if step_ceiling > 0:
            draft_ms = cost.draft_ms(len(batch))
            policy.record_draft_ms(draft_ms)
            built = traced.prefix([step_ceiling] * len(batch))
            allocation = policy.choose(built, [step_ceiling] * len(batch))
            num_nodes = allocation.num_nodes
            draft_ms += float(charged.ms(len(batch), int((built.num_nodes - 1).sum()), step_ceiling))
        else:
            draft_ms, num_nodes = 0.0, (0,) * len(batch)
        trees = traced.prefix(num_nodes)
        accepted = [
            tuple(node for node in step.accepted if node <= n)
            for step, n in zip(batch, num_nodes, strict=True)
        ]
        verify_ms = float(cost.verify_ms(len(batch), len(batch) * int(trees.num_nodes.max())))
        policy.record_verify_ms(verify_ms)
        policy.observe(trees, accepted)
        tokens += sum(len(a) + 1 for a in accepted)
        ms += draft_ms + verify_ms
    return 1000.0 * tokens / ms


def _accepted_within(step: TraceStep, budget: int) -> int:
    """Greedy acceptance of the tree's first `budget` nodes: the accepted path's part inside them."""
    return sum(1 for node in step.accepted if node <= budget)


# ----------------------------------------------------------------------------- report


def row_line(row: dict) -> str:
    return f"concurrency {row['concurrency']}: " + ", ".join(
        f"{k} {v:.1f}" for k, v in row.items() if k != "concurrency"
    )


def markdown_table(rows: list[dict], title: str, runs: list[dict[str, list[float]]] | None = None) -> str:
    """`runs`: each row's per-round rates (a live sweep's), for the paired ratio's column."""
    names = [k for k in rows[0] if k != "concurrency"]
    paired_header = " | paired (range) |" if runs else " |"
    paired_note = ", and the median of adaptive / best round by round (`paired_ratios`), with its range"
    lines = [
        f"### {title}",
        "",
        "tokens/s (each configuration's median run); last columns: adaptive / max(ar, best fixed) "
        "and adaptive / ar" + (paired_note if runs else ""),
        "",
        "| concurrency | " + " | ".join(names) + " | adaptive / best | adaptive / ar" + paired_header,
        "|---" * (len(names) + (4 if runs else 3)) + "|",
    ]
    for i, row in enumerate(rows):
        best = row[best_configuration(row)]
        cells = " | ".join(f"{row[n]:.1f}" for n in names)
        ratios = f"{row['adaptive'] / best:.2f} | {row['adaptive'] / row['ar']:.2f}"
        if runs:
            paired = paired_ratios(row, runs[i])
            ratios += f" | {float(np.median(paired)):.2f} ({min(paired):.2f}-{max(paired):.2f})"
        lines.append(f"| {row['concurrency']} | {cells} | {ratios} |")
    return "\n".join(lines) + "\n"


def _live_title(device: str, dtype: str, max_tokens: int, requests_per_slot: int = 1) -> str:
    arrivals = "" if requests_per_slot == 1 else f", {requests_per_slot} requests per slot in turn"
    return f"Budget sweep, {device} {dtype}, {max_tokens} new tokens{arrivals}"


def replot(path: Path) -> None:
    """The table and plot of a saved live sweep (a device call brings back few files)."""
    sweep = json.loads(path.read_text())
    args = sweep["args"]
    if args.get("simulate_cost"):
        raise SystemExit(f"{path} is a simulation's: --replot takes a live sweep's JSON")
    title = _live_title(args["device"], args["dtype"], args["max_tokens"], args.get("requests_per_slot", 1))
    runs = [entry["runs"] for entry in sweep.get("steps", []) if "runs" in entry]
    table = markdown_table(sweep["rows"], title, runs if len(runs) == len(sweep["rows"]) else None)
    path.with_suffix(".md").write_text(table)
    plot(sweep["rows"], path.with_suffix(".png"), title)
    print(table + f"wrote {path.with_suffix('.md')}, {path.with_suffix('.png')}")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrencies = [row["concurrency"] for row in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in (k for k in rows[0] if k != "concurrency"):
        style = "k-o" if name == "adaptive" else ("--s" if name == "ar" else ":^")
        ax.plot(concurrencies, [row[name] for row in rows], style, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set_xlabel("concurrency (running requests)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_pair_arguments(parser)
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="comma-separated")
    parser.add_argument(
        "--budgets", default="8,32,64", help="fixed DDTree budgets; the largest is the ceiling"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument(
        "--requests-per-slot",
        type=int,
        default=1,
        help="requests each of the concurrency's slots runs in turn per run (1: one closed batch; "
        "more: a finished request's slot takes the next, as a server held at that concurrency, "
        "the first wave's lengths staggered)",
    )
    parser.add_argument(
        "--warmup-runs",
        type=int,
        default=1,
        help="untimed runs of each configuration first (CUDA graphs met the first time, the "
        "adaptive policy learning the load)",
    )
    parser.add_argument(
        "--policy-warmup-runs",
        type=int,
        default=0,
        help="untimed adaptive runs at every level, in order, before the first level is timed: the "
        "policy then meets each level as a server that has carried traffic does (0: it starts cold "
        "at the first level, whose one warm-up run leaves its calibrator young; default: %(default)s)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs of each configuration; the median counts"
    )
    parser.add_argument(
        "--simulate-cost", type=Path, default=None, help="cost curve JSON: simulate, run no model"
    )
    parser.add_argument(
        "--traces", type=Path, default=OUT_DIR / "budget_traces.json", help="acceptance traces"
    )
    parser.add_argument(
        "--draft-ms", type=float, default=None, help="simulation: drafter ms (default: the file's)"
    )
    parser.add_argument("--sim-steps", type=int, default=200, help="simulated steps per concurrency")
    parser.add_argument(
        "--build-cost",
        type=Path,
        default=None,
        help="simulation: host build cost JSON (per_step_ms, per_request_ms, per_node_ms; default: free)",
    )
    parser.add_argument(
        "--fit-build-cost",
        type=Path,
        default=None,
        help="simulation: fit the host build cost from this live sweep's JSON (with its cost curve "
        "as --simulate-cost and its --traces) and use it",
    )
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        help="a live sweep's JSON: write its table and plot beside it (.md, .png), run nothing",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.replot is not None:
        replot(args.replot)
        return
    if args.simulate_cost is None:
        rows, traces, diagnostics = run_live(args)
        args.traces.parent.mkdir(parents=True, exist_ok=True)
        args.traces.write_text(json.dumps([t.as_json() for t in traces]) + "\n")
        title = _live_title(args.device, args.dtype, args.max_tokens, args.requests_per_slot)
        stem = "budget_sweep"
    else:
        if not args.traces.exists():
            raise SystemExit(f"no traces at {args.traces}: run the live sweep first (it records them)")
        traces = [TraceStep.from_json(t) for t in json.loads(args.traces.read_text())]
        if args.fit_build_cost is not None:
            fitted = fit_build_cost(
                json.loads(args.fit_build_cost.read_text()), traces, _simulation_cost(args)
            )
            args.build_cost = args.out_dir / "budget_build_cost_fitted.json"
            args.build_cost.write_text(json.dumps(fitted.to_json()) + "\n")
            print(
                f"host build cost fitted from {args.fit_build_cost}: {fitted.to_json()} -> {args.build_cost}"
            )
        draft_ms = (
            args.draft_ms if args.draft_ms is not None else load_cost_curve(args.simulate_cost).draft_ms(1)
        )
        title = (
            f"SIMULATION: {len(traces)} recorded bundled-drafter steps x cost {args.simulate_cost.name}"
            f" (draft {draft_ms:g} ms)"
            + ("" if args.build_cost is None else f" + host build {args.build_cost.name}")
        )
        rows, stem, diagnostics = run_simulation(args, traces), "budget_sweep_sim", []
    runs = [entry["runs"] for entry in diagnostics]
    table = markdown_table(rows, title, runs or None)
    print("\n" + table)
    (args.out_dir / f"{stem}.md").write_text(table)
    (args.out_dir / f"{stem}.json").write_text(
        json.dumps({"args": vars(args), "rows": rows, "steps": diagnostics}, default=str) + "\n"
    )
    plot(rows, args.out_dir / f"{stem}.png", title)
    print(f"wrote {args.out_dir / stem}.{{md,json,png}}")


if __name__ == "__main__":
    main()
