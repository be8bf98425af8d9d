"""`TargetRunner`: the target model over a slot KV cache, with tree verification and commit.

Cache convention (docs/architecture.md): after `prefill` a slot holds its prompt; the newest
token (the bonus) is not cached. `verify` places a tree's root at `start = seq_len(slot)`,
node i at position `start + depth[i]`, and writes every node's K/V into scratch rows
`start + i`; `commit` keeps the root and the accepted nodes, moved down to rows
`start .. start + accept_len`. Between `verify` and `commit` the committed lengths do not
change, so a verify that is never committed leaves the slot as it was. The cache is the only
writer of lengths; `commit` returns the new ones.

On CUDA, verify replays CUDA graphs per bucket (`target_graphs`); `enforce_eager` keeps every
forward eager. Prefill is always eager (one per request, of any length).

An MLA target (DeepseekV3 / Kimi K2) caches its compressed latent by default (`mla_cache`); the
model's attention follows the cache it is handed (`deepseek_v3.MLAKVStore`), so the same model
can run over either cache.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ddtree_serve.models.families import MLACache, TargetConfig, TargetModel, cache_layout
from ddtree_serve.models.kv_cache import CacheWriter, SlotIndex, SlotKVCache
from ddtree_serve.models.layers import avoid_per_shape_attention_plans, causal_mask
from ddtree_serve.models.loading import load_target_model, read_eos_token_ids
from ddtree_serve.models.parallel import TensorParallel, local_kv_layout
from ddtree_serve.models.qwen3 import Qwen3ForCausalLM, context_features
from ddtree_serve.models.target_graphs import TargetGraphs, tree_verify_forward

if TYPE_CHECKING:
    from ddtree_serve.tree import VerifyBatch


class TargetRunner:
    """Prefill, verify and commit for a fixed number of request slots, for any target family."""

    def __init__(
        self,
        model: TargetModel,
        *,
        num_slots: int,
        max_seq_len: int,
        target_layer_ids: Sequence[int] | None = None,
        eos_token_ids: Sequence[int] = (),
        enforce_eager: bool = False,
        tensor_parallel: TensorParallel | None = None,
        mla_cache: MLACache = "latent",
    ) -> None:
        """`target_layer_ids`: decoder layers whose outputs form the context features (None: F = 0).

        `enforce_eager`: no CUDA graphs. Graphs are used on CUDA for the dense families only;
        the MoE reference routes tokens on the host, which a graph cannot capture.
        `tensor_parallel`: the group `model` is this rank's shard of (None: the whole model); the
        cache then holds this rank's heads (or the whole MLA latent), and verify runs eagerly
        (collectives are not captured).
        `mla_cache`: what an MLA target caches, "latent" or "decompressed" (ignored by other families).
        """
        first = next(model.parameters())
        self.model = model
        self.config: TargetConfig = model.config
        self.device = first.device
        self.dtype = first.dtype
        self.target_layer_ids = tuple(target_layer_ids or ())
        num_layers = self.config.num_hidden_layers
        if outside := [i for i in self.target_layer_ids if not 0 <= i < num_layers]:
            # A drafter made for another target: found here, not as a KeyError at the first step.
            raise ValueError(
                f"the drafter conditions on target layers {list(self.target_layer_ids)}, but the target "
                f"has {num_layers} layers (0-{num_layers - 1}): layers {outside} do not exist"
            )
        self.eos_token_ids = tuple(eos_token_ids) or self.config.eos_token_ids
        avoid_per_shape_attention_plans(self.device)
        tp = tensor_parallel or TensorParallel.single()
        self.kv_layout = local_kv_layout(cache_layout(self.config, mla_cache), tp)  # this rank's entry
        use_graphs = (
            self.device.type == "cuda"
            and not enforce_eager
            and isinstance(model, Qwen3ForCausalLM)
            and tp.world_size == 1
        )
        self.cache = SlotKVCache(
            num_layers=self.config.num_hidden_layers,
            num_slots=num_slots,
            max_seq_len=max_seq_len,
            num_kv_heads=self.kv_layout.num_heads,
            head_dim=self.kv_layout.key_dim,
            value_head_dim=self.kv_layout.value_dim,
            dtype=self.dtype,
            device=self.device,
            scratch_slots=1 if use_graphs else 0,
        )
        self.graphs = None
        if use_graphs:
            self.graphs = TargetGraphs(
                model, self.cache, self.target_layer_ids, scratch_slot=num_slots, capture=True
            )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        num_slots: int,
        max_seq_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        target_layer_ids: Sequence[int] | None = None,
        enforce_eager: bool = False,
        tensor_parallel: TensorParallel | None = None,
        mla_cache: MLACache = "latent",
    ) -> "TargetRunner":
        """`tensor_parallel`: load only this rank's shard of the checkpoint (None: the whole model)."""
        model = load_target_model(path, dtype=dtype, device=device, tensor_parallel=tensor_parallel)
        return cls(
            model,
            num_slots=num_slots,
            max_seq_len=max_seq_len,
            target_layer_ids=target_layer_ids,
            eos_token_ids=read_eos_token_ids(path),
            enforce_eager=enforce_eager,
            tensor_parallel=tensor_parallel,
            mla_cache=mla_cache,
        )

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def feature_dim(self) -> int:
        return len(self.target_layer_ids) * self.config.hidden_size

    @property
    def num_slots(self) -> int:
        return self.cache.num_slots

    @property
    def max_seq_len(self) -> int:
        return self.cache.max_seq_len

    def seq_len(self, slot: int) -> int:
        """Committed tokens in the slot's cache."""
        return self.cache.length(slot)

    def release(self, slot: int) -> None:
        self.cache.release(slot)

    def prefill(
        self, slot: int, token_ids: Sequence[int] | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `token_ids` to the slot's cache -> (last-position logits `[V]`, features `[T, F]`).

        On an empty slot this caches a prompt; on a non-empty one it extends the cached text
        (chunked prefill, or a plain decode step with one token).
        """
        logits, features = self.prefill_batch([slot], [token_ids])
        return logits[0], features[0]

    @torch.inference_mode()
    def prefill_batch(
        self, slots: Sequence[int], token_ids: Sequence[Sequence[int] | torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`prefill` for several slots in one forward -> (logits `[B, V]`, features `[T_b, F]` each).

        Rows are right-padded to the longest; padding writes only scratch rows past each
        slot's new length and is masked out of every real query. On a graphed target a batch
        that fits a verify bucket replays its graph, the prompts read as chain trees
        (`TargetGraphs.prefill`): an eager prefill is launch-bound on a small model.
        """
        rows = [torch.as_tensor(ids, dtype=torch.int64) for ids in token_ids]
        counts = [int(r.shape[0]) for r in rows]
        if min(counts) < 1:
            raise ValueError("prefill needs at least one token per slot")
        width = max(counts)
        self.cache.check_room(slots, width)
        device = self.device
        tokens = torch.zeros(len(rows), width, dtype=torch.int64)
        for b, row in enumerate(rows):
            tokens[b, : counts[b]] = row
        start_list = self.cache.slot_lengths(slots)
        last = torch.tensor(counts, device=device) - 1  # [B]
        graphed = None if self.graphs is None else self.graphs.prefill(slots, tokens, counts, start_list)
        if graphed is None:
            logits, features = self._eager_prefill(slots, tokens.to(device), start_list, last)
        else:
            all_logits, all_features = graphed  # [B, T, V], [B, T, F]: views of the graph's outputs
            logits = all_logits[torch.arange(len(rows), device=device), last]
            features = all_features.clone()  # the next verify overwrites the graph's outputs
        self.cache.append(slots, counts)
        return logits, [features[b, : counts[b]] for b in range(len(rows))]

    def _eager_prefill(
        self, slots: Sequence[int], tokens: torch.Tensor, start_list: Sequence[int], last: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill_batch`'s forward without a graph: `tokens [B, T]` on the device, `last [B]`
        each row's last real index -> (its logits `[B, V]`, features `[B, T, F]`)."""
        device, width = self.device, tokens.shape[1]
        starts = torch.tensor(start_list, dtype=torch.int64, device=device)[:, None]  # [B, 1]
        positions = starts + torch.arange(width, device=device)  # [B, T]
        num_rows = max(start_list) + width
        # query t of row b sees cache rows [0, start_b + t]
        mask = torch.arange(num_rows, device=device)[None, None, :] <= positions[..., None]  # [B, T, rows]
        writer = CacheWriter(self.cache, SlotIndex(slots, device), positions, num_rows)
        out = self.model(tokens, positions, mask, writer, self.target_layer_ids)
        batch_index = torch.arange(tokens.shape[0], device=device)
        return self.model.logits(out.hidden[batch_index, last]), context_features(out, self.target_layer_ids)

    @torch.inference_mode()
    def context_features(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Context features of `token_ids` read as one text from position 0 -> `[T, F]`.

        Features only: no cache is read or written (a new drafter's context is rebuilt from the
        token ids alone). Eager, one causal forward over the whole text.
        """
        tokens = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device)[None]  # [1, T]
        num_tokens = int(tokens.shape[1])
        positions = torch.arange(num_tokens, device=self.device)[None]  # [1, T]
        out = self.model(tokens, positions, causal_mask(num_tokens, self.device), None, self.target_layer_ids)
        return context_features(out, self.target_layer_ids)[0]

    @torch.inference_mode()
    def verify(self, slots: Sequence[int], batch: "VerifyBatch") -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over every tree node -> (logits `[B, N, V]`, features `[B, N, F]`).

        Node i of row b attends to its slot's cached prefix and to the nodes that
        `batch.attn_mask[b, i]` allows (itself and its ancestors), at position
        `start_b + depths[b, i]` where `start_b` is the slot's cached length. From a CUDA graph the
        results are views of its static outputs, valid until the next verify.
        """
        start_list = self.cache.slot_lengths(slots)
        num_nodes = batch.tokens.shape[1]
        self.cache.check_room(slots, num_nodes)
        if self.graphs is not None and (graphed := self.graphs.verify(slots, batch, start_list)) is not None:
            return graphed
        device = self.device
        return tree_verify_forward(
            self.model,
            self.cache,
            self.target_layer_ids,
            batch.tokens.to(device),
            batch.depths.to(device),
            torch.tensor(start_list, dtype=torch.int64, device=device),
            SlotIndex(slots, device),
            batch.attn_mask.to(device),
            max(start_list) + num_nodes,
        )

    @torch.inference_mode()
    def commit(
        self, slots: Sequence[int], accept_index: torch.Tensor, num_kept: Sequence[int] | None = None
    ) -> list[int]:
        """Keep the root and the accepted nodes of the last `verify` (`accept_index [B, D+1]`,
        local node indices, root first, -1 padded, on the host or the device); the slots grow
        by 1 + accept_len. `num_kept[b]` = 1 + accept_len[b] when the caller knows it on the
        host (then device indices cost no sync).

        Returns the slots' new cached lengths."""
        return self.cache.compact(slots, accept_index, num_kept)
