"""The table of an A/B of the adaptive budget: paired adaptive / best per concurrency, sweep by sweep.

`bench/h200_run.sh budget_ab` runs `budget_sweep.py` for a base and a head in turn on one
machine and brings their JSONs back in a tar. This reads them (or any sweep JSONs) and prints,
per sweep, the median over its timed rounds of adaptive over the best of `ar` and the fixed
budgets (`budget_sweep.paired_ratios`) at each concurrency, with the sweep's mean; then, per
side, the mean of those over its sweeps, and the levels where every head sweep beat every base
sweep or lost to it. GPU machines drift between rounds (on one H100 `ar` at c = 1 ran 533-721
tok/s across the rounds of one call), so a change is read from all the sweeps of both sides,
not from one pair.

    python bench/ab_summary.py --base /tmp/ab/budget_base*/budget_sweep.json \\
        --head /tmp/ab/budget_head*/budget_sweep.json
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from budget_sweep import paired_ratios  # the sweep's own ratio


def sweep_ratios(path: Path) -> dict[int, float]:
    """Concurrency -> the median paired adaptive / best of one sweep's rounds."""
    data = json.loads(path.read_text())
    return {
        row["concurrency"]: float(np.median(paired_ratios(row, steps["runs"])))
        for row, steps in zip(data["rows"], data["steps"], strict=True)
    }


def table(sides: dict[str, list[Path]]) -> str:
    """Markdown: one line per sweep, then each side's mean per level, then the levels one side won
    in every pairing of its sweeps with the other's."""
    ratios = {name: [sweep_ratios(path) for path in paths] for name, paths in sides.items()}
    levels = sorted({c for sweeps in ratios.values() for sweep in sweeps for c in sweep})
    header = "| sweep | " + " | ".join(f"c = {c}" for c in levels) + " | mean |"
    lines = [header, "|---" * (len(levels) + 2) + "|"]

    def line(label: str, values: list[float]) -> str:
        cells = " | ".join(f"{v:.2f}" for v in values)
        return f"| {label} | {cells} | {float(np.mean(values)):.3f} |"

    for name, sweeps in ratios.items():
        for i, sweep in enumerate(sweeps, start=1):
            lines.append(line(f"{name} {i}", [sweep[c] for c in levels]))
    for name, sweeps in ratios.items():
        lines.append(
            line(f"{name}, mean of {len(sweeps)}", [float(np.mean([s[c] for s in sweeps])) for c in levels])
        )
    if len(ratios) == 2:
        (base_name, base), (head_name, head) = ratios.items()
        won = [c for c in levels if min(s[c] for s in head) > max(s[c] for s in base)]
        lost = [c for c in levels if max(s[c] for s in head) < min(s[c] for s in base)]
        lines.append("")
        lines.append(
            f"{head_name} above every {base_name} sweep at c = {_levels(won)}; below at c = {_levels(lost)}"
        )
    return "\n".join(lines)


def _levels(levels: list[int]) -> str:
    return ", ".join(map(str, levels)) or "none"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", type=Path, nargs="+", required=True, help="the base's sweep JSONs")
    parser.add_argument("--head", type=Path, nargs="+", required=True, help="the head's sweep JSONs")
    parser.add_argument("--base-name", default="base")
    parser.add_argument("--head-name", default="head")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    missing = [str(p) for p in [*args.base, *args.head] if not p.is_file()]
    if missing:
        raise SystemExit(f"ab_summary.py: no such file: {', '.join(missing)}")
    print(table({args.base_name: args.base, args.head_name: args.head}))


if __name__ == "__main__":
    main()
