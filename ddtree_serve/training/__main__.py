"""`python -m ddtree_serve.training`: train the bundled tokenizer + target + DFlash drafter pair."""

import argparse
import math
import sys
from pathlib import Path

import torch

from ddtree_serve.config import model_dir_problem
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
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument(
        "--target-budget-s",
        type=_positive,
        default=None,
        help="wall-clock budget of the target stage (default: the preset's)",
    )
    parser.add_argument(
        "--drafter-budget-s",
        type=_positive,
        default=None,
        help="wall-clock budget of the drafter stage (default: the preset's)",
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
    parser.add_argument(
        "--drafter-lr",
        type=_positive,
        default=None,
        help="peak learning rate of the drafter (default: the preset's)",
    )
    parser.add_argument(
        "--generated-seqs",
        type=_at_least_one,
        default=None,
        help="target continuations the drafter trains on (default: the preset's)",
    )
    parser.add_argument(
        "--target-from",
        type=Path,
        default=None,
        help="reuse the target in this model directory (skip target training; needs its tokenizer)",
    )
    args = parser.parse_args(argv)
    if problem := _input_problem(args):
        parser.error(problem)
    return args


def _positive(text: str) -> float:
    value = float(text)
    if not 0.0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _input_problem(args: argparse.Namespace) -> str | None:
    """What would stop a run after minutes of training, found before it starts (None: nothing)."""
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            return f"--device {args.device}: not a torch device (train on cpu or cuda)"
        if device.type == "cuda" and not torch.cuda.is_available():
            return f"--device {args.device}: CUDA is not available here"
        if device.type not in ("cpu", "cuda"):
            return f"--device {args.device}: train on cpu or cuda"
    if args.tokenizer is not None and not args.tokenizer.is_file():
        return f"--tokenizer {args.tokenizer}: no such file"
    for flag, directory in (("--target-from", args.target_from), ("--drafter-from", args.drafter_from)):
        if directory is not None and (problem := model_dir_problem(directory)):
            return f"{flag} {directory}: {problem}"
    if args.out.exists() and not args.out.is_dir():
        return f"--out {args.out}: exists and is not a directory"
    return None


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
