"""The drafter's two forwards, eager or replayed from CUDA graphs per bucket.

`append_context_forward` caches the K/V of new context tokens (bucket: total new tokens M),
`draft_block_forward` drafts one block per request against its cached context (bucket:
batch x context rows). `DFlashDrafter` calls them eagerly with the call as it is;
`DrafterGraphs` calls them on inputs padded to a bucket:
  - padded context tokens are written to the cache's scratch slot, which no request owns;
  - padded batch rows draft from the scratch slot with an empty context (they see only their
    own block), and real rows never read that slot;
  - the block attends to a fixed number of context rows (the row bucket), the rows past a
    slot's context masked out, as they are in the eager width `max(context_lens)`.
"""

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddtree_serve.models.cuda_graphs import (
    BATCH_BUCKETS,
    TOKEN_BUCKETS,
    StaticForward,
    new_graph_pool,
    pick_bucket,
    row_bucket,
)
from ddtree_serve.models.dflash import DFlashDraftModel
from ddtree_serve.models.kv_cache import SlotIndex, SlotKVCache

CONTEXT_BUCKETS = tuple(b for b in TOKEN_BUCKETS if b & (b - 1) == 0)
"""New context tokens per draft call, padded to a power of two (M = sum of accepted + 1)."""


def append_context_forward(
    model: DFlashDraftModel,
    cache: SlotKVCache,
    features: torch.Tensor,
    slot_rows: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Project context features `[M, F]` and write their K/V at `(slot_rows, positions)` `[M]`."""
    context_kv = model.context_key_values(features[None], positions[None])  # per layer [1, M, kv, d]
    for layer, (keys, values) in enumerate(context_kv):
        cache.write(layer, slot_rows, positions, keys[0], values[0])


def draft_block_forward(
    model: DFlashDraftModel,
    cache: SlotKVCache,
    embed_weight: torch.Tensor,
    head_weight: torch.Tensor,
    bonus_tokens: torch.Tensor,
    context_lens: torch.Tensor,
    slots: SlotIndex,
    num_context: int,
) -> torch.Tensor:
    """Draft the block `[bonus, MASK x L]` of every row -> logits `[B, L, V]`.

    `bonus_tokens`, `context_lens` `[B]` on the device; the block sits at positions
    `len_b .. len_b + L` and sees the first `len_b` of its slot's `num_context` cached rows
    and the whole block (non-causal). Device work only: a CUDA graph can capture it.
    """
    config = model.config
    batch_size, block_size = bonus_tokens.shape[0], config.block_size
    device = bonus_tokens.device
    block_ids = torch.full((batch_size, block_size), config.mask_token_id, dtype=torch.int64, device=device)
    block_ids[:, 0] = bonus_tokens
    noise_embeds = F.embedding(block_ids, embed_weight) * config.input_embedding_scale
    lens = context_lens[:, None]  # [B, 1]
    positions = lens + torch.arange(block_size, device=device)  # [B, block]
    # columns: context rows < len_b (num_context of them), then the block
    context_visible = torch.arange(num_context, device=device) < lens  # [B, C]
    block_visible = torch.ones(batch_size, block_size, dtype=torch.bool, device=device)
    mask = torch.cat([context_visible, block_visible], dim=1)[:, None, :].expand(-1, block_size, -1)
    context_kv = [cache.read(layer, slots, num_context) for layer in range(len(model.layers))]
    hidden = model.forward_with_context_kv(noise_embeds, positions, mask, context_kv)
    return F.linear(hidden[:, 1:], head_weight)


@dataclass
class ContextInputs:
    """Static inputs of one append bucket."""

    features: torch.Tensor  # [Mb, F] model dtype
    rows_and_positions: torch.Tensor  # [2, Mb] int64: cache slot, position per token


@dataclass
class BlockInputs:
    """Static inputs of one (batch, context rows) bucket."""

    bonus_lens_slots: torch.Tensor  # [3, Bb] int64: bonus token, context length, cache slot
    num_context: int


class DrafterGraphs:
    """Append and draft forwards of one `DFlashDrafter`, padded to buckets, replayed from graphs.

    `capture=False` runs the padded forwards eagerly (CPU tests, and the reference a replay
    is compared with bit for bit).
    """

    def __init__(
        self,
        model: DFlashDraftModel,
        cache: SlotKVCache,
        embed_weight: torch.Tensor,
        head_weight: torch.Tensor,
        *,
        scratch_slot: int,
        capture: bool,
    ) -> None:
        self.model = model
        self.cache = cache
        self.embed_weight = embed_weight
        self.head_weight = head_weight
        self.scratch_slot = scratch_slot
        self.device = cache.device
        self.dtype = embed_weight.dtype
        pool = new_graph_pool(self.device, capture)
        self.append = StaticForward(self._new_context_inputs, self._append, capture=capture, pool=pool)
        self.block = StaticForward(self._new_block_inputs, self._draft, capture=capture, pool=pool)

    @torch.inference_mode()
    def append_context(
        self, features: Sequence[torch.Tensor], slot_rows: torch.Tensor, positions: torch.Tensor
    ) -> bool:
        """`append_context_forward` for features `[n_b, F]` each and host `slot_rows/positions [M]`.

        Returns False (nothing done) when M has no bucket.
        """
        num_tokens = int(slot_rows.shape[0])
        padded = pick_bucket(num_tokens, CONTEXT_BUCKETS)
        if padded is None:
            return False

        def fill(inputs: ContextInputs) -> None:
            padding = padded - num_tokens
            pad_rows = torch.full((padding,), self.scratch_slot, dtype=torch.int64)
            pad_positions = torch.arange(padding, dtype=torch.int64) % self.cache.max_seq_len
            host = torch.stack([torch.cat([slot_rows, pad_rows]), torch.cat([positions, pad_positions])])
            inputs.rows_and_positions.copy_(host, non_blocking=True)
            inputs.features[:num_tokens] = torch.cat(list(features)).to(self.device)  # one copy

        self.append.run(padded, fill)
        return True

    @torch.inference_mode()
    def draft(
        self, slots: Sequence[int], bonus_tokens: torch.Tensor, context_lens: Sequence[int]
    ) -> torch.Tensor | None:
        """`draft_block_forward` from the bucket's graph -> a view `[B, L, V]`, or None (no bucket).

        The view is valid until the next draft.
        """
        batch_size = len(slots)
        padded_batch = pick_bucket(batch_size, BATCH_BUCKETS)
        num_context = row_bucket(max(context_lens), self.cache.max_seq_len)
        if padded_batch is None or num_context is None:
            return None

        def fill(inputs: BlockInputs) -> None:
            padding = padded_batch - batch_size
            host = torch.tensor(
                [
                    [*bonus_tokens.tolist(), *[0] * padding],
                    [*context_lens, *[0] * padding],
                    [*slots, *[self.scratch_slot] * padding],
                ]
            )
            inputs.bonus_lens_slots.copy_(host, non_blocking=True)

        (logits,) = self.block.run((padded_batch, num_context), fill)
        return logits[:batch_size]

    def _new_context_inputs(self, key: Hashable) -> ContextInputs:
        padded = int(key)  # type: ignore[call-overload]
        feature_dim = self.model.fc.in_features
        return ContextInputs(
            features=torch.zeros(padded, feature_dim, dtype=self.dtype, device=self.device),
            rows_and_positions=torch.zeros(2, padded, dtype=torch.int64, device=self.device),
        )

    def _append(self, inputs: ContextInputs) -> tuple[torch.Tensor, ...]:
        slot_rows, positions = inputs.rows_and_positions
        append_context_forward(self.model, self.cache, inputs.features, slot_rows, positions)
        return ()

    def _new_block_inputs(self, key: Hashable) -> BlockInputs:
        padded_batch, num_context = key  # type: ignore[misc]
        return BlockInputs(
            bonus_lens_slots=torch.zeros(3, padded_batch, dtype=torch.int64, device=self.device),
            num_context=num_context,
        )

    def _draft(self, inputs: BlockInputs) -> tuple[torch.Tensor, ...]:
        bonus, lens, slots = inputs.bonus_lens_slots
        logits = draft_block_forward(
            self.model,
            self.cache,
            self.embed_weight,
            self.head_weight,
            bonus,
            lens,
            SlotIndex.of_rows(slots),
            inputs.num_context,
        )
        return (logits,)
