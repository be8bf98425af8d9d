"""The target's verify forward, eager or replayed from CUDA graphs per (batch, tokens, rows) bucket.

`tree_verify_forward` is the one verify forward: the eager path (`TargetRunner.verify`) calls it
with the batch as it is, `TargetGraphs` with the batch padded to a bucket. Plain decoding is the
N = 1 bucket (a root-only tree), so it needs no graph of its own.

A prompt is a chain tree (node j at depth j sees nodes 0..j), so a prefill whose padded size fits
`PREFILL_GRAPH_MAX_TOKENS` replays the same graphs (`TargetGraphs.prefill`): its node j is written
to cache row `start + j`, exactly where the eager prefill writes it, so committing it is only
advancing the slot's length.

Padding keeps every real row's result what it would be alone:
  - padded nodes of a real row get token 0 at depth 0 and see only their own cache row
    (`start + j`, past the row's real nodes): no real node's mask column points at them;
  - padded batch rows use the cache's scratch slot at start 0, so their writes land in rows
    no request owns, and no real row reads that slot;
  - the attention reads a fixed number of cache rows (the row bucket); columns past a row's
    prefix and tree are masked out, as they are in the eager width `max(starts) + N`.
"""

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ddtree_serve.models.cuda_graphs import (
    StaticForward,
    new_graph_pool,
    verify_bucket,
)
from ddtree_serve.models.families import TargetModel
from ddtree_serve.models.kv_cache import CacheWriter, SlotIndex, SlotKVCache
from ddtree_serve.models.qwen3 import context_features

if TYPE_CHECKING:
    from ddtree_serve.tree import VerifyBatch


