"""`python -m ddtree_serve.training`: train the bundled tokenizer + target + DFlash drafter pair."""

import argparse
import sys
from pathlib import Path

import torch

from ddtree_serve.training.pipeline import train_pair
from ddtree_serve.training.recipe import PRESETS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ddtree_serve.training",
        description=(
            "Train the bundled model pair on the running interpreter's standard library: "
            "a byte-level BPE tokenizer, a Qwen3 target and a DFlash drafter (stages run in that "
            "order). Writes OUT/target/, OUT/drafter/ (HF-style: config.json, model.safetensors, "
            "tokenizer.json) and OUT/training_report.json."
        ),
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs/pair"), help="output directory (default: runs/pair)"
    )
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="full", help="model sizes and schedule (default: full)"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="shorthand for --preset smoke (tiny, CPU, seconds)"
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--target-budget-s", type=float, default=None, help="wall-clock budget of the target stage"
    )
    parser.add_argument(
        "--drafter-budget-s", type=float, default=None, help="wall-clock budget of the drafter stage"
    )
    parser.add_argument(
        "--tokenizer", type=Path, default=None, help="reuse this tokenizer.json instead of training one"
    )
    parser.add_argument(
        "--drafter-from",
        type=Path,
        default=None,
        help="continue training the drafter in this model directory instead of a fresh one",
    )
    parser.add_argument("--drafter-lr", type=float, default=None, help="peak learning rate of the drafter")
    parser.add_argument(
        "--generated-seqs", type=int, default=None, help="target continuations the drafter trains on"
    )
    parser.add_argument(
        "--target-from",
        type=Path,
        default=None,
        help="reuse the target in this model directory (skip target training; needs its tokenizer)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    recipe = PRESETS["smoke" if args.smoke else args.preset].with_overrides(
        target_budget_s=args.target_budget_s,
        drafter_budget_s=args.drafter_budget_s,
        drafter_lr=args.drafter_lr,
        generated_seqs=args.generated_seqs,
    )
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = args.tokenizer
    if args.target_from is not None and tokenizer is None:
        tokenizer = args.target_from / "tokenizer.json"
    train_pair(
        recipe,
        args.out,
        device,
        args.seed,
        tokenizer_path=tokenizer,
        target_from=args.target_from,
        drafter_from=args.drafter_from,
        command=" ".join(["python -m ddtree_serve.training", *(sys.argv[1:] if argv is None else argv)]),
    )


if __name__ == "__main__":
    main()
