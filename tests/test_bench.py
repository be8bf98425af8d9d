"""The adaptive-budget benchmarks still run against the engine as it is now.

They wrap the policy's and the gate's calls to log and time them, so a change to one of those
signatures breaks them without failing any engine test (ec7d8a8 added an argument to
`AdaptiveBudget.plan`, and every live `budget_sweep.py` run failed at its first adaptive step
until 8373cae). Each runs here on the tiny test pair, a few tokens at one level.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run_bench(script: str, args: list[str], cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, str(BENCH / script), *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def pair_args(tiny_target_dir, tiny_drafter_dir) -> list[str]:
    return ["--target", str(tiny_target_dir), "--drafter", str(tiny_drafter_dir), "--max-seq-len", "256"]


def test_the_budget_sweep_runs_every_configuration(pair_args, tmp_path):
    args = ["--budgets", "4,8", "--concurrency", "2", "--max-tokens", "6", "--repeats", "1"]
    run_bench(
        "budget_sweep.py",
        [*pair_args, *args, "--out-dir", str(tmp_path), "--traces", str(tmp_path / "traces.json")],
        tmp_path,
    )
    rows = json.loads((tmp_path / "budget_sweep.json").read_text())["rows"]
    assert [row["concurrency"] for row in rows] == [2]
    for row in rows:
        assert all(row[name] > 0 for name in ("ar", "ddtree-4", "ddtree-8", "adaptive"))


def test_step_kinds_runs_a_gate_variant_beside_the_default(pair_args, tmp_path):
    args = [
        "--budgets",
        "4,8",
        "--concurrency",
        "2",
        "--max-tokens",
        "6",
        "--warmup-runs",
        "0",
        "--rounds",
        "1",
    ]
    out = run_bench("step_kinds.py", [*pair_args, *args, "--variant", "drain_power=4"], tmp_path)
    assert "adaptive drain_power=4.0 / fixed-" in out


def test_gate_steps_prints_the_adaptive_steps(pair_args, tmp_path):
    args = ["--history", "1", "--level", "2", "--max-tokens", "6", "--runs", "1"]
    out = run_bench("gate_steps.py", [*pair_args, *args], tmp_path)
    assert "adaptive run 0:" in out and "('ceiling', 2," in out
