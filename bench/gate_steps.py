"""The adaptive gate's decisions at one concurrency, step by step, beside fixed budgets' runs.

`budget_sweep.py` says how fast the adaptive engine is at a level and `step_kinds.py` which kinds
of steps it took; this says what each step chose and why. One adaptive policy first lives
through `--history` (two closed runs a level, as the sweep's policy has met the lower levels
before), then, for each of `--runs` rounds, fixed-16 and fixed-32 run a closed batch of
`--level` requests (or the level held, `--requests-per-slot`, as the sweep holds it; their steps
by batch bucket) and the adaptive engine runs one, every step
printed: batch size, longest cached context, `c` cruising or `d` planned, its ceiling, the
tokens it made, its wall milliseconds, and at each decision the gate's candidates as
`ceiling: (rate tok/s, predicted ms, forecast tokens, measured ms, tokens ratio, step-time
ratio, marginal-gain ratio)` with the cost curve's verify price at 17, 33 and 65 nodes a tree,
then the `ceiling` call's result and flags (held, kept, probing, probing a neighbour).

    python bench/gate_steps.py --device cuda --dtype bfloat16 --max-seq-len 1024 --max-tokens 256
    python bench/gate_steps.py --device cuda --dtype bfloat16 --max-tokens 64 --level 8 --requests-per-slot 4

It found (H100, fiftieth session, `bench/results/gate_steps_h100_s50_*`) that at c = 16 with
256 tokens the gate's choice of 16 over 32 was right per step at batch 16 (fixed-16 103 tokens
in 4.72 ms, fixed-32 111.5 in 5.31) and lost the closed run in its tail: the slowest request
took 79 steps at 16 against 56 at 32.
"""

import argparse
import sys
import time
from collections import defaultdict

from budget_sweep import _engine, _settings, add_pair_arguments, live_pair
from step_kinds import buckets_line, run

from ddtree_serve.engine.budget import DraftGate
from ddtree_serve.engine.spec_engine import SpecEngine

FIXED_BUDGETS = (16, 32)


def log_decisions(gate: DraftGate, log: list) -> None:
    """Wrap `gate` so each decision's candidates and each `ceiling` call's result go to `log`."""
    drafted_ceilings, ceiling = gate._drafted_ceilings, gate.ceiling

    def logged_drafted_ceilings(acceptance, caps, cost, build, layout, overhead):
        candidates, rates, step_ms, tokens, measured_ms = out = drafted_ceilings(
            acceptance, caps, cost, build, layout, overhead
        )
        batch = len(caps)
        figures = {
            c: (
                round(float(rate)),
                round(float(ms), 2),
                round(float(made), 1),
                round(float(measured), 2),
                round(gate.token_residual.ratio(batch, c), 3),
                round(gate.residual.ratio(batch, c), 3),
                round(gate.marginal.ratio(batch, c), 3),
            )
            for c, rate, ms, made, measured in zip(
                candidates, rates, step_ms, tokens, measured_ms, strict=True
            )
        }
        prices = [round(float(cost.verify_ms(batch, batch * nodes)), 3) for nodes in (17, 33, 65)]
        log.append(("decide", batch, figures, prices))
        return out

    def logged_ceiling(caps, *args, **kwargs):
        chosen = ceiling(caps, *args, **kwargs)
        log.append(("ceiling", len(caps), chosen, gate.held, gate.kept, gate.probing, gate.probing_neighbour))
        return chosen

    gate._drafted_ceilings = logged_drafted_ceilings
    gate.ceiling = logged_ceiling


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_pair_arguments(parser)
    parser.add_argument(
        "--history", default="1,2,4,8", help="levels the policy lives through first (default: %(default)s)"
    )
    parser.add_argument(
        "--level", type=int, default=16, help="the concurrency examined (default: %(default)s)"
    )
    parser.add_argument("--runs", type=int, default=5, help="rounds at the level (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument(
        "--requests-per-slot",
        type=int,
        default=1,
        help="requests each slot runs in turn per run at the level, as the sweep's (1: one closed "
        "batch; more: the concurrency held) (default: %(default)s)",
    )
    args = parser.parse_args()
    held = args.requests_per_slot
    history = [int(c) for c in args.history.split(",") if c]
    base, target, drafter, tokenizer, prompts = live_pair(args, 64, max([args.level, *history]))
    policy = SpecEngine(_settings(base, "adaptive", None), target, drafter, tokenizer).budget_policy
    log: list = []
    log_decisions(policy.gate, log)

    def adaptive() -> SpecEngine:
        return SpecEngine(_settings(base, "adaptive", None), target, drafter, tokenizer, budget_policy=policy)

    for concurrency in history:
        for i in range(2):
            run(
                adaptive(),
                f"h{concurrency}-{i}",
                prompts,
                concurrency,
                args.max_tokens,
                defaultdict(list),
                {},
            )
    fixed = {
        b: _engine(base.model_copy(update={"budget": b}), "fixed", target, drafter, tokenizer)
        for b in FIXED_BUDGETS
    }
    for b, engine in fixed.items():  # graphs met at the level's shapes, before any timed run
        run(engine, f"w{b}", prompts, args.level, args.max_tokens, defaultdict(list), {}, held)
    for round_ in range(args.runs):
        for b, engine in fixed.items():
            by_bucket: dict = {}
            rate, _ = run(
                engine,
                f"f{b}-{round_}",
                prompts,
                args.level,
                args.max_tokens,
                defaultdict(list),
                by_bucket,
                held,
            )
            print(f"fixed-{b} run {round_}: {rate:.0f} tok/s  {buckets_line(by_bucket)}")
        log.clear()
        engine = adaptive()
        steps = []
        step = engine.step

        def logged_step(engine=engine, step=step, steps=steps):
            batch = engine.num_running
            rows = max((r.num_cached_tokens for r in engine.scheduler.running), default=0)
            started = time.perf_counter()
            outputs = step()
            ms = 1000.0 * (time.perf_counter() - started)
            last = policy.last_step
            kind = "c" if engine._cruise_step is not None else "d"
            made = sum(out.num_new_tokens for out in outputs)
            steps.append((batch, rows, kind, 0 if last is None else last.ceiling, made, ms, len(log)))
            return outputs

        engine.step = logged_step
        by_bucket = {}
        rate, _ = run(
            engine, f"a-{round_}", prompts, args.level, args.max_tokens, defaultdict(list), by_bucket, held
        )
        print(f"adaptive run {round_}: {rate:.0f} tok/s  {buckets_line(by_bucket)}")
        shown = 0
        for i, (batch, rows, kind, ceiling, made, ms, upto) in enumerate(steps):
            events = " | ".join(str(event) for event in log[shown:upto])
            shown = upto
            head = f"  {i:3d} b{batch:2d} rows{rows:4d} {kind} ceil {ceiling:2d} tok {made:3d} {ms:6.2f} ms"
            print(f"{head}  {events}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
