"""A preallocated key/value cache with a fixed number of request slots.

Layout: `keys` `[layers, slots, max_seq_len, kv_heads, head_dim]` and `values` the same with
`value_head_dim` last (equal to `head_dim` except for MLA's decompressed K/V), or no `values` at
all for a keys-only cache (MLA's latent: one entry per token that attention reads as both key and
value); slot s holds `length(s)` committed entries at rows `[0, length(s))`. Rows past the length are scratch:
a tree verification writes its nodes there, and `compact` moves the accepted ones down.
Optional scratch slots after the request slots (`scratch_slots`) hold no request: a CUDA graph
padded to a larger batch sends its padding rows' writes there.
Lengths live on the host (a Python list) so bookkeeping never waits on the device; this class
is their only writer (`append`, `compact`, `release`), and each write returns the new lengths.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Per-layer, per-token cache entry of a model family: `num_heads` keys and values per token.

    `value_dim = 0`: keys only, no values tensor (MLA's latent). `replicated`: the entry is shared
    by all attention heads (MLA's latent, computed before the heads split), so every
    tensor-parallel rank caches it whole instead of its share of the heads.
    """

    num_heads: int
    key_dim: int
    value_dim: int
    replicated: bool = False

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token's entry takes in one layer's cache."""
        return self.num_heads * (self.key_dim + self.value_dim) * dtype.itemsize


class SlotKVCache:
    """Owner of the K/V tensors and the committed length of every slot."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        value_head_dim: int | None = None,
        scratch_slots: int = 0,
    ) -> None:
        """`value_head_dim`: size of a value head when it differs from a key head (None: `head_dim`;
        0: keys only, `values` is None).

        `scratch_slots`: extra slots past the last request slot (indices `num_slots ..`), never
        handed to a request; their rows take writes that nothing reads back.
        """
        shape = (num_layers, num_slots + scratch_slots, max_seq_len, num_kv_heads)
        self.keys = torch.zeros((*shape, head_dim), dtype=dtype, device=device)
        value_dim = head_dim if value_head_dim is None else value_head_dim
        self.values = torch.zeros((*shape, value_dim), dtype=dtype, device=device) if value_dim else None
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self._lengths = [0] * num_slots

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def keys_only(self) -> bool:
        """One tensor per entry, no values (MLA's latent cache)."""
        return self.values is None

    def release(self, slot: int) -> None:
        self._lengths[slot] = 0

    def length(self, slot: int) -> int:
        """Committed entries of the slot."""
        return self._lengths[slot]

    def slot_lengths(self, slots: Sequence[int]) -> list[int]:
        return [self._lengths[s] for s in slots]

    def append(self, slots: Sequence[int], counts: Sequence[int]) -> list[int]:
        """Commit the `counts[b]` rows just written after each slot's length -> the new lengths."""
        for slot, count in zip(slots, counts, strict=True):
            self._lengths[slot] += count
        return self.slot_lengths(slots)

    def check_room(self, slots: Sequence[int], extra: Sequence[int] | int) -> None:
        """Raise if writing `extra` rows past any slot's length would overflow `max_seq_len`."""
        extras = [extra] * len(slots) if isinstance(extra, int) else list(extra)
        for slot, more in zip(slots, extras, strict=True):
            if self._lengths[slot] + more > self.max_seq_len:
                raise ValueError(
                    f"slot {slot}: {self._lengths[slot]} cached + {more} new rows exceed "
                    f"max_seq_len {self.max_seq_len}"
                )

    def write(
        self,
        layer: int,
        slot_rows: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor | None,
    ) -> None:
        """Store `keys/values [..., kv_heads, head_dim or value_head_dim]` at `(slot_rows, positions)`.

        `values` is None exactly when the cache is keys-only.
        """
        self.keys[layer].index_put_((slot_rows, positions), keys)
        if self.values is not None:
            self.values[layer].index_put_((slot_rows, positions), values)

    def read(self, layer: int, slots: "SlotIndex", num_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows `[0, num_rows)` of each slot: `[B, num_rows, kv_heads, head_dim]` (views when contiguous).

        Values are None in a keys-only cache.
        """
        index = slots.index
        values = None if self.values is None else self.values[layer, index, :num_rows]
        return self.keys[layer, index, :num_rows], values

    def compact(
        self, slots: Sequence[int], keep_offsets: torch.Tensor, num_kept: Sequence[int] | None = None
    ) -> list[int]:
        """Keep, per slot, the scratch rows `length + keep_offsets[b, j]` (-1 = none).

        `keep_offsets [B, D+1]` int64 on the host or the cache's device, its kept entries first
        and ascending; `num_kept[b]` is row b's count of kept entries (None: counted here,
        which reads device offsets back to the host). Kept rows move to `length + j`,
        contiguous after the committed prefix, for every layer at once (one gather and one
        scatter over the whole [B, D+1] grid, so device offsets cost no sync: a dropped entry
        j >= num_kept copies row `length + j` onto itself, past the new length). Lengths grow
        by the number kept. Returns the new lengths.
        """
        if num_kept is None:
            num_kept = (keep_offsets >= 0).sum(dim=1).tolist()
        offsets = keep_offsets.to(self.device, non_blocking=True)  # [B, D+1]
        width = offsets.shape[1]
        host = torch.tensor([self.slot_lengths(slots), list(slots)], dtype=torch.int64)
        starts, rows = host.to(self.device, non_blocking=True)[:, :, None]  # [B, 1] each
        columns = torch.arange(width, device=self.device)
        dst = starts + columns  # [B, D+1]
        src = torch.where(offsets >= 0, starts + offsets, dst)
        rows = rows.expand(-1, width)
        for tensor in (self.keys, self.values):
            if tensor is not None:
                tensor[:, rows, dst] = tensor[:, rows, src]  # the gather is a copy: [layers, B, D+1, ...]
        return self.append(slots, num_kept)


class SlotIndex:
    """A batch's slots as an index into the cache's slot dimension.

    Consecutive ascending slots become a slice, so reads are views rather than gathers.
    """

    def __init__(self, slots: Sequence[int], device: torch.device) -> None:
        slot_list = list(slots)
        first = slot_list[0]
        if slot_list == list(range(first, first + len(slot_list))):
            self.index: slice | torch.Tensor = slice(first, first + len(slot_list))
        else:
            self.index = torch.tensor(slot_list, dtype=torch.int64, device=device)
        self.rows = torch.tensor(slot_list, dtype=torch.int64, device=device)  # [B]

    @classmethod
    def of_rows(cls, rows: torch.Tensor) -> "SlotIndex":
        """Slots given as a device tensor `[B]` (a CUDA graph's static input): always a gather.

        Nothing here reads the tensor on the host, so a graph can capture what uses it and
        replay it with other slots written into `rows`.
        """
        index = cls.__new__(cls)
        index.index = rows
        index.rows = rows
        return index


class CacheWriter:
    """`KVStore` for one forward: writes fresh K/V at given rows, returns each slot's first `num_rows`.

    Over a keys-only cache the layers hand it keys alone (`values` None) and get None back.

    `positions [B, T]`: cache rows of the T new tokens per slot; the attention mask's
    columns are then cache rows `[0, num_rows)`.
    """

    def __init__(self, cache: SlotKVCache, slots: SlotIndex, positions: torch.Tensor, num_rows: int) -> None:
        self.cache = cache
        self.slots = slots
        self.slot_rows = slots.rows[:, None].expand_as(positions)  # [B, T]
        self.positions = positions
        self.num_rows = num_rows

    @property
    def keys_only(self) -> bool:
        return self.cache.keys_only

    def update(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.cache.write(layer_idx, self.slot_rows, self.positions, keys, values)
        return self.cache.read(layer_idx, self.slots, self.num_rows)
