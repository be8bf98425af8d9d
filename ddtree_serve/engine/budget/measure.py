"""The start-up cost calibration: time verify and draft calls over a grid of shapes.

`measure_cost_curve` takes a `CostProbe`, something that can run one verify forward of a given
batch and tree width and one drafter call of a given batch and say how long each took; the
engine's probe (`ModelCostProbe`) runs them through its `Target` and `Drafter` on scratch
slots. Each shape is run once to warm up, then `repeats` times; the median is kept.
"""

from collections.abc import Sequence
from statistics import median
from typing import Protocol

from ddtree_serve.engine.budget.cost_curve import CostCurve, load_cost_curve


class CostProbe(Protocol):
    def verify_ms(self, batch_size: int, tree_nodes: int) -> float:
        """Milliseconds of one verify of `batch_size` trees of `tree_nodes` nodes (root included)."""
        ...

    def draft_ms(self, batch_size: int) -> float:
        """Milliseconds of one drafter call for `batch_size` requests."""
        ...


def measure_cost_curve(
    probe: CostProbe, batch_sizes: Sequence[int], tree_nodes: Sequence[int], repeats: int = 3
) -> CostCurve:
    """A grid over `batch_sizes` x target tokens (`batch * tree_nodes`, the padded verify width)."""
    entries = []
    draft_ms: dict[int, float] = {}
    for batch_size in batch_sizes:
        for nodes in tree_nodes:
            probe.verify_ms(batch_size, nodes)
            ms = median(probe.verify_ms(batch_size, nodes) for _ in range(repeats))
            entries.append({"batch": batch_size, "tokens": batch_size * nodes, "ms": ms})
        probe.draft_ms(batch_size)
        draft_ms[batch_size] = median(probe.draft_ms(batch_size) for _ in range(repeats))
    return load_cost_curve({"entries": entries, "draft_ms": draft_ms})


def powers_of_two_upto(limit: int) -> list[int]:
    """1, 2, 4, ... below `limit`, then `limit` itself: the default calibration buckets."""
    values = [1 << i for i in range(limit.bit_length()) if 1 << i < limit]
    return [*values, limit]
