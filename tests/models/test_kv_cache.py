"""SlotKVCache: compaction moves exactly the kept scratch rows; slot reads agree for any slot order."""

import torch

from ddtree_serve.models.kv_cache import CacheWriter, SlotIndex, SlotKVCache


def numbered_cache(num_slots: int = 3, max_seq_len: int = 12) -> SlotKVCache:
    """Every (layer, slot, row) entry holds a distinct number, values = -keys."""
    cache = SlotKVCache(
        num_layers=2, num_slots=num_slots, max_seq_len=max_seq_len, num_kv_heads=1, head_dim=2,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    cache.keys.copy_(torch.arange(cache.keys.numel(), dtype=torch.float32).view_as(cache.keys))
    cache.values.copy_(-cache.keys)
    return cache


def test_compact_moves_kept_rows_down_in_every_layer() -> None:
    cache = numbered_cache()
    assert cache.append([0, 1], [4, 2]) == [4, 2]
    before = cache.keys.clone()
    keep = torch.tensor([[0, 3, 5, -1], [0, 2, -1, -1]])  # slot 2 kept rows 0, 3, 5; slot 0 rows 0, 2
    assert cache.compact([2, 0], keep) == [3, 6]
    assert cache.slot_lengths([0, 1, 2]) == [6, 2, 3]
    assert torch.equal(cache.keys[:, 2, :3], before[:, 2, [0, 3, 5]])
    assert torch.equal(cache.keys[:, 0, :6], before[:, 0, [0, 1, 2, 3, 4, 6]])
    assert torch.equal(cache.keys[:, 1], before[:, 1])  # untouched slot
    assert torch.equal(cache.values, -cache.keys)


def test_compact_with_given_counts_moves_the_same_rows_and_keeps_rows_below_the_prefix() -> None:
    """The device path passes the counts it read back with the step's one copy."""
    counted, given = numbered_cache(), numbered_cache()
    keep = torch.tensor([[0, 1, 4, -1, -1], [0, -1, -1, -1, -1]])
    for cache in (counted, given):
        cache.append([1, 2], [3, 5])
    prefix = given.keys[:, :, :3].clone()
    assert counted.compact([1, 2], keep) == given.compact([1, 2], keep, num_kept=[3, 1]) == [6, 6]
    assert torch.equal(counted.keys, given.keys)
    assert torch.equal(given.keys[:, :, :3], prefix)  # moves only touch rows past each prefix


def test_writer_reads_the_same_rows_for_contiguous_and_gathered_slots() -> None:
    for slots in ([1, 2], [2, 1]):
        cache = numbered_cache()
        index = SlotIndex(slots, torch.device("cpu"))
        assert isinstance(index.index, slice) == (slots == [1, 2])
        positions = torch.tensor([[5, 6], [7, 8]])
        fresh = torch.full((2, 2, 1, 2), 0.5)
        keys, values = CacheWriter(cache, index, positions, num_rows=9).update(1, fresh, -fresh)
        assert keys.shape == (2, 9, 1, 2)
        for b, slot in enumerate(slots):
            assert torch.equal(keys[b], cache.keys[1, slot, :9])
            assert torch.equal(keys[b, positions[b]], fresh[b])
            assert torch.equal(values[b, positions[b]], -fresh[b])


def test_keys_only_cache_compacts_its_one_tensor_and_reads_no_values() -> None:
    """MLA's latent cache: `value_head_dim=0` allocates no values; writes, reads and moves keys alone."""
    cache = SlotKVCache(
        num_layers=2, num_slots=2, max_seq_len=8, num_kv_heads=1, head_dim=5, value_head_dim=0,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    assert cache.keys_only and cache.values is None
    positions = torch.arange(6)[None]  # [1, 6]: a prefix of 2 rows and a 4-node tree behind it
    fresh = torch.randn(1, 6, 1, 5, generator=torch.Generator().manual_seed(0))
    writer = CacheWriter(cache, SlotIndex([1], cache.device), positions, num_rows=6)
    keys, values = writer.update(0, fresh, None)
    assert values is None and torch.equal(keys, fresh)
    cache.append([1], [2])
    assert cache.compact([1], torch.tensor([[0, 3, -1]])) == [4]
    assert torch.equal(cache.keys[0, 1, :4], fresh[0, [0, 1, 2, 5]])
