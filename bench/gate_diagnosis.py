"""What the adaptive gate forecast for each candidate ceiling, against what its steps measured.

Runs `budget_sweep.py` (same arguments) with the policy's decisions recorded: at each decision
of the gate, per candidate ceiling, its predicted rate (over its measured step-time ratio), its
predicted step milliseconds, that ratio and the tokens it priced the step at; and per adaptive
step, kept by (batch bucket, ceiling), the tokens it made, the tokens its allocation forecast,
its wall time and whether it was settled. Then the gate's marginal gains, the calibrator's
bins and the gate's curve, raw and calibrated. A forecast that prices the wider ceilings' nodes
at nothing, or a ratio that makes one ceiling dear, shows here before it shows as a wrong choice
in the sweep.

As the sweep runs, each adaptive run also prints its steps' choices in order: the ceiling (0:
plain), marked `P` for a probe after plain steps, `N` for a probe of the choice's neighbours
(a plain one included), `h` for a streak's step taken without deciding and `c` for a cruising
step (the streak's width, 0 for a plain streak's), and at each decision
[the plain step's predicted tokens/s | the best drafting ceiling: its predicted tokens/s]. A
level where the gate drafts through every run while the sweep's `ar` beats its fixed budgets
(or the reverse) shows which price was off.

The records hook the policy's methods from outside (the engine has no such hooks: their calls
would cost every step), so this is a diagnostic, not a benchmark: its timings carry the hooks.
They can change what the gate chooses. On an H200 at continuous c = 1, the sweep alone ran the
level at ceiling 32 (fixed-32's tokens a step; 0.89 of the best fixed budget, twice). Under the
hooks, on the same machine, it made 0.95. `--choices-only` keeps the choices and nothing else: no
prices in brackets, no report.

    python bench/gate_diagnosis.py --device cuda --dtype bfloat16 --concurrency 1,16,64
    python bench/gate_diagnosis.py --choices-only --device cuda --dtype bfloat16 --concurrency 1
"""

import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import budget_sweep  # the sweep this wraps

from ddtree_serve.engine.budget import AdaptiveBudget, DraftGate
from ddtree_serve.engine.budget.allocator import plain_decode_rate
from ddtree_serve.engine.budget.draft_gate import _nodes_built
from ddtree_serve.engine.budget.step_residual import batch_bucket
from ddtree_serve.engine.spec_engine import SpecEngine


@dataclass(frozen=True)
class Decision:
    batch_size: int
    ceilings: list[int]
    rates: list[float]  # predicted tokens/s over the measured step-time ratio
    step_ms: list[float]  # predicted, before the ratio
    build_ms: list[float]  # the build's part of step_ms
    draft_ms: float  # the drafter call's and the drafted step's overhead's part of step_ms
    ratios: list[float]
    # Tokens of the step (accepted drafts and bonuses) as the gate priced them: a ceiling wider
    # than the taken one at the taken one's plus its further nodes' gain, not at its own ratio.
    tokens: list[float]
    plain_rate: float  # a plain step's predicted tokens/s over its measured step-time ratio
    plain_ms: float  # a plain step's predicted ms, before its ratio
    plain_ratio: float


@dataclass(frozen=True)
class StepRecord:
    tokens: int
    forecast: float
    ms: float
    settled: bool


decisions: dict[int, list[Decision]] = defaultdict(list)
choices: list[str] = []  # the adaptive steps' choices since the run began (`hook`)
# (configuration, batch bucket) -> (tokens, ms) of each fixed-budget or plain step without prefills
fixed_steps: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
steps: dict[tuple[int, int], list[StepRecord]] = defaultdict(list)
policies: list[AdaptiveBudget] = []


