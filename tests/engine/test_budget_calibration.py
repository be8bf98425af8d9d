"""The acceptance calibrator: honest without data, converges on synthetic data, stays monotone."""

import numpy as np
import pytest

from ddtree_serve.engine.budget import AcceptanceCalibrator


def test_without_data_the_drafter_forecast_is_kept():
    calibrator = AcceptanceCalibrator()
    probs = np.array([0.9, 0.6, 0.3, 0.1, 0.01])
    np.testing.assert_allclose(calibrator.calibrate(probs), probs, rtol=0.1)


@pytest.mark.parametrize("honesty", [0.5, 1.0])
def test_converges_to_the_true_acceptance_rate(honesty: float):
    """Nodes accepted with probability honesty * p: the calibrated value approaches that."""
    rng = np.random.default_rng(0)
    calibrator = AcceptanceCalibrator(decay=1.0)
    for _ in range(400):
        probs = rng.uniform(0.01, 1.0, size=64)
        calibrator.observe(probs, rng.uniform(size=64) < honesty * probs)
    probe = np.array([0.95, 0.7, 0.4, 0.2, 0.05])
    np.testing.assert_allclose(calibrator.calibrate(probe), honesty * probe, atol=0.04)


def test_an_overconfident_drafter_is_corrected_and_order_kept():
    """A drafter whose high-probability nodes are rejected: the map stays non-decreasing."""
    rng = np.random.default_rng(1)
    calibrator = AcceptanceCalibrator(decay=1.0)
    for _ in range(200):
        probs = rng.uniform(0.0, 1.0, size=64)
        true_rate = np.where(probs > 0.5, 0.2, 0.3)  # inverted: isotonic fit pools the two regions
        calibrator.observe(probs, rng.uniform(size=64) < true_rate)
    grid = np.linspace(0.0, 1.0, 101)
    calibrated = calibrator.calibrate(grid)
    assert np.all(np.diff(calibrated) >= -1e-12)
    assert calibrator.calibrate(np.array([0.9]))[0] == pytest.approx(0.25, abs=0.05)
    assert calibrator.expected_accepted(np.array([0.9, 0.9])) == pytest.approx(0.5, abs=0.1)


def test_decay_follows_a_drifting_drafter():
    rng = np.random.default_rng(2)
    calibrator = AcceptanceCalibrator(decay=0.9)
    for accept_rate in (0.9, 0.1):
        for _ in range(100):
            probs = np.full(32, 0.8)
            calibrator.observe(probs, rng.uniform(size=32) < accept_rate)
    assert calibrator.calibrate(np.array([0.8]))[0] == pytest.approx(0.1, abs=0.05)


def test_observe_checks_its_shapes():
    with pytest.raises(ValueError, match="outcomes"):
        AcceptanceCalibrator().observe(np.ones(3), np.ones(2, dtype=bool))


def test_a_drafter_off_by_a_factor_everywhere_is_corrected_where_it_has_no_data_yet():
    """The drafter forecasts half what it accepts. After a few steps whose nodes all fall near
    p = 0.1, a bin it has not filled yet (p = 0.02) reads about twice the drafter's forecast:
    the bins' prior follows the drafter's measured honesty, not only its word."""
    rng = np.random.default_rng(3)
    calibrator = AcceptanceCalibrator(decay=1.0)
    for _ in range(4):
        probs = rng.uniform(0.09, 0.11, size=64)
        calibrator.observe(probs, rng.uniform(size=64) < 2.0 * probs)
    assert calibrator.calibrate(np.array([0.02]))[0] == pytest.approx(0.04, rel=0.3)
    assert calibrator.calibrate(np.array([0.1]))[0] == pytest.approx(0.2, rel=0.3)


def test_a_rare_bin_is_not_read_as_never_accepted_until_enough_nodes_missed():
    """Forty nodes at p = 0.01 without a hit are what a 1% rate gives two times in three: the
    bin keeps most of its prior; two thousand without one do say it is near zero."""
    few = AcceptanceCalibrator(decay=1.0)
    few.observe(np.full(40, 0.01), np.zeros(40, dtype=bool))
    many = AcceptanceCalibrator(decay=1.0)
    many.observe(np.full(2000, 0.01), np.zeros(2000, dtype=bool))
    assert few.calibrate(np.array([0.01]))[0] > 0.003
    assert many.calibrate(np.array([0.01]))[0] < 0.001
