"""Where an engine step's wall time goes, stage by stage: the adaptive budget against fixed ones.

The budget sweep says how fast each configuration is; this says why. One in-process engine per
configuration over the same target and drafter runs `--runs` timed runs of `--concurrency`
identical-length greedy requests (after `--warmup-runs`), and every stage of its step is timed
with the wall clock as the engine calls it (no syncs added, so a stage that reads the device
back holds the wait for the kernels before it): the engine's own stages, the adaptive policy's
calls (`plan`, `choose`, `learn`, `observe`) and the draft's copy to the host (`topk_on_host`,
inside the draft stage under the adaptive policy, inside the build otherwise). For the adaptive
engine the steps are also grouped by kind (prefill, plain, probes, decided anew, calibrator
refit, streak; the fixed engines' by prefill or not; steps after the first request finished
apart, as "... finishing") and its slowest steps listed by stage.
Milliseconds per step; a stage's figure includes the stages it calls (`_verify` holds
`target.verify_and_commit`).

    python bench/step_stages.py --device cuda --dtype bfloat16 --concurrency 1 4 16 64

It found, on the H200 (eleventh session), that the adaptive engine verified fixed-32's trees and
lost on its policy's host time (`plan` + `choose` + `learn` + `observe`, ~0.6 ms of a 4 ms step).
"""

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from budget_sweep import PROMPTS  # the sweep's prompts: the same load
from virtual_device import add_virtual_arguments, virtualize_from_args

import ddtree_serve.engine.spec_engine as spec_engine_module
import ddtree_serve.engine.tree_builder as tree_builder_module
from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.builder import build_draft_step, build_target_step, target_dir
from ddtree_serve.engine.graph_shapes import VerifyGraphShapes
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.models import load_tokenizer
from ddtree_serve.tree import TreeBatch

ENGINE_STAGES = ("_prefill", "_serial_draft", "_build", "_verify", "_append", "_postprocess")
POLICY_CALLS = ("plan", "choose", "learn", "observe", "record_step_ms", "cruise_width", "cruised")


class StageClock:
    """Wall seconds spent in named callables, summed since the last `reset`."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.padded_nodes = 0  # the last verify's nodes per tree, padding included

    def reset(self) -> None:
        self.seconds.clear()

    def wrap(self, owner: Any, attribute: str, label: str) -> None:
        """Replace `owner.attribute` (an instance's method, or a module's function) by a timed one."""
        inner: Callable[..., Any] = getattr(owner, attribute)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - started

        setattr(owner, attribute, timed)


def build_engines(
    args: argparse.Namespace, clock: StageClock
) -> tuple[dict[str, SpecEngine], list[list[int]]]:
    """The adaptive engine and one fixed-budget engine per `--budgets` entry, sharing the models,
    and the prompts in their tokenizer's ids."""
    budgets = [int(b) for b in args.budgets.split(",")]
    base = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        budget=max(budgets),
        max_num_seqs=max(args.concurrency),
        max_seq_len=args.max_seq_len,
        max_num_batched_tokens=1 << 20,
    )
    target, drafter = build_target_step(base), build_draft_step(base)
    target, drafter = virtualize_from_args(target, drafter, args)
    tokenizer = load_tokenizer(target_dir(base))
    adaptive = base.model_copy(update={"budget_policy": "adaptive"}).to_settings()
    engines = {"adaptive": SpecEngine(adaptive, target, drafter, tokenizer)}
    for budget in budgets:
        settings = base.model_copy(update={"budget": budget}).to_settings()
        engines[f"ddtree-{budget}"] = SpecEngine(settings, target, drafter, tokenizer)
    for engine in engines.values():
        for stage in ENGINE_STAGES:
            clock.wrap(engine, stage, stage)
        if engine.budget_policy is not None:
            for call in POLICY_CALLS:
                clock.wrap(engine.budget_policy, call, f"policy.{call}")
    clock.wrap(target, "verify_and_commit", "target.verify_and_commit")
    timed_verify = target.verify_and_commit

    def verify_and_commit(inputs: Any) -> Any:  # the padded width a kind's verify ran at
        clock.padded_nodes = inputs.batch.padded_num_nodes
        return timed_verify(inputs)

    target.verify_and_commit = verify_and_commit
    clock.wrap(drafter, "draft", "drafter.draft")
    for module in (spec_engine_module, tree_builder_module):  # the adaptive draft's, the build's
        clock.wrap(module, "topk_on_host", "topk_on_host")
    clock.wrap(spec_engine_module, "build_host_tree_batch", "build_host_tree_batch")
    clock.wrap(VerifyGraphShapes, "allowed_buckets", "allowed_buckets")
    clock.wrap(TreeBatch, "verify_batch", "verify_batch")
    return engines, [tokenizer.encode(p).ids for p in PROMPTS]


