"""The step overhead: learned from whole steps, per kind, and it moves the gate's choice."""

import numpy as np
import pytest
import torch

from ddtree_serve.engine.budget import AdaptiveBudget, BuildCost, CostCurve, DraftGate
from ddtree_serve.engine.budget.step_overhead import StepOverhead
from ddtree_serve.tree import TreeBatch, build_ddtree, draft_topk

CONFIDENT = np.array([0.95, 0.9, 0.86, 0.8, 0.75, 0.7, 0.6, 0.5])
FREE_BUILD = BuildCost(0.0, 0.0, 0.0)


def flat_cost(verify_ms: float, draft_ms: float) -> CostCurve:
    """Every verify costs `verify_ms` whatever its size; every drafter call `draft_ms`."""
    tokens = np.array([1.0, 4096.0])
    return CostCurve([1, 64], tokens, [[verify_ms, verify_ms]] * 2, draft_ms=[draft_ms, draft_ms])


def gate_with_curve() -> DraftGate:
    gate = DraftGate()
    gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
    return gate


def test_each_kind_learns_its_own_figure_and_an_outlier_moves_it_a_little():
    overhead = StepOverhead(ema_weight=0.5)
    for _ in range(20):
        overhead.observe(drafted=True, unpriced_ms=3.0)
        overhead.observe(drafted=False, unpriced_ms=1.0)
    assert overhead.drafted_ms == pytest.approx(3.0, rel=1e-3)
    assert overhead.plain_ms == pytest.approx(1.0, rel=1e-3)
    overhead.observe(drafted=False, unpriced_ms=500.0)  # one captured CUDA graph
    assert overhead.plain_ms < 5.0 and overhead.drafted_ms == pytest.approx(3.0, rel=1e-3)
    overhead.observe(drafted=False, unpriced_ms=-2.0)  # timer noise: never below 0
    assert overhead.plain_ms >= 0.0


def test_a_drafted_steps_host_work_can_make_plain_decoding_the_better_choice():
    """The forwards say draft (several likely tokens for 1 ms more); 20 ms of host work per
    drafted step against none per plain step says decode plainly."""
    cost = flat_cost(verify_ms=2.0, draft_ms=1.0)
    assert gate_with_curve().ceiling([8], cost, FREE_BUILD, "padded", StepOverhead()) > 0
    heavy = StepOverhead(plain_ms=0.0, drafted_ms=20.0)
    assert gate_with_curve().ceiling([8], cost, FREE_BUILD, "padded", heavy) == 0


def test_the_policy_learns_the_overhead_from_the_engines_step_times():
    """Every drafted step takes 4 ms more than its priced parts, every plain step 0.5 ms more."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    tree = TreeBatch.from_trees([build_ddtree(*draft_topk(logits, 4), 8, root_token=7)])
    policy = AdaptiveBudget(flat_cost(verify_ms=20.0, draft_ms=1.0))
    kinds = []
    for _ in range(40):
        kinds.append(policy.plan([8]) > 0)
        if not kinds[-1]:
            policy.record_verify_ms(20.0)
            policy.observe(tree.prefix([0]), [[]])
            policy.record_step_ms(20.0 + 0.5)
            continue
        policy.record_draft_ms(1.0)
        allocation = policy.choose(tree, [8])
        policy.record_build_ms(0.2)
        policy.record_verify_ms(20.0)
        policy.observe(tree.prefix(allocation.num_nodes), [[1]])  # the first child
        policy.record_step_ms(1.0 + 0.2 + 20.0 + 4.0)
    assert sum(kinds) > 30  # drafting pays here: the overhead is learned from drafted steps
    assert policy.overhead.drafted_ms == pytest.approx(4.0, rel=0.05)


def test_a_draft_that_catches_up_on_context_teaches_no_cost():
    """A newcomer's first draft takes its whole prompt's context: its time, and its step's, say
    nothing of what a step at that ceiling costs."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    tree = TreeBatch.from_trees([build_ddtree(*draft_topk(logits, 4), 8, root_token=7)])
    policy = AdaptiveBudget(flat_cost(verify_ms=2.0, draft_ms=1.0))
    policy.gate.record_curve(CONFIDENT[None, :], np.array([len(CONFIDENT)]))
    for _ in range(3):
        assert policy.plan([8]) > 0
        policy.record_draft_ms(50.0, catching_up=True)
        allocation = policy.choose(tree, [8])
        policy.record_verify_ms(2.0)
        policy.observe(tree.prefix(allocation.num_nodes), [[1]])
        policy.record_step_ms(80.0)
        policy.learn()
    assert policy.cost.draft_ms(1) == pytest.approx(1.0)
    assert policy.overhead.drafted_ms == 0.0
    assert policy.gate.residual.ratio(1, policy.ceiling) == 1.0
