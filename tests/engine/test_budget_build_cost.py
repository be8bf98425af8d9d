"""The host build's cost model: fitted from timings, never negative, refreshed live."""

import numpy as np
import pytest

from ddtree_serve.engine.budget import BuildCost, measure_build_cost
from ddtree_serve.tree import lockstep_pays


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
    assert cost.lockstep_per_pop_ms is None  # no batch above the break-even was timed
    assert float(cost.ms(16, 16 * 64, 64)) == pytest.approx(0.2 + 0.16 + 0.003 * 16 * 64)
    assert float(cost.ms(64, 64 * 64, 64)) == pytest.approx(0.2 + 0.64 + 0.003 * 64 * 64)  # as heaps


class TwoBuildersProbe:
    """Heaps below the break-even batch (0.003 ms a node), lockstep above (0.05 ms a pop of the
    largest budget, 0.0005 ms a node): the engine's two builders."""

    def build_ms(self, batch_size: int, ceiling: int) -> float:
        nodes = batch_size * ceiling
        if lockstep_pays(nodes, ceiling):
            return 0.2 + 0.01 * batch_size + 0.05 * ceiling + 0.0005 * nodes
        return 0.2 + 0.01 * batch_size + 0.003 * nodes


def test_each_batch_is_priced_by_the_builder_that_will_build_it():
    cost = measure_build_cost(TwoBuildersProbe(), [1, 4, 16, 32, 64], [1, 8, 32, 64], repeats=1)
    assert (cost.per_step_ms, cost.per_request_ms, cost.per_node_ms) == pytest.approx((0.2, 0.01, 0.003))
    assert (cost.lockstep_per_pop_ms, cost.lockstep_per_node_ms) == pytest.approx((0.05, 0.0005))
    probe = TwoBuildersProbe()
    for batch_size, ceiling in ((8, 32), (24, 16), (48, 64)):
        nodes = batch_size * ceiling
        assert float(cost.ms(batch_size, nodes, ceiling)) == pytest.approx(
            probe.build_ms(batch_size, ceiling)
        )
    # Vectors of candidate ceilings at one batch: each entry by its own builder.
    ceilings = np.array([1, 8, 64])
    np.testing.assert_allclose(
        cost.ms(64, 64 * ceilings, ceilings), [probe.build_ms(64, int(c)) for c in ceilings]
    )
    assert BuildCost.from_json(cost.to_json()) == cost


def test_a_coefficient_the_data_makes_negative_is_dropped_not_kept():
    # Per-request time that falls with the batch would fit a negative coefficient.
    points = [(1, 8, 8, 1.0), (2, 16, 8, 1.0), (4, 32, 8, 1.0), (8, 64, 8, 1.0)]
    cost = BuildCost.fit(points)
    assert min(cost.per_step_ms, cost.per_request_ms, cost.per_node_ms) >= 0.0
    assert float(cost.ms(4, 32, 8)) == pytest.approx(1.0, rel=0.05)


def test_live_timings_scale_the_prediction_toward_what_was_measured():
    cost = BuildCost(0.1, 0.0, 0.01, ema_weight=0.5)
    before = float(cost.ms(4, 16, 4))
    for _ in range(20):
        cost.observe(4, 16, 4, 3.0 * before)
    assert float(cost.ms(4, 16, 4)) == pytest.approx(3.0 * before, rel=1e-3)
    expected = 3.0 * (0.1 + 0.01 * np.array([8, 16]))
    np.testing.assert_allclose(cost.ms(4, np.array([8, 16]), np.array([2, 4])), expected, rtol=1e-3)


def test_one_stalled_build_cannot_price_drafting_out():
    """A build that stalled (a GC pause, a preempted core) moves the scale by at most 2x."""
    cost = BuildCost(0.0, 0.0, 0.001, ema_weight=1.0)
    cost.observe(4, 64, 16, measured_ms=1000.0)  # predicted 0.064 ms
    assert cost.scale == pytest.approx(2.0)
    with pytest.raises(ValueError, match="ema_weight"):
        BuildCost(0.0, 0.0, 0.0, ema_weight=1.5)


def test_negative_coefficients_are_refused():
    with pytest.raises(ValueError, match=">= 0"):
        BuildCost(0.0, -1.0, 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        BuildCost(0.0, 0.0, 0.0, lockstep_per_pop_ms=-0.1)


class OneLockstepBatchProbe(TwoBuildersProbe):
    """Lockstep time all per pop; the grid times one lockstep batch size only (max_num_seqs 24)."""

    def build_ms(self, batch_size: int, ceiling: int) -> float:
        if lockstep_pays(batch_size * ceiling, ceiling):
            return 0.2 + 0.01 * batch_size + 0.05 * ceiling
        return super().build_ms(batch_size, ceiling)


def test_one_lockstep_batch_size_prices_its_pops_not_an_arbitrary_split():
    """With a single lockstep batch its nodes are a multiple of its pops: the fit must not split
    the time between them (a split would misprice every other lockstep batch)."""
    cost = measure_build_cost(OneLockstepBatchProbe(), [1, 4, 16, 24], [1, 8, 32, 64], repeats=1)
    assert cost.lockstep_per_node_ms == 0.0
    for batch_size in (21, 48, 64):
        assert float(cost.ms(batch_size, batch_size * 32, 32)) == pytest.approx(
            0.2 + 0.01 * batch_size + 0.05 * 32
        )