def run_requests(
    engine: SpecEngine,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    tag: str,
    clock: StageClock,
    records: list[dict[str, Any]] | None = None,
) -> int:
    """One run of `concurrency` requests to completion; its step count. `records`: one entry per
    step (its ms, kind and stage milliseconds; see `step_kind`)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"{tag}-{i}", prompts[i % len(prompts)], params)
    steps = 0
    while engine.has_unfinished_requests():
        before = dict(clock.seconds) if records is not None else {}
        calibrations = _calibrations(engine)
        # Once requests finish the batch is smaller and its steps cheaper: kept apart, so that
        # kinds compare at the run's full batch (a settled step only runs there).
        finishing = engine.num_running + engine.num_waiting < concurrency
        started = time.perf_counter()
        engine.step()
        ms = 1000.0 * (time.perf_counter() - started)
        steps += 1
        if records is not None:
            stages = {k: 1000.0 * (v - before.get(k, 0.0)) for k, v in clock.seconds.items()}
            kind = step_kind(engine, stages, calibrations) + (" finishing" if finishing else "")
            records.append({"ms": ms, "kind": kind, "stages": stages, "padded": clock.padded_nodes})
    return steps


def _calibrations(engine: SpecEngine) -> int:
    policy = engine.budget_policy
    return -1 if policy is None else policy._num_calibrations


def step_kind(engine: SpecEngine, stages: dict[str, float], calibrations_before: int) -> str:
    """What a step was, for grouping: "prefill" when it cached prompts; for the adaptive engine
    "plain", "probe" (after plain steps), "neighbour" (a probe of the choice's neighbours),
    "decided" (the gate decided anew), "refresh" (the calibrator refit), "settled" (a streak's
    step that kept its trees whole unweighed), "cruise" (one its settled step let run without
    deciding) or "streak", each drafted kind with its ceiling
    ("streak@16"); a fixed engine's other steps are "drafted"."""
    if stages.get("_prefill", 0.0) > 0.0:
        return "prefill"
    policy = engine.budget_policy
    if policy is None:
        return "drafted"
    step, gate = policy.last_step, policy.gate
    if step is None or not step.drafted:
        return "plain"
    if engine._cruise_step is not None:  # a settled streak's step run without deciding
        return f"cruise@{step.ceiling}"
    if gate.probing:
        kind = "probe"
    elif gate.probing_neighbour:
        kind = "neighbour"
    elif policy._num_calibrations != calibrations_before:
        kind = "refresh"
    elif policy.settled:
        kind = "settled"
    else:
        kind = "decided" if gate._streak_age == 0 else "streak"
    return f"{kind}@{step.ceiling}"


def summarize(name: str, records: list[dict[str, Any]], slowest: int) -> list[str]:
    """Mean ms and count per step kind, each kind's mean stages, then the `slowest` steps with
    their largest stages."""
    kinds: dict[str, list[float]] = defaultdict(list)
    padded: dict[str, list[int]] = defaultdict(list)
    for record in records:
        kinds[record["kind"]].append(record["ms"])
        padded[record["kind"]].append(record["padded"])
    lines = [
        f"{name} steps by kind (mean / median ms, count, mean padded nodes a tree): "
        + ", ".join(
            f"{kind}: {statistics.fmean(ms):.2f} / {statistics.median(ms):.2f} ({len(ms)}, "
            f"{statistics.fmean(padded[kind]):.1f})"
            for kind, ms in sorted(kinds.items())
        )
    ]
    for kind in sorted(kinds):
        of_kind = [r["stages"] for r in records if r["kind"] == kind]
        labels = sorted({label for stages in of_kind for label in stages})
        means = {label: statistics.fmean(s.get(label, 0.0) for s in of_kind) for label in labels}
        parts = ", ".join(f"{label} {ms:.3f}" for label, ms in sorted(means.items(), key=lambda i: -i[1]))
        lines.append(f"  mean {kind}: {parts}")
    for record in sorted(records, key=lambda r: -r["ms"])[:slowest]:
        top = sorted(record["stages"].items(), key=lambda item: -item[1])[:6]
        parts = ", ".join(f"{label} {ms:.2f}" for label, ms in top)
        lines.append(f"  {record['ms']:.2f} ms {record['kind']}: {parts}")
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    clock = StageClock()
    engines, prompts = build_engines(args, clock)
    for concurrency in args.concurrency:
        print(f"\n### concurrency {concurrency}, {args.max_tokens} new tokens (ms per step)\n")
        rows, labels = [], [*ENGINE_STAGES, "topk_on_host", "drafter.draft", "target.verify_and_commit"]
        labels += [f"policy.{call}" for call in POLICY_CALLS]
        summaries: list[str] = []
        for name, engine in engines.items():
            for run in range(args.warmup_runs):
                run_requests(engine, prompts, concurrency, args.max_tokens, f"w{concurrency}-{run}", clock)
            clock.reset()
            records: list[dict[str, Any]] = []
            started = time.perf_counter()
            steps = sum(
                run_requests(
                    engine, prompts, concurrency, args.max_tokens, f"t{concurrency}-{run}", clock, records
                )
                for run in range(args.runs)
            )
            elapsed = time.perf_counter() - started
            tokens_per_s = concurrency * args.max_tokens * args.runs / elapsed
            cells = [f"{1000.0 * clock.seconds.get(label, 0.0) / steps:.2f}" for label in labels]
            rows.append(
                f"| {name} | {tokens_per_s:.0f} | {1000.0 * elapsed / steps:.2f} | "
                + " | ".join(cells)
                + " |"
            )
            slowest = args.slowest if engine.budget_policy is not None else 0
            summaries += summarize(name, records, slowest)
        print("| engine | tok/s | step | " + " | ".join(labels) + " |")
        print("|---" * (len(labels) + 3) + "|")
        print("\n".join(rows))
        print("\n" + "\n".join(summaries))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--budgets", default="8,16,32", help="fixed DDTree budgets; the largest is the ceiling"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--max-seq-len", type=int, default=1024)
    add_virtual_arguments(parser)
    parser.add_argument("--warmup-runs", type=int, default=2, help="untimed runs per engine and concurrency")
    parser.add_argument("--runs", type=int, default=4, help="timed runs per engine and concurrency")
    parser.add_argument(
        "--slowest", type=int, default=8, help="the adaptive engine's slowest steps to list, by stage"
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
