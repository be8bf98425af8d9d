"""The adaptive engine's steps by kind against fixed budgets' steps, timed unwrapped.

`step_stages.py` times every stage through wrappers, whose own cost is in every figure (on an
H100 its adaptive cruising step read 0.19 ms over fixed-64's at batch 1, where timing only
`engine.step()` read 0.03-0.05). This times the whole step alone and groups the adaptive
engine's steps by what they were: `c` a cruising step (`AdaptiveBudget.cruise_width`), `d` one
that planned (a decision, a probe, a held or settled step), `p` a run's first step (its prefill
too); fixed budgets' steps are `f` or `p`. Runs are closed batches of `--concurrency` requests of
`--max-tokens` greedy tokens, or with `--requests-per-slot N` the concurrency held as the sweep
holds it (each step that prefills a joining request a `p`), the engines taken round-robin (each
round one engine later) after `--warmup-runs` untimed rounds; one adaptive policy lives through
all levels, as in the sweep.

Per level it prints each engine's median tokens/s, the adaptive runs' tokens/s over the best
fixed budget's round by round (median, mean, range), each kind's median and mean step time with
its count, and the first runs' kinds in order. Then, per engine, its steps after the first by
(batch bucket, ceiling): count, tokens and milliseconds a step. A closed run lasts as long as
its slowest request: the buckets show where a wider budget's extra tokens at the full batch
were spent again in a longer tail of one or two requests (on an H100 at c = 8, 64 tokens,
fixed-64 made 34.5 tokens in 3.62 ms a step at batch 8 against fixed-32's 30.8 in 3.31, then
ran 5 steps at batch 1 to fixed-32's 3, and lost the run by 6%).

    python bench/step_kinds.py --device cuda --dtype bfloat16 --concurrency 1,2,4,8

`--budgets 0,8` sets plain decoding (`ar`) beside fixed-8: where the gate decodes plainly, its
plain steps (cruising `c`, deciding `d`) and its probes read against `ar`'s own.

`--variant SETTINGS` (repeatable) adds an adaptive engine whose draft gate is built with other
settings (`DraftGate`'s: `probe_interval`, `curve_weight`, `probe_share`, `near_best_ms`,
`small_batch_near_best_ms`, `near_tie_rate`, `tail_steps`, `recheck_steps`, `curve_trees`,
`drain_power`),
beside the default one, in the same rounds: an A/B of a setting on one device in one process,
e.g. the band's step-time tolerance at c = 8:

    python bench/step_kinds.py --device cuda --dtype bfloat16 --concurrency 8 --budgets 8,32,64 \\
        --variant near_best_ms=0.08 --variant near_best_ms=0.10
"""

import argparse
import inspect
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from budget_sweep import SlotLoad, _engine, _settings, add_pair_arguments, live_pair

from ddtree_serve.engine.budget.draft_gate import DraftGate
from ddtree_serve.engine.budget.step_residual import batch_bucket
from ddtree_serve.engine.spec_engine import SpecEngine

RUNS_SHOWN = 4
"""Runs whose step kinds are printed in order, per level."""

GateSetting = int | float
"""A `DraftGate` setting's value, of its default's type."""

BucketSteps = dict[tuple[int, int], list[float]]
"""(batch bucket, ceiling) -> [steps, tokens, milliseconds] summed."""


