"""Test doubles at the engine's seam: a target that records prompts and an oracle drafter.

A random-weight drafter almost never guesses right, so trees would be rejected at the root and
losslessness would be tested only trivially. `OracleDrafter` knows each prompt's reference
greedy continuation and proposes it through a noisy top-K (right token at rank 0, at rank 1,
or missing), so verification accepts deep paths, accepts siblings and rejects, every step.
"""

import numpy as np
import torch

from ddtree_serve.engine.interfaces import (
    ContextHandle,
    DraftInput,
    DraftOutput,
    EncodeInput,
    PrefillInput,
    PrefillOutput,
    Target,
    VerifyInput,
    VerifyOutput,
)


class RecordingTarget:
    """Delegates to a real `Target`, remembering which prompt each slot holds."""

    def __init__(self, inner: Target) -> None:
        self.inner = inner
        self.slot_prompts: dict[int, tuple[int, ...]] = {}
        self.verify_batch_sizes: list[int] = []
        self.verify_num_nodes: list[int] = []
        self.verify_max_depths: list[int] = []

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.inner.eos_token_ids

    @property
    def max_seq_len(self) -> int:
        return self.inner.max_seq_len

    @property
    def verify_token_buckets(self) -> tuple[int, ...] | None:
        return self.inner.verify_token_buckets

    def prefill(self, inputs: PrefillInput) -> PrefillOutput:
        for slot, prompt in zip(inputs.slots, inputs.prompts, strict=True):
            self.slot_prompts[slot] = tuple(prompt)
        return self.inner.prefill(inputs)

    def verify_and_commit(self, inputs: VerifyInput) -> VerifyOutput:
        self.verify_batch_sizes.append(len(inputs.slots))
        self.verify_num_nodes.append(int(inputs.batch.num_nodes.sum()))
        self.verify_max_depths.append(inputs.batch.max_depth)
        return self.inner.verify_and_commit(inputs)

    def encode_context(self, inputs: EncodeInput) -> ContextHandle:
        return self.inner.encode_context(inputs)

    def release(self, slot: int) -> None:
        self.slot_prompts.pop(slot, None)
        self.inner.release(slot)


class OracleDrafter:
    """Proposes each prompt's reference continuation with rank noise; `Drafter` protocol.

    `references[prompt] = prompt + continuation` (token ids). Per depth, the true next token
    sits at rank 0 with probability `p_rank0`, at rank 1 with `p_rank1`, else is left out.
    """

    def __init__(
        self,
        target: RecordingTarget,
        references: dict[tuple[int, ...], list[int]],
        vocab_size: int,
        block_size: int = 6,
        p_rank0: float = 0.6,
        p_rank1: float = 0.25,
        seed: int = 0,
    ) -> None:
        self.target = target
        self.references = references
        self.vocab_size = vocab_size
        self._block_size = block_size
        self.p_rank0 = p_rank0
        self.p_rank1 = p_rank1
        self.rng = np.random.default_rng(seed)
        self.context_lens: dict[int, int] = {}

    @property
    def block_size(self) -> int:
        return self._block_size

    def draft(self, inputs: DraftInput) -> DraftOutput:
        slots, contexts = inputs.slots, inputs.contexts
        num_levels, k = self._block_size - 1, min(inputs.top_k, self.vocab_size)
        logp = torch.log(torch.tensor([0.5 ** (r + 1) for r in range(k)])).expand(len(slots), num_levels, k)
        ids = torch.empty(len(slots), num_levels, k, dtype=torch.int64)
        for b, (slot, slices) in enumerate(zip(slots, contexts, strict=True)):
            new_tokens = sum(int(c.handle[c.index].shape[0]) for c in slices)
            self.context_lens[slot] = self.context_lens.get(slot, 0) + new_tokens
            reference = self.references.get(self.target.slot_prompts[slot], [])
            cached = self.context_lens[slot]  # the bonus token is reference[cached]
            for depth in range(num_levels):
                row = self.rng.permutation(self.vocab_size)[:k]
                position = cached + 1 + depth
                if position < len(reference):
                    true_token = reference[position]
                    row = row[row != true_token][:k]
                    if len(row) < k:
                        row = np.append(row, true_token)
                    draw = self.rng.random()
                    if draw < self.p_rank0:
                        row[0] = true_token
                    elif draw < self.p_rank0 + self.p_rank1 and k > 1:
                        row[1] = true_token
                ids[b, depth] = torch.from_numpy(row[:k])
        num_context_tokens = tuple(self.context_lens[slot] for slot in slots)
        return DraftOutput(logp=logp.contiguous(), ids=ids, num_context_tokens=num_context_tokens)

    def release(self, slot: int) -> None:
        self.context_lens.pop(slot, None)
