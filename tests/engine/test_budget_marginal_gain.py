"""The marginal gain: what a ceiling's nodes past the next narrower one make, against the forecast."""

import numpy as np
import pytest

from ddtree_serve.engine.budget import DraftGate
from ddtree_serve.engine.budget.marginal_gain import PRIOR_TOKENS, WINDOW_STEPS, MarginalGain
from ddtree_serve.engine.budget.step_residual import MAX_RATIO
from tests.engine.test_budget_allocator import linear_curve
from tests.engine.test_budget_step_residual import CONFIDENT, FREE_BUILD


def test_a_gain_is_a_ratio_of_sums_over_its_window():
    """At batch 1 a doubling is forecast a quarter of a token a step and makes zero or one: the
    ratio is the window's made over its forecast (behind the prior), where a mean of per-step
    ratios would be undefined at the zeros or, skipping them, 4.0."""
    gain = MarginalGain()
    assert gain.ratio(1, 64) == 1.0  # nothing known
    for step in range(8):
        made = 1 if step % 3 == 0 else 0  # three of eight steps gain a token
        gain.observe(1, made={32: 3, 64: 3 + made}, forecast={32: 2.5, 64: 2.75})
    assert gain.ratio(1, 64) == pytest.approx((PRIOR_TOKENS + 3.0) / (PRIOR_TOKENS + 2.0))
    assert gain.ratio(2, 64) == 1.0  # another batch bucket
    assert gain.ratio(1, 32) == 1.0  # 32 over 16 was not measured
    for _ in range(4 * WINDOW_STEPS):  # steps gaining far more than forecast: capped
        gain.observe(1, made={32: 3.0, 64: 5.0}, forecast={32: 2.5, 64: 2.75})
    assert gain.ratio(1, 64) == MAX_RATIO
    for _ in range(WINDOW_STEPS):  # a window of steps gaining twice the forecast replaces them
        gain.observe(1, made={32: 3.0, 64: 3.5}, forecast={32: 2.5, 64: 2.75})
    expected = (PRIOR_TOKENS + 0.5 * WINDOW_STEPS) / (PRIOR_TOKENS + 0.25 * WINDOW_STEPS)
    assert gain.ratio(1, 64) == pytest.approx(expected)


def test_each_ceiling_learns_its_gain_over_the_next_narrower_one():
    gain = MarginalGain()
    for _ in range(WINDOW_STEPS):
        gain.observe(4, made={4: 6.0, 8: 9.0, 16: 9.0}, forecast={4: 6.0, 8: 8.0, 16: 10.0, 32: 11.0})
    assert gain.ratio(4, 8) > 1.3  # made 3 where 2 were forecast
    assert gain.ratio(4, 16) == 1.0  # made none of the 2 forecast: read as the forecast
    assert gain.ratio(4, 32) == 1.0  # no step ran at 32


def test_a_wider_ceilings_further_nodes_are_priced_by_what_they_made():
    """Ceiling 16's steps made twice the forecast of their nodes past 8 (their first 8 nodes as
    forecast); the gate has taken 8 since. A 16-node step costs 1.44x an 8-node one: at the
    forecast, 16's further nodes do not pay for that and the gate keeps 8; at what they made,
    it takes 16."""
    gate = DraftGate(probe_interval=1024)
    gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
    free_width = linear_curve(fixed_ms=4.0, per_token_ms=0.0, draft_ms=1.0)
    for _ in range(2 * WINDOW_STEPS):  # steps at 16, and its probes of 8 (which teach no tokens)
        ceiling = gate.ceiling([16, 16], free_width, FREE_BUILD, "padded")
        forecast = {**gate._narrower_forecasts, ceiling: gate._decided[3]}
        made = {c: round(tokens) for c, tokens in forecast.items()}
        if ceiling == 16:
            made[16] = made[8] + round(2 * (forecast[16] - forecast[8]))
        gate.record_step_ms(5.0, tokens=made.pop(ceiling), tokens_within=made)
    assert gate.marginal.ratio(2, 16) > 1.8
    assert gate.marginal.ratio(2, 8) == pytest.approx(1.0, abs=0.15)
    gate._tokens_ceiling[2] = 8  # the steps since took 8
    gate._streak, gate.steps_since_probe = None, 0  # a decision, no probe due
    dear_width = linear_curve(fixed_ms=1.0, per_token_ms=0.11, draft_ms=1.0)
    assert gate.ceiling([16, 16], dear_width, FREE_BUILD, "padded") == 16
    gate.marginal = MarginalGain()  # as before: the further nodes at their forecast
    gate._streak, gate.steps_since_probe = None, 0
    assert gate.ceiling([16, 16], dear_width, FREE_BUILD, "padded") == 8