def run(
    engine: SpecEngine,
    tag: str,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    steps: dict[str, list[float]],
    by_bucket: BucketSteps,
    requests_per_slot: int = 1,
) -> tuple[float, str]:
    """One run of `concurrency` requests over `prompts` (token ids, in turn): its tokens/s and
    its steps' kinds in order; each step's ms added to `steps[kind]`, and each step without a
    prefill to `by_bucket` at its batch's bucket and its ceiling (a fixed budget's own; an
    adaptive step's, 0 for a plain one). `requests_per_slot` > 1 holds the concurrency as the
    sweep does (`budget_sweep.tokens_per_s`: a finished request's slot takes the next, the first
    wave's lengths staggered); a step that prefills a request joining (`p`) is its own kind."""
    load = SlotLoad(engine, prompts, concurrency, max_tokens, tag, requests_per_slot)
    num_tokens, kinds, joined = 0, [], True
    # The run's time is its steps' and refills' only: the bookkeeping below reads the policy's
    # step record, which an adaptive engine makes when read (`AdaptiveBudget.last_step`).
    seconds = 0.0
    while engine.has_unfinished_requests():
        batch_size = engine.num_running
        step_started = time.perf_counter()
        outputs = engine.step()
        step_ended = time.perf_counter()
        ms = 1000.0 * (step_ended - step_started)
        made = sum(out.num_new_tokens for out in outputs)
        num_tokens += made
        policy = engine.budget_policy
        if joined:
            kind = "p"
        elif policy is None:
            kind = "f"
        else:
            kind = "c" if engine._cruise_step is not None else "d"
        kinds.append(kind)
        steps[kind].append(ms)
        if kind != "p":
            if policy is None:
                ceiling = 0 if engine.settings.mode == "ar" else engine.settings.budget
            else:
                last = policy.last_step
                ceiling = 0 if last is None else last.ceiling
            totals = by_bucket.setdefault((batch_bucket(batch_size), ceiling), [0.0, 0.0, 0.0])
            for i, value in enumerate((1, made, ms)):
                totals[i] += value
        refill_started = time.perf_counter()
        joined = load.refill(outputs) > 0
        seconds += step_ended - step_started + time.perf_counter() - refill_started
    return num_tokens / seconds, "".join(kinds)


def buckets_line(by_bucket: BucketSteps) -> str:
    return "; ".join(
        f"b{bucket} {ceiling}: {n:.0f} x {tokens / n:.1f} tok {ms / n:.2f} ms"
        for (bucket, ceiling), (n, tokens, ms) in sorted(by_bucket.items())
    )


def kinds_line(steps: dict[str, list[float]]) -> str:
    return "; ".join(
        f"{kind} {statistics.median(ms):.3f} / {statistics.fmean(ms):.3f} ms ({len(ms)})"
        for kind, ms in sorted(steps.items())
    )


def _setting_value(default: GateSetting, text: str) -> GateSetting:
    """`text` as the type of a setting's default."""
    return type(default)(text)


def gate_settings(text: str) -> dict[str, GateSetting]:
    """`name=value[,name=value...]` over `DraftGate`'s settings, each cast to its default's type."""
    defaults = {
        name: param.default
        for name, param in inspect.signature(DraftGate.__init__).parameters.items()
        if name != "self"
    }
    settings: dict[str, GateSetting] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or name not in defaults:
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected name=value with name one of {', '.join(defaults)}"
            )
        try:
            settings[name] = _setting_value(defaults[name], value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item!r}: {value!r} is not a {type(defaults[name]).__name__}"
            ) from None
    try:
        DraftGate(**settings)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    return settings


