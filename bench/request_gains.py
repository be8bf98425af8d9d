"""Per prompt: the steps a closed batch's requests take at each fixed budget, and what the
drafter said of them.

A closed batch lasts as long as its slowest request, so what a wider tree is worth there is what
it gives that request, not the batch's mean: on the H200 at c = 8 fixed-32 and fixed-64 both ran
20 steps, where the adaptive engine's steps at ceiling 16 made 5% fewer tokens than fixed-32's
and its runs took 22-23. This runs the sweep's prompts as one closed batch at each budget and
reports per prompt the steps its request took (its output's steps), its accepted draft tokens
per step, and the drafter's expected accepted tokens per step (the sum of its tree's node
probabilities, uncalibrated): whether the slowest request gains more from width than the others,
and whether the drafter's own confidence singles it out, which a policy for closed batches would
need. A diagnostic: nothing is timed.

    python bench/request_gains.py --device cuda --dtype bfloat16 --budgets 8 16 32 64
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import budget_sweep  # the sweep's prompts and model pair

from ddtree_serve.engine.sampling_params import SamplingParams


class SlotRecorder:
    """Each draft's per-slot expected accepted tokens (the tree's node probabilities summed) and
    each verify's accepted draft tokens, by slot."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.expected: dict[int, list[float]] = {}
        self.accepted: dict[int, list[int]] = {}
        self._slots: list[int] = []

    def drafted(self, inputs, output) -> None:
        self._slots = list(inputs.slots)
        trees = budget_sweep.draft_trees(inputs, output, self.budget)
        for slot, tree in zip(self._slots, trees, strict=True):
            self.expected.setdefault(slot, []).append(float(np.exp(tree.logws[1:]).sum()))

    def reset(self) -> None:
        self.expected, self.accepted, self._slots = {}, {}, []

    def verified(self, output) -> None:
        if len(self._slots) != len(output.accept_len):  # a start-up verify without its draft
            self._slots = []
            return
        for slot, accepted in zip(self._slots, output.accept_len.tolist(), strict=True):
            self.accepted.setdefault(slot, []).append(int(accepted))
        self._slots = []


def run(args: argparse.Namespace) -> dict:
    budgets = sorted(args.budgets)
    base, target, drafter, tokenizer, prompts = budget_sweep.live_pair(args, max(budgets), args.concurrency)
    report: dict = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "budgets": {}}
    for budget in budgets:
        recorder = SlotRecorder(budget)
        config = base.model_copy(update={"budget": budget})
        engine = budget_sweep.recording_engine(config, target, drafter, tokenizer, recorder)
        recorder.reset()  # the engine's start-up capture of graphs drafted and verified scratch slots
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(args.concurrency):
            engine.add_request(f"r{budget}-{i}", prompts[i % len(prompts)], params)
        steps_of: dict[str, int] = {}
        slot_of: dict[str, int] = {}
        total_steps = 0
        while engine.has_unfinished_requests():
            total_steps += 1
            slot_of.update((rid, r.slot) for rid, r in engine._requests.items() if r.slot is not None)
            for out in engine.step():
                if out.num_new_tokens:
                    steps_of[out.request_id] = steps_of.get(out.request_id, 0) + 1
        per_request = []
        for i in range(args.concurrency):
            request_id = f"r{budget}-{i}"
            slot = slot_of[request_id]
            per_request.append(
                {
                    "prompt": i % len(prompts),
                    "steps": steps_of[request_id],
                    "accepted_per_step": float(np.mean(recorder.accepted[slot])),
                    "expected_per_step": float(np.mean(recorder.expected[slot])),
                }
            )
        report["budgets"][budget] = {"run_steps": total_steps, "requests": per_request}
        print(f"budget {budget}: {total_steps} steps", flush=True)
        for entry in per_request:
            print(
                f"  prompt {entry['prompt']}: {entry['steps']} steps, accepted"
                f" {entry['accepted_per_step']:.2f} / expected {entry['expected_per_step']:.2f}"
                " draft tokens a step",
                flush=True,
            )
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    budget_sweep.add_pair_arguments(parser)
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--concurrency", type=int, default=8, help="requests in the closed batch")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report = run(args)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
