"""`TargetStep`: the target's half of a decoding step, whichever transport calls it.

It owns a `TargetRunner` and does everything the target does in a step: prefill the newcomers
and sample their first token; run the verify forward over the trees, walk them (greedy with
the backend chosen at build time: "device" on CUDA, "host" on a CPU; or the lossless sampling
walk with its backend), gather the accepted nodes' features for the drafter and compact the
accepted KV entries. On CUDA the walk, the gather and the compaction take device indices, so
the step reads the device once: one small copy of the accepted path, its tokens and the bonus.
In process the engine calls it directly; over Ray a `TargetWorker` holds one and adds only
transport. Context handles it produces are lists of device tensors, one per request.
"""

from collections.abc import Callable

import torch

from ddtree_serve.engine.interfaces import (
    EncodeInput,
    PrefillInput,
    PrefillOutput,
    SamplingBatch,
    VerifyInput,
    VerifyOutput,
)
from ddtree_serve.engine.timing import Stage, StageTimer
from ddtree_serve.models import TargetRunner
from ddtree_serve.models.cuda_graphs import TOKEN_BUCKETS
from ddtree_serve.tree import VerifyBatch, build_chain, build_verify_batch
from ddtree_serve.verify import VerifyResult, get_greedy_backend, target_probs, verify_sampling


