"""CUDA graphs over static buffers: capture a forward once per bucket, then replay it.

A forward of tiny models on a GPU is bound by its hundreds of kernel launches, not by the
work: replaying a captured graph launches them all at once. A graph fixes every shape and
address, so each caller pads its inputs to a *bucket* (batch size, tree tokens, cache rows),
writes them into the bucket's static input tensors and reads the static outputs after the
replay. Graphs are captured lazily, the first time a bucket is met, and share one memory pool.

`StaticForward` is the machinery; `target_graphs` and `drafter_graphs` say what is padded and
how the padding stays isolated. With `capture=False` the same padded forward runs eagerly:
the reference a replay is compared with, and what a CPU runs for tests.
"""

import bisect
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

Inputs = TypeVar("Inputs")
Outputs = tuple[torch.Tensor, ...]

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Padded batch sizes; a batch larger than the last runs eagerly."""

TOKEN_BUCKETS = (1, 2, 4, 8, 9, 16, 17, 32, 33, 48, 64, 65, 96, 128, 129, 192, 256, 257, 512, 513)
"""Padded tree tokens per request: powers of two and one more (a budget-b tree has b + 1 nodes
with its root; a block-16 chain has 16), so common trees pad to their own size."""


def pick_bucket(size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `size`, or None when none does (`buckets` ascending)."""
    index = bisect.bisect_left(buckets, size)
    return buckets[index] if index < len(buckets) else None


def verify_bucket(
    batch_size: int, num_nodes: int, max_start: int, max_rows: int
) -> tuple[int, int, int] | None:
    """The verify graph a call runs: (padded batch, padded tree tokens, cache rows), or None
    when it runs eagerly. `max_start`: the batch's longest cached context."""
    padded_batch = pick_bucket(batch_size, BATCH_BUCKETS)
    padded_nodes = pick_bucket(num_nodes, TOKEN_BUCKETS)
    if padded_batch is None or padded_nodes is None:
        return None
    num_rows = row_bucket(max_start + padded_nodes, max_rows)
    return None if num_rows is None else (padded_batch, padded_nodes, num_rows)


def row_bucket(rows: int, max_rows: int, min_rows: int = 256) -> int | None:
    """Cache rows an attention reads, padded to a power of two (at least `min_rows`).

    Capped at `max_rows` (the cache's `max_seq_len`); None when `rows` exceeds it. A fixed
    width per bucket is what lets the mask and the K/V read live inside a graph; powers of two
    keep the graphs few while no call reads more than twice the rows it needs.
    """
    if rows > max_rows:
        return None
    width = max(min_rows, 1 << max(rows - 1, 0).bit_length())
    return min(width, max_rows)


@dataclass
class _Captured(Generic[Inputs]):
    inputs: Inputs
    outputs: Outputs
    graph: torch.cuda.CUDAGraph | None  # None: eager (capture off)


class StaticForward(Generic[Inputs]):
    """One forward, run per bucket over that bucket's static inputs, replayed from a graph.

    `new_inputs(key)` allocates a bucket's static input tensors; `forward(inputs)` computes
    the outputs from them with device work only (no host reads, no allocation from host
    data), which is what capture requires. `run(key, fill)` writes a call's data into the
    bucket's inputs with `fill` and returns the bucket's outputs.

    Outputs are valid until the next `run` of any forward sharing the pool: a graph captured
    later may place its outputs where an earlier graph keeps its intermediates. Work that
    reads them is queued on the same stream before the next replay, so stream order keeps it
    correct.
    """

    def __init__(
        self,
        new_inputs: Callable[[Hashable], Inputs],
        forward: Callable[[Inputs], Outputs],
        *,
        capture: bool,
        pool: tuple[int, int] | None = None,
    ) -> None:
        self._new_inputs = new_inputs
        self._forward = forward
        self.capture = capture
        self._pool = pool
        self._buckets: dict[Hashable, _Captured[Inputs]] = {}

    @property
    def num_buckets(self) -> int:
        """Buckets met so far (each with its static inputs, and its graph when capturing)."""
        return len(self._buckets)

    @property
    def num_graphs(self) -> int:
        return sum(entry.graph is not None for entry in self._buckets.values())

    def run(self, key: Hashable, fill: Callable[[Inputs], None]) -> Outputs:
        entry = self._buckets.get(key)
        if entry is None:
            inputs = self._new_inputs(key)
            fill(inputs)
            entry = self._capture(inputs) if self.capture else _Captured(inputs, (), None)
            self._buckets[key] = entry
        else:
            fill(entry.inputs)
        if entry.graph is None:
            return self._forward(entry.inputs)
        entry.graph.replay()
        return entry.outputs

    def _capture(self, inputs: Inputs) -> _Captured[Inputs]:
        """Warm up on a side stream (library handles, workspaces), then capture one forward.

        The warm-up runs the real call's forward: its cache writes are the ones the replay
        that follows writes again, so running it twice changes nothing.
        """
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self._forward(inputs)
        return _Captured(inputs, outputs, graph)


def new_graph_pool(device: torch.device, capture: bool) -> tuple[int, int] | None:
    """One memory pool for a runner's graphs (they never run at the same time)."""
    if not capture:
        return None
    with torch.cuda.device(device):
        return torch.cuda.graph_pool_handle()
