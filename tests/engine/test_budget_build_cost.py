"""The host build's cost model: fitted from timings, never negative, refreshed live."""

import numpy as np
import pytest

from ddtree_serve.engine.budget import BuildCost, measure_build_cost


class LinearBuildProbe:
    """Times a build as 0.2 ms + 0.01 ms per request + 0.003 ms per node, with a slow first run."""

    def __init__(self) -> None:
        self.calls = 0

    def build_ms(self, batch_size: int, ceiling: int) -> float:
        self.calls += 1
        warm_up = 5.0 if self.calls % 4 == 1 else 0.0  # each shape's first run is the warm-up
        return 0.2 + 0.01 * batch_size + 0.003 * batch_size * ceiling + warm_up


def test_the_fit_recovers_a_linear_build_and_ignores_warm_up_runs():
    probe = LinearBuildProbe()
    cost = measure_build_cost(probe, [1, 4, 16], [1, 8, 64], repeats=3)
    assert probe.calls == 3 * 3 * 4
    assert (cost.per_step_ms, cost.per_request_ms, cost.per_node_ms) == pytest.approx((0.2, 0.01, 0.003))
    assert float(cost.ms(16, 16 * 64)) == pytest.approx(0.2 + 0.16 + 0.003 * 16 * 64)


def test_a_coefficient_the_data_makes_negative_is_dropped_not_kept():
    # Per-request time that falls with the batch would fit a negative coefficient.
    points = [(1, 8, 1.0), (2, 16, 1.0), (4, 32, 1.0), (8, 64, 1.0)]
    cost = BuildCost.fit(points)
    assert min(cost.per_step_ms, cost.per_request_ms, cost.per_node_ms) >= 0.0
    assert float(cost.ms(4, 32)) == pytest.approx(1.0, rel=0.05)


def test_live_timings_scale_the_prediction_toward_what_was_measured():
    cost = BuildCost(0.1, 0.0, 0.01, ema_weight=0.5)
    before = float(cost.ms(4, 16))
    for _ in range(20):
        cost.observe(4, 16, 3.0 * before)
    assert float(cost.ms(4, 16)) == pytest.approx(3.0 * before, rel=1e-3)
    expected = 3.0 * (0.1 + 0.01 * np.array([8, 16]))
    np.testing.assert_allclose(cost.ms(4, np.array([8, 16])), expected, rtol=1e-3)  # every size


def test_one_stalled_build_cannot_price_drafting_out():
    """A build that stalled (a GC pause, a preempted core) moves the scale by at most 2x."""
    cost = BuildCost(0.0, 0.0, 0.001, ema_weight=1.0)
    cost.observe(4, 64, measured_ms=1000.0)  # predicted 0.064 ms
    assert cost.scale == pytest.approx(2.0)
    with pytest.raises(ValueError, match="ema_weight"):
        BuildCost(0.0, 0.0, 0.0, ema_weight=1.5)


def test_negative_coefficients_are_refused():
    with pytest.raises(ValueError, match=">= 0"):
        BuildCost(0.0, -1.0, 0.0)
