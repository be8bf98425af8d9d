"""How the acceptance calibrator's forecast errs by node depth, and past a narrower ceiling.

The adaptive gate prices a ceiling wider than the one it runs from the forecast of nodes its
streak never verifies (`DraftGate._drafted_ceilings`): on an H100 at batch 1 a ceiling-32 streak
forecast 64's nodes past 32 at 0.15 tokens a step where fixed-64 made 0.54 more than fixed-32.
This runs the sweep's prompts at one fixed budget, records every verified tree's nodes (depth,
best-first rank, drafter probability, accepted or not), fits the engine's calibrator
(`AcceptanceCalibrator`, bins of the drafter's probability) on the nodes at ranks up to
`--split` alone, as a streak at that ceiling would see them, and compares what it forecasts with
what the nodes made: per depth, inside the split and past it, and in total.

For comparison it fits a chain-rule calibrator the same way: a node's probability given its
parent's (drafter probability over the parent's), calibrated on nodes whose parent was accepted,
multiplied along the path. Greedy verification only (`--max-tokens` new tokens a request,
`ignore_eos`). A diagnostic: nothing is timed.

    python bench/calibration_by_depth.py --dtype bfloat16 --prompt-set heldout --split 32
"""

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import budget_sweep  # the sweep's prompts, model pair and recording wrappers

from ddtree_serve.engine.budget.calibration import AcceptanceCalibrator
from ddtree_serve.engine.sampling_params import SamplingParams


@dataclass
class NodeRecorder:
    """Each verified tree's draft nodes: depth, rank (1 = likeliest), drafter probability, the
    probability given its parent, the parent's row in these arrays (-1: the root's child) and
    whether verification accepted it."""

    budget: int
    columns: dict[str, list[np.ndarray]] = field(default_factory=dict)
    num_trees: int = 0
    _trees: list = field(default_factory=list)
    _num_nodes: int = 0

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.columns = {k: [] for k in ("depth", "rank", "prob", "given_parent", "parent", "accepted")}
        self.num_trees = self._num_nodes = 0
        self._trees = []

    def drafted(self, inputs, output) -> None:
        self._trees = budget_sweep.draft_trees(inputs, output, self.budget)

    def verified(self, output) -> None:
        trees, self._trees = self._trees, []
        if len(trees) != len(output.accept_len):  # a start-up verify without its draft
            return
        accept_index, accept_len = output.accept_index.tolist(), output.accept_len.tolist()
        for tree, path, length in zip(trees, accept_index, accept_len, strict=True):
            num_draft = tree.num_nodes - 1
            accepted = np.zeros(num_draft, dtype=bool)
            accepted[np.asarray(path[1 : 1 + length], dtype=np.int64) - 1] = True
            parents = tree.parents[1:]
            probs = np.exp(tree.logws[1:])
            self.columns["depth"].append(tree.depths[1:])
            self.columns["rank"].append(np.arange(1, num_draft + 1))
            self.columns["prob"].append(probs)
            self.columns["given_parent"].append(np.exp(tree.logws[1:] - tree.logws[parents]))
            self.columns["parent"].append(np.where(parents > 0, parents - 1 + self._num_nodes, -1))
            self.columns["accepted"].append(accepted)
            self._num_nodes += num_draft
            self.num_trees += 1

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.concatenate(v) for k, v in self.columns.items()}


