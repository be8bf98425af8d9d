"""`DFlashDrafter`: the DFlash draft model over a per-slot cache of context keys/values.

A slot's context is the target features of every token in the target's cache, in order
(context token j sits at position j). Each `draft` call first appends the features of the
tokens committed since the last call (their K/V per drafter layer, computed once), then runs
the block `[bonus, MASK x L]` at positions `len .. len + L` against the whole context. The
block's own K/V are never stored: drafting twice from the same context gives the same logits.

On CUDA both forwards replay CUDA graphs per bucket (`drafter_graphs`); `enforce_eager` keeps
them eager.
"""

from collections.abc import Sequence
from pathlib import Path

import torch

from ddtree_serve.models.dflash import DFlashConfig, DFlashDraftModel
from ddtree_serve.models.drafter_graphs import DrafterGraphs, append_context_forward, draft_block_forward
from ddtree_serve.models.kv_cache import SlotIndex, SlotKVCache
from ddtree_serve.models.layers import avoid_per_shape_attention_plans
from ddtree_serve.models.loading import load_draft_model, load_embedding_and_head


class DFlashDrafter:
    """Block drafting for a fixed number of request slots, with the target's embedding and head."""

    def __init__(
        self,
        model: DFlashDraftModel,
        embed_weight: torch.Tensor,
        head_weight: torch.Tensor,
        *,
        num_slots: int,
        max_seq_len: int,
        enforce_eager: bool = False,
    ) -> None:
        """`embed_weight`, `head_weight`: the target's `[V, H]` token embedding and LM head.

        `enforce_eager`: no CUDA graphs (they are used on CUDA otherwise).
        """
        first = next(model.parameters())
        self.model = model
        self.config: DFlashConfig = model.config
        decoder = self.config.decoder
        if embed_weight.shape[1] != decoder.hidden_size:
            raise ValueError(
                f"drafter hidden size {decoder.hidden_size} differs from the target's {embed_weight.shape[1]}"
            )
        self.embed_weight = embed_weight
        self.head_weight = head_weight
        self.device = first.device
        self.dtype = first.dtype
        avoid_per_shape_attention_plans(self.device)
        use_graphs = self.device.type == "cuda" and not enforce_eager
        self.cache = SlotKVCache(
            num_layers=decoder.num_hidden_layers,
            num_slots=num_slots,
            max_seq_len=max_seq_len,
            num_kv_heads=decoder.num_key_value_heads,
            head_dim=decoder.head_dim,
            dtype=self.dtype,
            device=self.device,
            scratch_slots=1 if use_graphs else 0,
        )
        self.graphs = None
        if use_graphs:
            self.graphs = DrafterGraphs(
                model, self.cache, embed_weight, head_weight, scratch_slot=num_slots, capture=True
            )

    @classmethod
    def from_pretrained(
        cls,
        drafter_path: str | Path,
        target_path: str | Path,
        *,
        num_slots: int,
        max_seq_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        enforce_eager: bool = False,
    ) -> "DFlashDrafter":
        """Load the drafter's weights and borrow only the embedding and LM head of the target."""
        model = load_draft_model(drafter_path, dtype=dtype, device=device)
        embed, head = load_embedding_and_head(target_path, dtype=dtype, device=device)
        return cls(
            model, embed, head, num_slots=num_slots, max_seq_len=max_seq_len, enforce_eager=enforce_eager
        )

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    @property
    def feature_dim(self) -> int:
        return self.config.feature_dim

    @property
    def vocab_size(self) -> int:
        return self.head_weight.shape[0]

    def context_len(self, slot: int) -> int:
        """Context tokens cached for the slot (equals the target's `seq_len` between steps)."""
        return self.cache.length(slot)

    def release(self, slot: int) -> None:
        self.cache.release(slot)

    @torch.inference_mode()
    def append_context(self, slots: Sequence[int], new_context_features: Sequence[torch.Tensor]) -> None:
        """Project and cache each slot's new context features `[n_b, F]` (all slots in one pass)."""
        counts = [int(f.shape[0]) for f in new_context_features]
        if sum(counts) == 0:
            return
        self.cache.check_room(slots, counts)
        starts = self.cache.slot_lengths(slots)
        # [M] host each, built as Python lists: under cProfile on the H200 host the tensor-op
        # form (repeat_interleave, arange per slot, cat) took 0.35 ms a step at batch 16.
        pairs = list(zip(slots, starts, counts, strict=True))
        slot_rows = torch.tensor([slot for slot, _, n in pairs for _ in range(n)], dtype=torch.int64)
        new_positions = [i for _, start, n in pairs for i in range(start, start + n)]
        positions = torch.tensor(new_positions, dtype=torch.int64)
        if self.graphs is None or not self.graphs.append_context(new_context_features, slot_rows, positions):
            device = self.device
            # Joined where they lie, then one copy (host features: one host -> device copy).
            features = torch.cat(list(new_context_features)).to(device=device, dtype=self.dtype)
            slot_rows, positions = slot_rows.to(device), positions.to(device)
            append_context_forward(self.model, self.cache, features, slot_rows, positions)
        self.cache.append(slots, counts)

    @torch.inference_mode()
    def draft(
        self,
        slots: Sequence[int],
        bonus_tokens: torch.Tensor,
        new_context_features: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """Append the new context, then draft the block after each bonus -> logits `[B, L, V]`.

        `bonus_tokens [B]`; `new_context_features[b] [n_b, F]`: target features of the tokens
        committed to slot b since its last draft. Logits are in the model dtype, L = block_size - 1.
        From a CUDA graph the logits are a view of its static output, valid until the next draft.
        """
        self.append_context(slots, new_context_features)
        context_lens = self.cache.slot_lengths(slots)
        graphed = None if self.graphs is None else self.graphs.draft(slots, bonus_tokens, context_lens)
        if graphed is not None:
            return graphed
        device = self.device
        return draft_block_forward(
            self.model,
            self.cache,
            self.embed_weight,
            self.head_weight,
            bonus_tokens.to(device),
            torch.tensor(context_lens, dtype=torch.int64, device=device),
            SlotIndex(slots, device),
            max(context_lens),
        )