def add_variant_argument(parser: argparse.ArgumentParser) -> None:
    """`--variant SETTINGS`: an adaptive engine with other draft-gate settings (`gate_settings`)."""
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        type=gate_settings,
        metavar="SETTINGS",
        help="an adaptive engine with these draft-gate settings beside the default one, e.g. "
        "near_best_ms=0.08 (repeatable; default: none)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_pair_arguments(parser)
    parser.add_argument("--concurrency", default="1,2,4,8", help="(default: %(default)s)")
    parser.add_argument(
        "--budgets",
        default="32,64",
        help="fixed budgets, 0 for plain decoding (ar); the largest is the cap (default: %(default)s)",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument(
        "--warmup-runs", type=int, default=3, help="untimed rounds per level (default: %(default)s)"
    )
    parser.add_argument(
        "--rounds", type=int, default=10, help="timed rounds per level (default: %(default)s)"
    )
    parser.add_argument(
        "--requests-per-slot",
        type=int,
        default=1,
        help="requests each slot runs in turn per run, as the sweep's (1: one closed batch; more: "
        "the concurrency held, each step that prefills a joining request a `p`) "
        "(default: %(default)s)",
    )
    add_variant_argument(parser)
    parser.add_argument(
        "--variant-no-draft-ahead",
        action="store_true",
        help="an adaptive engine whose steps never launch their draft before they plan "
        "(`AdaptiveBudget.draft_ahead` off) beside the default one (default: none)",
    )
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    base, target, drafter, tokenizer, prompts = live_pair(args, max(budgets), max(levels))

    def adaptive_policy(gate: dict[str, GateSetting] | None = None):
        """A calibrated policy that lives through every level, as in the sweep; `gate`: its draft
        gate's settings (None: the default gate)."""
        policy = SpecEngine(_settings(base, "adaptive", None), target, drafter, tokenizer).budget_policy
        if gate is not None:
            policy.gate = DraftGate(**gate)
        return policy

    policies = {"adaptive": adaptive_policy()}
    for settings in args.variant:
        policies["adaptive " + ",".join(f"{k}={v}" for k, v in settings.items())] = adaptive_policy(settings)
    if args.variant_no_draft_ahead:
        policies["adaptive no draft ahead"] = adaptive_policy()
        policies["adaptive no draft ahead"].draft_ahead = False

    def fixed_or_plain(budget: int) -> tuple[str, SpecEngine]:
        """A fixed budget's engine by name, or plain decoding's (`ar`) for budget 0."""
        if budget == 0:
            return "ar", _engine(base, "ar", target, None, tokenizer)
        return f"fixed-{budget}", _engine(
            base.model_copy(update={"budget": budget}), "fixed", target, drafter, tokenizer
        )

    for concurrency in levels:
        engines = dict(fixed_or_plain(budget) for budget in budgets)
        for name, policy in policies.items():
            engines[name] = SpecEngine(
                _settings(base, "adaptive", None), target, drafter, tokenizer, budget_policy=policy
            )
        names = list(engines)
        for warmup in range(args.warmup_runs):
            for name in names:
                tag = f"w{concurrency}-{warmup}-{name}"
                run(
                    engines[name],
                    tag,
                    prompts,
                    concurrency,
                    args.max_tokens,
                    defaultdict(list),
                    {},
                    args.requests_per_slot,
                )
        rates: dict[str, list[float]] = {name: [] for name in names}
        steps: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in names}
        by_bucket: dict[str, BucketSteps] = {name: {} for name in names}
        kinds: dict[str, list[str]] = {name: [] for name in policies}
        for round_ in range(args.rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                tag = f"{concurrency}-{round_}-{name}"
                rate, run_kinds = run(
                    engines[name],
                    tag,
                    prompts,
                    concurrency,
                    args.max_tokens,
                    steps[name],
                    by_bucket[name],
                    args.requests_per_slot,
                )
                rates[name].append(rate)
                if name in policies:
                    kinds[name].append(run_kinds)
        fixed = [name for name in names if name not in policies]
        best = max(fixed, key=lambda name: statistics.median(rates[name]))
        print(
            f"c = {concurrency}: " + ", ".join(f"{n} {statistics.median(rates[n]):.0f} tok/s" for n in names)
        )
        for name in policies:
            paired = [a / b for a, b in zip(rates[name], rates[best], strict=True)]
            print(
                f"  {name} / {best}, round by round: median {statistics.median(paired):.3f}, "
                f"mean {statistics.fmean(paired):.3f} (range {min(paired):.3f}-{max(paired):.3f})"
            )
        for name in [*policies, best]:
            print(f"  {name} steps, median / mean ms (count): {kinds_line(steps[name])}")
        for name in policies:
            print(f"  {name} runs' steps: {' '.join(kinds[name][:RUNS_SHOWN])}")
        for name in names:
            print(f"  {name} by (batch bucket, ceiling): {buckets_line(by_bucket[name])}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
