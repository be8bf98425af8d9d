"""What a newcomer costs a held concurrency: its prefill, and its first draft's catch-up.

The budget sweep's continuous arrivals (`budget_sweep.py --requests-per-slot N`) pay two
per-request costs the adaptive gate does not price: the target's prefill of each newcomer's
prompt (every mode pays it, but in calls whose size depends on how requests finish: plain
decoding's one at a time, drafting's a few together) and the drafter's catch-up (a newcomer's
first draft takes its whole prompt; plain decoding never drafts). This runs plain decoding and
fixed budgets under staggered arrivals (the sweep's own runs) and times every drafter call by
how many newcomers it took, and every prefill by how many prompts, each call synchronized with
the device (so the figures are the calls' own, not the overlapped engine's). It reports, per
configuration and concurrency: the drafter's median ms by newcomers in the call and the least-
squares ms per newcomer over the calls without them; prefill calls per step and their median
ms by prompts. `bench/fake_device.py --catch-up-ms` takes the first figure.

    python bench/arrival_costs.py --device cuda --dtype bfloat16 --concurrency 16 64
"""

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from budget_sweep import StepLog, add_pair_arguments, live_pair, tokens_per_s  # the sweep's pair, runs

from ddtree_serve.engine.spec_engine import SpecEngine


class CallTimes:
    """Synchronized wall ms of the drafter's and the target's prefill calls, by newcomers and
    prompts per call (`watch` wraps them)."""

    def __init__(self, device: str) -> None:
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        # (batch, newcomers in the call) -> ms: a call's price moves with its batch, which drains
        # at a run's end, so newcomers are compared within one batch size
        self.drafts: dict[tuple[int, int], list[float]] = defaultdict(list)
        self.prefills: dict[int, list[float]] = defaultdict(list)  # prompts in the call -> ms
        self._drafted: set[int] = set()  # slots drafted since their request began

    def watch(self, target, drafter) -> None:
        draft, release, prefill = drafter.draft, drafter.release, target.prefill

        def timed_draft(inputs):
            newcomers = len(set(inputs.slots) - self._drafted)
            self._drafted.update(inputs.slots)
            self.sync()
            started = time.perf_counter()
            output = draft(inputs)
            self.sync()
            self.drafts[len(inputs.slots), newcomers].append(1000.0 * (time.perf_counter() - started))
            return output

        def released(slot: int) -> None:
            self._drafted.discard(slot)
            release(slot)

        def timed_prefill(inputs):
            self.sync()
            started = time.perf_counter()
            output = prefill(inputs)
            self.sync()
            self.prefills[len(inputs.prompts)].append(1000.0 * (time.perf_counter() - started))
            return output

        drafter.draft, drafter.release, target.prefill = timed_draft, released, timed_prefill

    def reset(self) -> None:
        self.drafts.clear()
        self.prefills.clear()

    def full_batch_drafts(self, batch_size: int) -> dict[int, list[float]]:
        """The drafter's calls over the whole batch, by newcomers."""
        return {n: ms for (batch, n), ms in self.drafts.items() if batch == batch_size}

    def ms_per_newcomer(self, batch_size: int) -> float | None:
        """Least squares, over the whole batch's calls, of (draft ms - the median such call
        without newcomers) on newcomers."""
        drafts = self.full_batch_drafts(batch_size)
        if not drafts.get(0) or len(drafts) < 2:
            return None
        base = statistics.median(drafts[0])
        counts = np.array([n for n, times in drafts.items() if n for _ in times], dtype=float)
        extra = np.array([ms - base for n, times in drafts.items() if n for ms in times])
        return float(counts @ extra / (counts @ counts))


def medians(times: dict[int, list[float]]) -> str:
    return ", ".join(f"{n}: {statistics.median(ms):.2f} ({len(ms)})" for n, ms in sorted(times.items()))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    base, target, drafter, tokenizer, prompts = live_pair(args, max(args.budgets), max(args.concurrency))
    clock = CallTimes(args.device)
    clock.watch(target, drafter)
    engines = {
        "ar": SpecEngine(base.model_copy(update={"mode": "ar"}).to_settings(), target, None, tokenizer)
    }
    for budget in args.budgets:
        settings = base.model_copy(update={"budget": budget}).to_settings()
        engines[f"ddtree-{budget}"] = SpecEngine(settings, target, drafter, tokenizer)
    lines = [
        f"# Arrival costs, {args.device} {args.dtype}, {args.max_tokens} tokens a request, "
        f"{args.requests_per_slot} requests a slot (staggered), {args.runs} runs",
        "",
        "| c | config | tok/s | steps | prefills / step | prefill ms by prompts (calls) "
        "| whole-batch draft ms by newcomers (calls) | ms / newcomer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)  # the rows below it as they come: a log cut short keeps them
    for concurrency in args.concurrency:
        for name, engine in engines.items():
            tokens_per_s(
                engine, prompts, concurrency, args.max_tokens, "warmup", StepLog(), args.requests_per_slot
            )
            clock.reset()
            log = StepLog()
            rates = [
                tokens_per_s(
                    engine, prompts, concurrency, args.max_tokens, f"r{run}", log, args.requests_per_slot
                )
                for run in range(args.runs)
            ]
            per_newcomer = clock.ms_per_newcomer(concurrency)
            prefill_calls = sum(len(ms) for ms in clock.prefills.values())
            drafts = medians(clock.full_batch_drafts(concurrency)) or "-"
            newcomer = "-" if per_newcomer is None else f"{per_newcomer:.3f}"
            line = (
                f"| {concurrency} | {name} | {statistics.median(rates):.0f} | {log.steps} | "
                f"{prefill_calls / max(log.steps, 1):.2f} | {medians(clock.prefills)} | {drafts} | "
                f"{newcomer} |"
            )
            print(line, flush=True)
            lines.append(line)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "arrival_costs.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out_dir / 'arrival_costs.md'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_pair_arguments(parser)
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[4, 16, 64], help="(default: %(default)s)"
    )
    parser.add_argument(
        "--budgets", type=int, nargs="+", default=[8, 32], help="fixed budgets (default: %(default)s)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="new tokens a request (default: %(default)s)"
    )
    parser.add_argument(
        "--requests-per-slot",
        type=int,
        default=4,
        help="requests each slot runs in turn (default: %(default)s)",
    )
    parser.add_argument(
        "--runs", type=int, default=2, help="timed runs per configuration (default: %(default)s)"
    )
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args(argv)
    if args.requests_per_slot < 2:
        parser.error("--requests-per-slot must be at least 2: arrivals need slots that turn over")
    return args


if __name__ == "__main__":
    main()
