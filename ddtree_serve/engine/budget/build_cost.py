"""What the host build stage costs: the price of a tree ceiling before any model runs.

A drafted step builds every request's tree on the host at the step's ceiling (a heap per
request or all of them in lockstep, then the padded verify buffers) before the allocator cuts
it. That time is paid whatever the allocator then verifies, and it grows with the nodes built:
on the H200 the bundled pair's verify forward of 64 requests takes ~2.5 ms while building
their 64-node trees with one heap each took ~15 ms (bench/results/budget_sweep_h200.md), so a
policy that prices only the forwards builds big trees that lose. The engine builds one heap
per request at small batches and all of them in lockstep at large ones (`lockstep_pays`),
whose time grows with the largest budget instead of with the nodes, so the policy prices a
ceiling by the builder it will run:

    build_ms(B, nodes, c) = per_step_ms + per_request_ms * B
                            + per_node_ms * nodes                                 (heaps)
                            + lockstep_per_pop_ms * c + lockstep_per_node_ms * nodes  (lockstep)

(`nodes`: draft nodes built over the batch, B * c when every request may take the ceiling c;
`c`: the largest budget, one lockstep pop each) fitted at start-up by timing the engine's own
build on a real draft (`measure.py`), then scaled live by each built step's
measured/predicted ratio (an EMA, like the cost curve; one ratio moves the scale at most by a
factor of 2, so a stalled step cannot price drafting out).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddtree_serve.tree import lockstep_pays


@dataclass
class BuildCost:
    """Host milliseconds of one build stage, linear in requests and nodes built (heaps) or in
    the largest budget and nodes (lockstep)."""

    per_step_ms: float
    per_request_ms: float
    per_node_ms: float
    lockstep_per_pop_ms: float | None = None  # None: large batches are priced as heaps too
    lockstep_per_node_ms: float = 0.0
    ema_weight: float = 0.1
    scale: float = 1.0  # live correction: measured / fitted, smoothed

    def __post_init__(self) -> None:
        coefficients = (self.per_step_ms, self.per_request_ms, self.per_node_ms, self.lockstep_per_node_ms)
        if min(coefficients) < 0 or (self.lockstep_per_pop_ms or 0.0) < 0:
            raise ValueError("build cost coefficients must be >= 0 ms")
        if not 0.0 <= self.ema_weight <= 1.0:
            raise ValueError("build cost ema_weight must be in [0, 1]")

    def ms(self, batch_size: int, nodes: np.ndarray | float, largest: np.ndarray | float) -> np.ndarray:
        """Predicted milliseconds to build `batch_size` trees of `nodes` draft nodes in all, the
        largest allowed `largest` nodes (arrays: one prediction per entry)."""
        nodes = np.asarray(nodes, dtype=np.float64)
        heaps = self.per_node_ms * nodes
        if self.lockstep_per_pop_ms is not None:
            lockstep = self.lockstep_per_pop_ms * np.asarray(largest) + self.lockstep_per_node_ms * nodes
            heaps = np.where(lockstep_pays(nodes, largest), lockstep, heaps)
        return self.scale * (self.per_step_ms + self.per_request_ms * batch_size + heaps)

    def observe(self, batch_size: int, nodes: int, largest: int, measured_ms: float) -> None:
        """Move the live scale toward this step's measured/predicted ratio (bounded per step)."""
        predicted = float(self.ms(batch_size, nodes, largest))
        if predicted > 0:
            ratio = min(max(measured_ms / predicted, 0.5), 2.0) * self.scale
            self.scale += self.ema_weight * (ratio - self.scale)

    @classmethod
    def fit(cls, points: Sequence[tuple[int, int, int, float]]) -> "BuildCost":
        """Least squares over (batch size, nodes built, largest budget, ms) points, each priced
        by the builder the engine runs for it; a negative coefficient is dropped and the rest
        refitted (a cost never falls as the work grows)."""
        if not points:
            raise ValueError("need at least one timed build to fit a build cost")
        batch, nodes, largest, ms = (
            np.array(column, dtype=np.float64) for column in zip(*points, strict=True)
        )
        lockstep = lockstep_pays(nodes, largest)
        heap = ~lockstep
        # Columns: per step, per request, per node (heaps), per pop and per node (lockstep).
        features = np.stack(
            [np.ones_like(batch), batch, nodes * heap, largest * lockstep, nodes * lockstep], 1
        )
        kept = [column for column in range(5) if features[:, column].any()]
        if len(np.unique(batch[lockstep])) < 2 and 4 in kept:
            # One lockstep batch size makes its nodes (B * c) a multiple of its pops (c): the
            # split would be arbitrary, so the pops carry it (the larger part, measured).
            kept.remove(4)
        while True:
            solution, *_ = np.linalg.lstsq(features[:, kept], ms, rcond=None)
            if np.all(solution >= 0) or len(kept) == 1:
                break
            kept.pop(int(np.argmin(solution)))
        coefficients = np.zeros(5)
        coefficients[kept] = np.maximum(solution, 0.0)
        per_step, per_request, per_node, per_pop, lockstep_per_node = (float(c) for c in coefficients)
        return cls(
            per_step,
            per_request,
            per_node,
            lockstep_per_pop_ms=per_pop if lockstep.any() else None,
            lockstep_per_node_ms=lockstep_per_node,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "per_step_ms": self.per_step_ms,
            "per_request_ms": self.per_request_ms,
            "per_node_ms": self.per_node_ms,
            "lockstep_per_pop_ms": self.lockstep_per_pop_ms,
            "lockstep_per_node_ms": self.lockstep_per_node_ms,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BuildCost":
        per_pop = data.get("lockstep_per_pop_ms")
        return cls(
            float(data["per_step_ms"]),
            float(data["per_request_ms"]),
            float(data["per_node_ms"]),
            lockstep_per_pop_ms=None if per_pop is None else float(per_pop),
            lockstep_per_node_ms=float(data.get("lockstep_per_node_ms", 0.0)),
        )
