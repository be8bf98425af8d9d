"""Cost curves: interpolation, live refresh, the tolerant file loader and start-up measurement."""

import json
from pathlib import Path

import numpy as np
import pytest

from ddtree_serve.engine.budget import (
    CostCurve,
    buckets_upto,
    load_cost_curve,
    measure_cost_curve,
    powers_of_two_upto,
)
from ddtree_serve.engine.budget.cost_curve import MAX_DRIFT_MOVE


def grid_curve() -> CostCurve:
    return CostCurve([1, 4], [4, 16, 64], [[2.0, 4.0, 10.0], [3.0, 6.0, 12.0]], draft_ms=[1.0, 2.0])


def test_interpolates_between_and_extrapolates_past_the_grid():
    curve = grid_curve()
    assert float(curve.verify_ms(1, 16)) == pytest.approx(4.0)
    assert float(curve.verify_ms(1, 10)) == pytest.approx(3.0)  # halfway along tokens
    assert float(curve.verify_ms(2.5, 16)) == pytest.approx(5.0)  # halfway along batch
    assert float(curve.verify_ms(1, 112)) == pytest.approx(16.0)  # last slope: 6 ms per 48 tokens
    assert float(curve.verify_ms(1, 1)) == pytest.approx(2.0)  # never cheaper than the smallest
    np.testing.assert_allclose(curve.verify_ms(4, np.array([4, 64])), [3.0, 12.0])
    assert curve.draft_ms(2.5) == pytest.approx(1.5)


def test_live_timings_pull_the_curve_toward_what_was_measured():
    curve = grid_curve()
    for _ in range(200):
        curve.observe_verify(1, 16, 8.0)
        curve.observe_draft(4, 1.0)
    assert float(curve.verify_ms(1, 16)) == pytest.approx(8.0, rel=0.02)
    assert curve.draft_ms(4) == pytest.approx(1.0, rel=0.02)


def test_a_machine_slower_than_at_start_up_prices_the_cells_it_did_not_time_alike():
    """Only plain verifies are timed (the policy decodes plainly) and they take 1.5x their
    start-up price: wide verifies and the drafter, never timed since, cost 1.5x too, so the
    steps the policy turned away from do not look cheaper than they are."""
    curve = grid_curve()
    for _ in range(100):
        curve.observe_verify(4, 4, 4.5)
    assert float(curve.verify_ms(4, 4)) == pytest.approx(4.5, rel=0.01)
    np.testing.assert_allclose(curve.verify_ms(4, np.array([16, 64])), [9.0, 18.0], rtol=0.02)
    assert float(curve.verify_ms(1, 64)) == pytest.approx(15.0, rel=0.02)
    assert curve.draft_ms(4) == pytest.approx(3.0, rel=0.02)
    frozen = grid_curve()
    frozen.ema_weight = 0.0
    frozen.observe_verify(4, 4, 4.5)
    assert frozen.draft_ms(4) == 2.0 and float(frozen.verify_ms(4, 4)) == 3.0


def test_one_outlier_timing_moves_the_curve_a_bounded_step():
    """A CUDA graph captured mid-run makes one verify and one draft 100x slow: each moves its
    own cell as if it had been four times its prediction, and the verify every cell by a few
    percent (the machine's drift), not a hundred times."""
    curve = grid_curve()
    curve.observe_verify(1, 16, 400.0)
    curve.observe_draft(4, 200.0)
    drift_move = 1 + (MAX_DRIFT_MOVE - 1) * curve.ema_weight
    assert float(curve.verify_ms(1, 16)) == pytest.approx(4.0 * (1 + 3 * curve.ema_weight) * drift_move)
    assert curve.draft_ms(4) == pytest.approx(2.0 * (1 + 3 * curve.ema_weight) * drift_move)
    assert float(curve.verify_ms(4, 64)) == pytest.approx(12.0 * drift_move)


def test_loader_reads_the_grid_form_and_round_trips(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(grid_curve().to_json()))
    loaded = load_cost_curve(path)
    np.testing.assert_allclose(loaded.grid_ms, grid_curve().grid_ms)
    assert loaded.draft_ms(1) == pytest.approx(1.0)


def test_loader_reads_a_tokens_only_curve_with_scale_and_aliases():
    """The Kimi slice form: one layer's cost over total tokens; `scale` = layers."""
    curve = load_cost_curve(
        {"num_tokens": [1, 8, 16], "latency_ms": [0.47, 2.0, 3.5], "scale": 60, "device": "H200"}
    )
    assert float(curve.verify_ms(1, 8)) == pytest.approx(120.0)
    assert float(curve.verify_ms(32, 12)) == pytest.approx(60 * 2.75)  # batch does not matter
    assert curve.draft_ms(8) == 0.0