class TargetStep:
    """`Target` over a `TargetRunner` in this process."""

    def __init__(
        self,
        runner: TargetRunner,
        verify_backend: str,
        timer: StageTimer | None = None,
        greedy_backend: str | None = None,
    ) -> None:
        """`verify_backend`: a sampling verification backend that is available here (resolved).

        `greedy_backend` (None: "device" on CUDA, where it needs no sync; "host" on a CPU, where
        a few dozen Python steps beat the batched ops at these sizes).
        """
        self.runner = runner
        self.verify_backend = verify_backend
        self.device = runner.device
        if greedy_backend is None:
            greedy_backend = "device" if self.device.type == "cuda" else "host"
        self._greedy_walk = get_greedy_backend(greedy_backend)
        self.timer = timer or StageTimer()
        # Host work the engine runs while a CUDA verify computes (`AsyncDeviceTarget`); a CPU's
        # forward leaves no such time, so there it is not called.
        self.while_verifying: Callable[[], None] | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.runner.vocab_size)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.runner.eos_token_ids)

    @property
    def max_seq_len(self) -> int:
        return int(self.runner.max_seq_len)

    @property
    def verify_token_buckets(self) -> tuple[int, ...] | None:
        return None if self.runner.graphs is None else TOKEN_BUCKETS

    def prefill(self, inputs: PrefillInput) -> PrefillOutput:
        # One forward for all prompts; timed as the engine's "prefill" stage.
        slots, sampling = list(inputs.slots), inputs.sampling
        last_logits, features = self.runner.prefill_batch(slots, [list(p) for p in inputs.prompts])  # [B, V]
        if sampling.all_greedy:
            first_tokens = last_logits.argmax(dim=-1)
        else:
            # The first token is an "ar" step's bonus: a root-only tree verified with coin_final.
            assert inputs.coins is not None, "sampling needs coins"
            roots = build_verify_batch([build_chain([], 0) for _ in slots])
            no_coins = torch.zeros(roots.batch_size, 1)
            first_tokens = self._verify_sampling(
                roots, last_logits.unsqueeze(1), sampling, no_coins, inputs.coins
            ).bonus_token
        return PrefillOutput(
            first_tokens=first_tokens.cpu(),
            num_cached_tokens=tuple(self.runner.seq_len(slot) for slot in slots),
            context=features,
        )

    def verify_and_commit(self, inputs: VerifyInput) -> VerifyOutput:
        slots, sampling = list(inputs.slots), inputs.sampling
        batch = inputs.batch.to(self.device, non_blocking=True)  # no copy when built here
        with self.timer.stage(Stage.TARGET_FORWARD):
            logits, features = self.runner.verify(slots, batch)  # [B, N, V], [B, N, F]
        if sampling.all_greedy:
            accept_index, accept_len, bonus = self._greedy_walk(batch, logits.argmax(dim=-1))
        else:
            assert inputs.coins is not None and inputs.coin_final is not None, "sampling needs coins"
            result = self._verify_sampling(batch, logits, sampling, inputs.coins, inputs.coin_final)
            accept_index, accept_len, bonus = result.accept_index, result.accept_len, result.bonus_token
        # [B, D+1] and [B]; a host walk's results go back to the device of the tokens and KV
        accept_index, accept_len, bonus = (t.to(self.device) for t in (accept_index, accept_len, bonus))
        accept_tokens = batch.tokens.gather(1, accept_index.clamp(min=0))
        gathered = _gather_accepted(features, accept_index) if inputs.return_context else None
        packed = torch.cat([accept_index, accept_tokens, accept_len.view(-1, 1), bonus.view(-1, 1)], dim=1)
        if self.while_verifying is not None and self.device.type == "cuda":
            self.while_verifying()  # the kernels above are queued, not done: the host is free
        # The step's one device -> host copy: everything the engine's bookkeeping reads.
        packed = packed.cpu()  # [B, 2 (D+1) + 2]
        width = accept_index.shape[1]
        accept_len_cpu = packed[:, -2]
        num_kept = (accept_len_cpu + 1).tolist()
        # Queued after the copy, with device indices: the device compacts while the host appends.
        num_cached_tokens = self.runner.commit(slots, accept_index, num_kept)
        return VerifyOutput(
            accept_index=packed[:, :width],
            accept_tokens=packed[:, width : 2 * width],
            accept_len=accept_len_cpu,
            bonus_token=packed[:, -1],
            num_cached_tokens=tuple(num_cached_tokens),
            # per request: its root's and accepted nodes' features, [1 + accept_len_b, F] views
            context=None if gathered is None else [gathered[b, :n] for b, n in enumerate(num_kept)],
        )

    def encode_context(self, inputs: EncodeInput) -> list[torch.Tensor]:
        """One features-only forward per slot (bounded memory; this runs once per drafter loss)."""
        features = []
        for slot, token_ids in zip(inputs.slots, inputs.token_ids, strict=True):
            if len(token_ids) != self.runner.seq_len(slot):
                raise ValueError(
                    f"slot {slot} caches {self.runner.seq_len(slot)} tokens, not the {len(token_ids)} given"
                )
            features.append(self.runner.context_features(token_ids))
        return features

    def release(self, slot: int) -> None:
        self.runner.release(slot)

    def _verify_sampling(
        self,
        batch: VerifyBatch,
        logits: torch.Tensor,
        sampling: SamplingBatch,
        coins: torch.Tensor,
        coin_final: torch.Tensor,
    ) -> VerifyResult:
        """The lossless sampling walk on the device (greedy rows become one-hot distributions)."""
        probs = target_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)  # [B, N, V]
        return verify_sampling(
            batch, probs, coins.to(logits.device), coin_final.to(logits.device), backend=self.verify_backend
        )


def _gather_accepted(features: torch.Tensor, accept_index: torch.Tensor) -> torch.Tensor:
    """The features of every accept_index entry, gathered with device indices: `[B, D+1, F]`.

    `features [B, N, F]` and `accept_index [B, D+1]` on the device; one gather for the batch,
    no sync. Entries past a row's path hold the root's features; the caller cuts them off.
    """
    batch_size, num_nodes, feature_dim = features.shape
    node_rows = accept_index.clamp(min=0)
    rows = torch.arange(batch_size, device=features.device).view(-1, 1) * num_nodes + node_rows
    flat = features.reshape(batch_size * num_nodes, feature_dim).index_select(0, rows.view(-1))
    return flat.view(*accept_index.shape, feature_dim)
