"""Adaptive tree budgets: calibrated acceptance, a measured cost curve, and the per-step choice."""

from ddtree_serve.engine.budget.allocator import Allocation, TokenLayout, allocate, plain_decode_rate
from ddtree_serve.engine.budget.build_cost import BuildCost
from ddtree_serve.engine.budget.calibration import AcceptanceCalibrator
from ddtree_serve.engine.budget.cost_curve import CostCurve, load_cost_curve
from ddtree_serve.engine.budget.draft_gate import DraftGate
from ddtree_serve.engine.budget.measure import (
    BuildProbe,
    CostProbe,
    ModelCostProbe,
    buckets_upto,
    measure_build_cost,
    measure_cost_curve,
    powers_of_two_upto,
)
from ddtree_serve.engine.budget.policy import AdaptiveBudget, BudgetStep

__all__ = [
    "AcceptanceCalibrator",
    "AdaptiveBudget",
    "Allocation",
    "BudgetStep",
    "BuildCost",
    "BuildProbe",
    "CostCurve",
    "CostProbe",
    "DraftGate",
    "ModelCostProbe",
    "TokenLayout",
    "allocate",
    "buckets_upto",
    "load_cost_curve",
    "measure_build_cost",
    "measure_cost_curve",
    "plain_decode_rate",
    "powers_of_two_upto",
]