def test_loader_grids_sparse_entries():
    entries = [
        {"batch_size": 1, "tokens": 2, "ms": 1.0},
        {"batch_size": 1, "tokens": 8, "ms": 4.0},
        {"batch_size": 2, "tokens": 4, "ms": 3.0},
    ]
    curve = load_cost_curve(entries)
    assert curve.batch_sizes.tolist() == [1.0, 2.0]
    assert curve.token_counts.tolist() == [2.0, 4.0, 8.0]
    assert float(curve.verify_ms(1, 4)) == pytest.approx(2.0)  # filled within its row
    assert float(curve.verify_ms(2, 8)) == pytest.approx(3.0)  # one point: flat row


def test_loader_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="keys"):
        load_cost_curve({"tokens": [1, 2]})
    with pytest.raises(ValueError, match="ascending"):
        load_cost_curve({"tokens": [2, 1], "ms": [1.0, 2.0]})
    for shapeless in (None, 42, [1, 2], {"entries": [3]}):
        with pytest.raises(ValueError, match="a cost curve is a JSON object"):
            load_cost_curve(shapeless)  # type: ignore[arg-type]


class LinearProbe:
    """A fake model: verify costs 1 ms + 0.1 ms per target token, drafting 0.5 ms per request."""

    def __init__(self) -> None:
        self.verify_shapes: list[tuple[int, int]] = []

    def verify_ms(self, batch_size: int, tree_nodes: int) -> float:
        self.verify_shapes.append((batch_size, tree_nodes))
        return 1.0 + 0.1 * batch_size * tree_nodes

    def draft_ms(self, batch_size: int) -> float:
        return 0.5 * batch_size


def test_measurement_covers_the_grid_and_reproduces_the_probe():
    probe = LinearProbe()
    curve = measure_cost_curve(probe, [1, 2, 4], [1, 8, 33], repeats=2)
    assert sorted(set(probe.verify_shapes)) == [(b, n) for b in (1, 2, 4) for n in (1, 8, 33)]
    assert len(probe.verify_shapes) == 9 * 3  # one warm-up and two timed runs per shape
    for batch_size in (1, 2, 4):
        for nodes in (1, 8, 33):
            assert float(curve.verify_ms(batch_size, batch_size * nodes)) == pytest.approx(
                1.0 + 0.1 * batch_size * nodes
            )
        assert curve.draft_ms(batch_size) == pytest.approx(0.5 * batch_size)


class NoisyProbe(LinearProbe):
    """Every run of one shape is slowed by other work on the machine."""

    def verify_ms(self, batch_size: int, tree_nodes: int) -> float:
        slowdown = 50.0 if (batch_size, tree_nodes) == (2, 8) else 0.0
        return super().verify_ms(batch_size, tree_nodes) + slowdown


def test_a_slow_outlier_never_makes_a_larger_tree_look_cheaper():
    curve = measure_cost_curve(NoisyProbe(), [1, 2], [1, 8, 33], repeats=2)
    for row in curve.grid_ms:
        assert np.all(np.diff(row) >= 0)


def test_default_buckets_end_at_the_limit():
    assert powers_of_two_upto(33) == [1, 2, 4, 8, 16, 32, 33]
    assert powers_of_two_upto(8) == [1, 2, 4, 8]
    assert powers_of_two_upto(1) == [1]


def test_a_graphed_targets_calibration_points_are_its_buckets():
    assert buckets_upto((1, 2, 4, 8, 9, 16, 17, 32, 33, 48, 64, 65), 33) == [1, 2, 4, 8, 9, 16, 17, 32, 33]
    assert buckets_upto((1, 2, 4, 8, 16, 24, 32), 20) == [1, 2, 4, 8, 16, 20]


def test_loader_reads_the_kimi_slice_benchmark_file_as_a_whole_forward():
    """The measured K2.6 slice (per-request tree tokens, ms per layer, scale = layers) loads as
    target tokens = batch x tree tokens and ms = layers x ms per layer."""
    path = Path(__file__).parents[2] / "bench" / "costs" / "kimi_k26_slice_h200.json"
    slice_file = json.loads(path.read_text())
    curve = load_cost_curve(path)
    for entry in slice_file["entries"]:
        batch, tree_tokens = entry["batch"], entry["tree_tokens"]
        predicted = float(curve.verify_ms(batch, batch * tree_tokens))
        assert predicted == pytest.approx(slice_file["scale"] * entry["ms_per_layer"], rel=1e-9)