def record(args: argparse.Namespace) -> NodeRecorder:
    base, target, drafter, tokenizer, prompts = budget_sweep.live_pair(args, args.budget, args.concurrency)
    recorder = NodeRecorder(args.budget)
    engine = budget_sweep.recording_engine(base, target, drafter, tokenizer, recorder)
    recorder.reset()  # the engine's start-up capture of graphs drafted and verified scratch slots
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for start in range(0, len(prompts), args.concurrency):
        for i, prompt in enumerate(prompts[start : start + args.concurrency]):
            engine.add_request(f"r{start + i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    return recorder


def chain_calibrated(nodes: dict[str, np.ndarray], inside: np.ndarray) -> np.ndarray:
    """The chain-rule forecast: the probability given the parent, calibrated on the nodes inside
    the split whose parent was accepted, times the parent's forecast."""
    parent_accepted = np.where(nodes["parent"] >= 0, nodes["accepted"][np.maximum(nodes["parent"], 0)], True)
    train = inside & parent_accepted
    calibrator = AcceptanceCalibrator()
    calibrator.observe(nodes["given_parent"][train], nodes["accepted"][train])
    step = calibrator.calibrate(nodes["given_parent"])
    forecast = np.empty_like(step)
    for i, parent in enumerate(nodes["parent"].tolist()):  # parents precede their children
        forecast[i] = step[i] * (forecast[parent] if parent >= 0 else 1.0)
    return forecast


def analyse(nodes: dict[str, np.ndarray], num_trees: int, split: int) -> dict:
    inside, past = nodes["rank"] <= split, nodes["rank"] > split
    calibrator = AcceptanceCalibrator()
    calibrator.observe(nodes["prob"][inside], nodes["accepted"][inside])
    forecasts = {
        "drafter": nodes["prob"],
        "calibrated": calibrator.calibrate(nodes["prob"]),
        "chain": chain_calibrated(nodes, inside),
    }
    made = nodes["accepted"].astype(np.float64)

    def per_tree(values: np.ndarray, mask: np.ndarray) -> float:
        return float(values[mask].sum()) / num_trees

    report: dict = {"trees": num_trees, "split": split, "totals": {}, "depths": []}
    for side, mask in (("inside", inside), ("past", past)):
        report["totals"][side] = {"made": per_tree(made, mask)} | {
            name: per_tree(values, mask) for name, values in forecasts.items()
        }
    for depth in range(1, int(nodes["depth"].max(initial=0)) + 1):
        at = nodes["depth"] == depth
        row: dict = {"depth": depth}
        for side, mask in (("inside", inside & at), ("past", past & at)):
            row[side] = {"nodes": int(mask.sum()), "made": per_tree(made, mask)} | {
                name: per_tree(values, mask) for name, values in forecasts.items()
            }
        report["depths"].append(row)
    return report


def print_report(report: dict) -> None:
    split = report["split"]
    print(f"{report['trees']} verified trees; the calibrators learn ranks 1-{split} only")
    print("accepted draft tokens a tree: made | drafter, calibrated, chain-rule forecasts")
    for side, label in (("inside", f"ranks 1-{split}"), ("past", f"ranks past {split}")):
        t = report["totals"][side]
        print(f"  {label:>15}: {t['made']:.3f} | {t['drafter']:.3f}, {t['calibrated']:.3f}, {t['chain']:.3f}")
    print("per depth, per 100 trees: nodes, made | calibrated, chain-rule (inside ; past)")
    for row in report["depths"]:
        i, p = row["inside"], row["past"]
        print(
            f"  {row['depth']:3d}: {i['nodes']:6d} {100 * i['made']:6.2f} | {100 * i['calibrated']:6.2f}"
            f" {100 * i['chain']:6.2f} ; {p['nodes']:6d} {100 * p['made']:6.2f} |"
            f" {100 * p['calibrated']:6.2f} {100 * p['chain']:6.2f}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    budget_sweep.add_pair_arguments(parser)
    parser.add_argument("--budget", type=int, default=64, help="the fixed budget run (default: %(default)s)")
    parser.add_argument(
        "--split",
        type=int,
        default=32,
        help="the narrower ceiling the calibrators see (default: %(default)s)",
    )
    parser.add_argument("--concurrency", type=int, default=1, help="requests a batch (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, help="(default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    if not 0 < args.split < args.budget:
        parser.error("--split must be between 0 and --budget")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    recorder = record(args)
    report = analyse(recorder.arrays(), recorder.num_trees, args.split)
    print_report(report)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