def hook(choices_only: bool = False) -> None:
    """Wrap the gate's candidate pricing and the policy's observe/record to keep the records;
    `choices_only`: the gate's choice and the cruise alone (each run's choices)."""
    drafted_ceilings = DraftGate._drafted_ceilings
    observe, record_step_ms = AdaptiveBudget.observe, AdaptiveBudget.record_step_ms
    init = AdaptiveBudget.__init__
    gate_ceiling, cruised = DraftGate.ceiling, AdaptiveBudget.cruised
    sweep_run = budget_sweep.tokens_per_s
    pending: dict[int, tuple[int, int, int, float, bool]] = {}
    priced_now: dict[str, str] = {}  # the decision's prices, when the gate decided this step

    def priced(self: DraftGate, acceptance, caps, cost, build, layout, overhead):
        ceilings, rates, step_ms, forecast, measured_ms = drafted_ceilings(
            self, acceptance, caps, cost, build, layout, overhead
        )
        batch_size = len(caps)
        ratios = (measured_ms / step_ms).tolist()
        tokens = (rates * measured_ms / 1000.0).tolist()  # what the rate was made of
        plain_ratio = self.residual.ratio(batch_size, 0)
        plain_rate = plain_decode_rate(batch_size, cost, overhead.plain_ms) / plain_ratio
        plain_ms = float(cost.verify_ms(batch_size, batch_size)) + overhead.plain_ms
        build_ms = build.ms(batch_size, _nodes_built(caps, ceilings), np.minimum(ceilings, max(caps)))
        best = int(np.argmax(rates))
        priced_now["decision"] = f"[{plain_rate:.0f}|{ceilings[best]}:{float(rates[best]):.0f}]"
        decisions[batch_bucket(batch_size)].append(
            Decision(
                batch_size,
                list(ceilings),
                rates.tolist(),
                step_ms.tolist(),
                np.broadcast_to(build_ms, len(ceilings)).tolist(),
                cost.draft_ms(batch_size) + overhead.drafted_ms,
                ratios,
                tokens,
                plain_rate,
                plain_ms,
                plain_ratio,
            )
        )
        return ceilings, rates, step_ms, forecast, measured_ms

    def observed(self: AdaptiveBudget, trees, accepted, padded_num_nodes=None):
        step = observe(self, trees, accepted, padded_num_nodes)
        batch_size = trees.batch_size
        pending[id(self)] = (
            batch_size,
            step.ceiling,
            step.accepted + batch_size,
            step.predicted_accepted + batch_size,
            self.settled,
        )
        return step

    def recorded(self: AdaptiveBudget, step_ms: float, draft_unused: bool = False) -> None:
        if id(self) in pending:
            batch_size, ceiling, tokens, forecast, settled = pending.pop(id(self))
            steps[(batch_bucket(batch_size), ceiling)].append(StepRecord(tokens, forecast, step_ms, settled))
        record_step_ms(self, step_ms, draft_unused)

    def chose(self: DraftGate, caps, *args, **kwargs) -> int:
        priced_now.clear()
        ceiling = gate_ceiling(self, caps, *args, **kwargs)
        held = "h" if self.held or self.kept else ""
        mark = "P" if self.probing else "N" if self.probing_neighbour else held
        choices.append(f"{ceiling}{mark}{priced_now.get('decision', '')}")
        return ceiling

    def cruised_step(self: AdaptiveBudget, trees, accepted, *args, **kwargs):
        choices.append(f"{self._cruise.width if self._cruise else '?'}c")
        return cruised(self, trees, accepted, *args, **kwargs)

    def timed_run(engine, prompts, concurrency, max_tokens, tag, log, requests_per_slot=1) -> float:
        choices.clear()
        rate = sweep_run(engine, prompts, concurrency, max_tokens, tag, log, requests_per_slot)
        if engine.budget_policy is not None:
            print(f"  c={concurrency} run {tag}, {rate:.0f} tok/s: " + " ".join(choices), flush=True)
        return rate

    def initialized(self: AdaptiveBudget, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        policies.append(self)

    engine_step = SpecEngine.step

    def stepped(self: SpecEngine) -> list:
        # Adaptive, a prefill step, or the untimed run that records traces (its host work is
        # the recording's): not a fixed budget's own step.
        if (
            self.budget_policy is not None
            or self.num_waiting
            or isinstance(self.drafter, budget_sweep.RecordingDrafter)
        ):
            return engine_step(self)
        batch_size, started = self.num_running, time.perf_counter()
        outputs = engine_step(self)
        ms = 1000.0 * (time.perf_counter() - started)
        name = f"{self.settings.mode}-{self.settings.budget}" if self.drafter is not None else "ar"
        fixed_steps[(name, batch_bucket(batch_size))].append((sum(o.num_new_tokens for o in outputs), ms))
        return outputs

    DraftGate.ceiling = chose  # type: ignore[method-assign]
    AdaptiveBudget.cruised = cruised_step  # type: ignore[method-assign]
    budget_sweep.tokens_per_s = timed_run
    if choices_only:
        return
    SpecEngine.step = stepped  # type: ignore[method-assign]
    DraftGate._drafted_ceilings = priced  # type: ignore[method-assign]
    AdaptiveBudget.observe = observed  # type: ignore[method-assign]
    AdaptiveBudget.record_step_ms = recorded  # type: ignore[method-assign]
    AdaptiveBudget.__init__ = initialized  # type: ignore[method-assign]


def report(last: int = 20) -> list[str]:
    lines = []
    for bucket in sorted(decisions):
        recent = decisions[bucket][-last:]
        sizes = sorted({d.batch_size for d in recent})
        lines.append(f"== batch bucket {bucket}: the last {len(recent)} decisions (batch sizes {sizes})")
        lines.append(
            f"  plain      : rate {statistics.mean(d.plain_rate for d in recent):9.1f} tok/s, "
            f"predicted {statistics.mean(d.plain_ms for d in recent):6.2f} ms x ratio "
            f"{statistics.mean(d.plain_ratio for d in recent):4.2f}"
        )
        for j, ceiling in enumerate(recent[-1].ceilings):
            rows = [d for d in recent if len(d.ceilings) > j and d.ceilings[j] == ceiling]
            lines.append(
                f"  ceiling {ceiling:3d}: rate {statistics.mean(d.rates[j] for d in rows):9.1f} tok/s, "
                f"predicted {statistics.mean(d.step_ms[j] for d in rows):6.2f} ms "
                f"(draft {statistics.mean(d.draft_ms for d in rows):4.2f}, "
                f"build {statistics.mean(d.build_ms[j] for d in rows):4.2f}, forward "
                f"{statistics.mean(d.step_ms[j] - d.draft_ms - d.build_ms[j] for d in rows):4.2f}) x ratio "
                f"{statistics.mean(d.ratios[j] for d in rows):4.2f}, "
                f"forecast {statistics.mean(d.tokens[j] for d in rows):7.2f} tokens"
            )
    lines.append("== adaptive steps by (batch bucket, ceiling): tokens (forecast), ms, tokens/ms")
    for (bucket, ceiling), records in sorted(steps.items()):
        settled = sum(r.settled for r in records)
        tokens = statistics.mean(r.tokens for r in records)
        forecast = statistics.mean(r.forecast for r in records)
        ms = statistics.mean(r.ms for r in records)
        lines.append(
            f"  bucket {bucket:3d} ceiling {ceiling:3d}: {len(records):4d} steps ({settled} settled), "
            f"tokens {tokens:7.2f} (forecast {forecast:7.2f}), {ms:6.2f} ms, {tokens / ms:6.2f} tokens/ms"
        )
    lines.append("== fixed-budget and plain steps by batch bucket (no prefill): tokens, ms, tokens/ms")
    for (name, bucket), records in sorted(fixed_steps.items(), key=lambda item: (item[0][1], item[0][0])):
        tokens = statistics.mean(t for t, _ in records)
        ms = statistics.mean(m for _, m in records)
        lines.append(
            f"  bucket {bucket:3d} {name:10s}: {len(records):4d} steps, tokens {tokens:7.2f}, "
            f"{ms:6.2f} ms, {tokens / ms:6.2f} tokens/ms"
        )
    if policies:
        lines += _marginal_gains(policies[0].gate)
        lines += _calibration(policies[0])
    return lines


def _marginal_gains(gate: DraftGate) -> list[str]:
    """Per batch bucket, each ceiling's gain over the next narrower one, made over forecast as the
    gate reads it (`marginal_gain.py`; 1.00 where nothing was measured or it fell below 1)."""
    keys = sorted(gate.marginal._windows)
    lines = ["== marginal gain (made over forecast tokens past the next narrower ceiling), by bucket"]
    for bucket in sorted({b for b, _ in keys}):
        ratios = [f"{c}: {gate.marginal.ratio(bucket, c):.2f}" for b, c in keys if b == bucket]
        lines.append(f"  bucket {bucket:3d}: " + ", ".join(ratios))
    return lines


def _calibration(policy: AdaptiveBudget) -> list[str]:
    calibrator = policy.calibrator
    nodes, accepted, prob_sum = calibrator._stats
    _, table = calibrator._interpolation_table()
    lines = ["== calibrator bins (decayed): centre, nodes, mean drafter p, accepted rate, calibrated"]
    for j in np.flatnonzero(nodes > 0.01):
        lines.append(
            f"  {calibrator._centres[j]:.4f}: {nodes[j]:8.1f} nodes, p {prob_sum[j] / nodes[j]:.4f}, "
            f"rate {accepted[j] / nodes[j]:.4f}, calibrated {table[j + 1]:.4f}"
        )
    curve = policy.gate.curve
    if curve is not None:
        lines.append(f"gate curve, raw: {np.round(curve[:64], 4).tolist()}")
        calibrated = calibrator.calibrate(curve[:64]) * policy.gate.spread[:64]
        lines.append(f"gate curve, calibrated: {np.round(calibrated, 4).tolist()}")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """`budget_sweep.py`'s arguments, and `--choices-only` (module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    choices_only = "--choices-only" in args
    if "-h" in args or "--help" in args:
        print("gate_diagnosis.py [--choices-only: the choices alone] BUDGET_SWEEP_ARGUMENTS\n")
    hook(choices_only)
    budget_sweep.main([a for a in args if a != "--choices-only"])
    if not choices_only:
        print("\n".join(report()))


if __name__ == "__main__":
    main()