def tree_verify_forward(
    model: TargetModel,
    cache: SlotKVCache,
    target_layer_ids: tuple[int, ...],
    tokens: torch.Tensor,
    depths: torch.Tensor,
    starts: torch.Tensor,
    slots: SlotIndex,
    tree_mask: torch.Tensor,
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over every tree node -> (logits `[B, N, V]`, features `[B, N, F]`).

    `tokens`, `depths` `[B, N]` (-1 padding is read as 0), `starts [B]` the slots' cached
    lengths, `tree_mask [B, N, N]`. Node j of row b is written to cache row `starts[b] + j`
    and sits at position `starts[b] + depths[b, j]`; it attends to its slot's prefix rows
    `< starts[b]` and to the tree rows its mask allows. The mask has `num_rows` columns,
    at least `max(starts) + N`. Device work only: a CUDA graph can capture it.
    """
    batch_size, num_nodes = tokens.shape
    device = tokens.device
    node_rows = starts[:, None] + torch.arange(num_nodes, device=device)  # [B, N] scratch rows
    # columns: the slot's prefix rows < start, then its tree rows start + j per the tree mask
    mask = (torch.arange(num_rows, device=device) < starts[:, None])[:, None, :]
    mask = mask.expand(batch_size, num_nodes, num_rows).clone()  # [B, N, num_rows]
    mask.scatter_(2, node_rows[:, None, :].expand(batch_size, num_nodes, num_nodes), tree_mask)
    writer = CacheWriter(cache, slots, node_rows, num_rows)
    positions = starts[:, None] + depths.clamp(min=0)
    out = model(tokens.clamp(min=0), positions, mask, writer, target_layer_ids)
    return model.logits(out.hidden), context_features(out, target_layer_ids)


PREFILL_GRAPH_MAX_TOKENS = 64 * 65
"""The most padded tokens (batch x nodes) a prefill takes through a graph: the verify of 64
requests at budget 64, the widest the budget sweeps run (and above the 4096 prompt tokens one step
takes by default, `max_num_batched_tokens`). A graph materialises every node's logits (`[tokens, vocab]`), so
a larger prefill would grow the graphs' memory past what verification uses; it runs eagerly,
where its cost is the device's work rather than the launches (the bundled pair's eager prefill
took 6.6-8.3 ms at 1 to 64 prompts on the H200, 3-4 decode steps; from a graph, on an H100,
1.4-3.1 ms where its eager one took 8.1-11.9)."""


@dataclass
class VerifyInputs:
    """Static inputs of one (batch, tokens, rows) bucket."""

    tokens: torch.Tensor  # [Bb, Nb] int64
    depths: torch.Tensor  # [Bb, Nb] int64
    starts_and_slots: torch.Tensor  # [2, Bb] int64: cached length, cache slot per row
    tree_mask: torch.Tensor  # [Bb, Nb, Nb] bool
    num_rows: int


class TargetGraphs:
    """Verify forwards of one `TargetRunner`, padded to buckets and replayed from graphs.

    `capture=False` runs the padded forward eagerly (CPU tests, and the reference a replay
    is compared with bit for bit).
    """

    def __init__(
        self,
        model: TargetModel,
        cache: SlotKVCache,
        target_layer_ids: tuple[int, ...],
        *,
        scratch_slot: int,
        capture: bool,
    ) -> None:
        self.model = model
        self.cache = cache
        self.target_layer_ids = target_layer_ids
        self.scratch_slot = scratch_slot
        self.device = cache.device
        self.forward = StaticForward(
            self._new_inputs, self._forward, capture=capture, pool=new_graph_pool(self.device, capture)
        )

    def bucket(self, batch_size: int, num_nodes: int, max_start: int) -> tuple[int, int, int] | None:
        """(padded batch, padded tokens, cache rows) for a call, or None when it runs eagerly."""
        return verify_bucket(batch_size, num_nodes, max_start, self.cache.max_seq_len)

    @torch.inference_mode()
    def verify(
        self, slots: Sequence[int], batch: "VerifyBatch", starts: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`TargetRunner.verify` from the bucket's graph -> views `[B, N, ...]`, or None (no bucket).

        The views are valid until the next verify.
        """
        batch_size, num_nodes = batch.tokens.shape
        key = self.bucket(batch_size, num_nodes, max(starts))
        if key is None:
            return None

        def fill(inputs: VerifyInputs) -> None:
            self._fill(inputs, slots, batch, starts)

        logits, features = self.forward.run(key, fill)
        return logits[:batch_size, :num_nodes], features[:batch_size, :num_nodes]

    @torch.inference_mode()
    def prefill(
        self, slots: Sequence[int], tokens: torch.Tensor, counts: Sequence[int], starts: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`TargetRunner.prefill_batch`'s forward from a verify graph, the prompts as chain trees:
        `tokens [B, T]` (row b's first `counts[b]` real, written after `starts[b]` cached rows)
        -> views `[B, T, ...]` of every node's logits and features, valid until the next verify,
        or None (no bucket, or past `PREFILL_GRAPH_MAX_TOKENS`: run it eagerly). The caller
        commits the rows by advancing the slots' lengths."""
        batch_size, width = tokens.shape
        key = self.bucket(batch_size, width, max(starts))
        if key is None or key[0] * key[1] > PREFILL_GRAPH_MAX_TOKENS:
            return None

        def fill(inputs: VerifyInputs) -> None:
            self._fill_chains(inputs, slots, tokens, counts, starts)

        logits, features = self.forward.run(key, fill)
        return logits[:batch_size, :width], features[:batch_size, :width]

    def _new_inputs(self, key: Hashable) -> VerifyInputs:
        padded_batch, padded_nodes, num_rows = key  # type: ignore[misc]
        shape = (padded_batch, padded_nodes)
        return VerifyInputs(
            tokens=torch.zeros(shape, dtype=torch.int64, device=self.device),
            depths=torch.zeros(shape, dtype=torch.int64, device=self.device),
            starts_and_slots=torch.zeros(2, padded_batch, dtype=torch.int64, device=self.device),
            tree_mask=torch.zeros((*shape, padded_nodes), dtype=torch.bool, device=self.device),
            num_rows=num_rows,
        )

    def _fill(
        self, inputs: VerifyInputs, slots: Sequence[int], batch: "VerifyBatch", starts: Sequence[int]
    ) -> None:
        """Write one call into the bucket; padding as the module docstring says."""
        batch_size, num_nodes = batch.tokens.shape
        padded_batch = inputs.tokens.shape[0]
        padding = padded_batch - batch_size
        host = torch.tensor([[*starts, *[0] * padding], [*slots, *[self.scratch_slot] * padding]])
        inputs.starts_and_slots.copy_(host, non_blocking=True)
        inputs.tokens.zero_()
        inputs.tokens[:batch_size, :num_nodes] = batch.tokens
        inputs.depths.zero_()
        inputs.depths[:batch_size, :num_nodes] = batch.depths
        inputs.tree_mask.zero_()
        inputs.tree_mask.diagonal(dim1=1, dim2=2).fill_(True)  # padded nodes see themselves
        inputs.tree_mask[:batch_size, :num_nodes, :num_nodes] = batch.attn_mask

    def _fill_chains(
        self,
        inputs: VerifyInputs,
        slots: Sequence[int],
        tokens: torch.Tensor,
        counts: Sequence[int],
        starts: Sequence[int],
    ) -> None:
        """Write prompts into the bucket as chains: real node j at depth j sees real nodes <= j;
        padded nodes (and padded rows) as in `_fill`."""
        batch_size, width = tokens.shape
        padded_batch, padded_nodes = inputs.tokens.shape
        padding = padded_batch - batch_size
        host = torch.tensor(
            [[*starts, *[0] * padding], [*slots, *[self.scratch_slot] * padding], [*counts, *[0] * padding]]
        )
        device_host = host.to(self.device, non_blocking=True)
        inputs.starts_and_slots.copy_(device_host[:2])
        inputs.tokens.zero_()
        inputs.tokens[:batch_size, :width] = tokens
        node = torch.arange(padded_nodes, device=self.device)
        real = node[None, :] < device_host[2][:, None]  # [Bb, Nb]
        inputs.depths.copy_(torch.where(real, node[None, :], 0))
        causal = node[:, None] >= node[None, :]  # [Nb, Nb]: node i sees node j <= i
        chains = causal[None] & real[:, :, None] & real[:, None, :]
        inputs.tree_mask.copy_(chains | torch.eye(padded_nodes, dtype=torch.bool, device=self.device))

    def _forward(self, inputs: VerifyInputs) -> tuple[torch.Tensor, ...]:
        starts, slots = inputs.starts_and_slots
        return tree_verify_forward(
            self.model,
            self.cache,
            self.target_layer_ids,
            inputs.tokens,
            inputs.depths,
            starts,
            SlotIndex.of_rows(slots),
            inputs.tree_mask,
            inputs.num_rows,
        )
