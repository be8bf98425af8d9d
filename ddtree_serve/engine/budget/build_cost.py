"""What the host build stage costs: the price of a tree ceiling before any model runs.

A drafted step builds every request's tree on the host at the step's ceiling (the heap builder,
then the padded verify buffers) before the allocator cuts it. That time is paid whatever the
allocator then verifies, and it grows with the nodes built: on the H200 the bundled pair's
verify forward of 64 requests takes ~2.5 ms while building their 64-node trees took ~15 ms
(bench/results/budget_sweep_h200.md), so a policy that prices only the forwards builds big
trees that lose. The policy prices a ceiling by

    build_ms(B, nodes) = per_step_ms + per_request_ms * B + per_node_ms * nodes

(`nodes`: draft nodes built over the batch, B * c when every request may take the ceiling c)
fitted at start-up by timing the engine's own build on a real draft (`measure.py`), then
scaled live by each built step's measured/predicted ratio (an EMA, like the cost curve; one
ratio moves the scale at most by a factor of 2, so a stalled step cannot price drafting out).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class BuildCost:
    """Host milliseconds of one build stage, linear in requests and nodes built."""

    per_step_ms: float
    per_request_ms: float
    per_node_ms: float
    ema_weight: float = 0.1
    scale: float = 1.0  # live correction: measured / fitted, smoothed

    def __post_init__(self) -> None:
        if min(self.per_step_ms, self.per_request_ms, self.per_node_ms) < 0:
            raise ValueError("build cost coefficients must be >= 0 ms")
        if not 0.0 <= self.ema_weight <= 1.0:
            raise ValueError("build cost ema_weight must be in [0, 1]")

    def ms(self, batch_size: int, nodes: np.ndarray | float) -> np.ndarray:
        """Predicted milliseconds to build `batch_size` trees of `nodes` draft nodes in all."""
        nodes = np.asarray(nodes, dtype=np.float64)
        fitted = self.per_step_ms + self.per_request_ms * batch_size + self.per_node_ms * nodes
        return self.scale * fitted

    def observe(self, batch_size: int, nodes: int, measured_ms: float) -> None:
        """Move the live scale toward this step's measured/predicted ratio (bounded per step)."""
        predicted = float(self.ms(batch_size, nodes))
        if predicted > 0:
            ratio = min(max(measured_ms / predicted, 0.5), 2.0) * self.scale
            self.scale += self.ema_weight * (ratio - self.scale)

    @classmethod
    def fit(cls, points: Sequence[tuple[int, int, float]]) -> "BuildCost":
        """Least squares over (batch size, nodes built, ms) points; a negative coefficient is
        dropped and the rest refitted (a cost never falls as the work grows)."""
        if not points:
            raise ValueError("need at least one timed build to fit a build cost")
        batch = np.array([p[0] for p in points], dtype=np.float64)
        nodes = np.array([p[1] for p in points], dtype=np.float64)
        ms = np.array([p[2] for p in points], dtype=np.float64)
        features = np.stack([np.ones_like(batch), batch, nodes], axis=1)
        kept = [0, 1, 2]
        while True:
            solution, *_ = np.linalg.lstsq(features[:, kept], ms, rcond=None)
            if np.all(solution >= 0) or len(kept) == 1:
                break
            kept.pop(int(np.argmin(solution)))
        coefficients = np.zeros(3)
        coefficients[kept] = np.maximum(solution, 0.0)
        return cls(*(float(c) for c in coefficients))

    def to_json(self) -> dict[str, Any]:
        return {
            "per_step_ms": self.per_step_ms,
            "per_request_ms": self.per_request_ms,
            "per_node_ms": self.per_node_ms,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BuildCost":
        return cls(float(data["per_step_ms"]), float(data["per_request_ms"]), float(data["per_node_ms"]))
