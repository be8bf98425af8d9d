"""`TargetStep`: the target's half of a decoding step, whichever transport calls it.

It owns a `TargetRunner` and does everything the target does in a step: prefill the newcomers
and sample their first token; run the verify forward over the trees, walk them (greedy on the
host, or the lossless sampling walk on the device with the backend chosen at build time),
commit the accepted KV entries and gather the accepted nodes' features for the drafter.
In process the engine calls it directly; over Ray a `TargetWorker` holds one and adds only
transport. Context handles it produces are lists of device tensors, one per request.
"""

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
from ddtree_serve.tree import VerifyBatch, build_chain, build_verify_batch
from ddtree_serve.verify import VerifyResult, get_greedy_backend, target_probs, verify_sampling


class TargetStep:
    """`Target` over a `TargetRunner` in this process."""

    def __init__(self, runner: TargetRunner, verify_backend: str, timer: StageTimer | None = None) -> None:
        """`verify_backend`: a sampling verification backend that is available here (resolved)."""
        self.runner = runner
        self.verify_backend = verify_backend
        # The greedy walk runs on the host: one [B, N] argmax copy, no per-level device syncs.
        self._greedy_walk = get_greedy_backend("host")
        self.timer = timer or StageTimer()
        self.device = runner.device

    @property
    def vocab_size(self) -> int:
        return int(self.runner.vocab_size)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.runner.eos_token_ids)

    @property
    def max_seq_len(self) -> int:
        return int(self.runner.max_seq_len)

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
        slots, batch, sampling = list(inputs.slots), inputs.batch, inputs.sampling
        device_batch = batch.to(self.device)
        with self.timer.stage(Stage.TARGET_FORWARD):
            logits, features = self.runner.verify(slots, device_batch)  # [B, N, V], [B, N, F]
        if sampling.all_greedy:
            # One [B, N] copy to the host, then the walk there (no per-level device syncs).
            accept_index, accept_len, bonus = self._greedy_walk(batch, logits.argmax(dim=-1).cpu())
        else:
            assert inputs.coins is not None and inputs.coin_final is not None, "sampling needs coins"
            result = self._verify_sampling(device_batch, logits, sampling, inputs.coins, inputs.coin_final)
            # One device -> host copy for all small results.
            packed = torch.cat(
                [result.accept_index, result.accept_len.view(-1, 1), result.bonus_token.view(-1, 1)], dim=1
            ).cpu()  # [B, D+3]
            accept_index, accept_len, bonus = packed[:, :-2], packed[:, -2], packed[:, -1]
        num_cached_tokens = self.runner.commit(slots, accept_index)  # host indices: no sync
        context = None
        if inputs.return_context:
            context = _accepted_features(features, accept_index, accept_len)
        return VerifyOutput(
            accept_index=accept_index,
            accept_len=accept_len,
            bonus_token=bonus,
            num_cached_tokens=tuple(num_cached_tokens),
            context=context,
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


def _accepted_features(
    features: torch.Tensor, accept_index: torch.Tensor, accept_len: torch.Tensor
) -> list[torch.Tensor]:
    """Per request, the features of its root and accepted nodes, in path order: `[n_b, F]` views.

    `features [B, N, F]` on the device; `accept_index [B, D+1]`, `accept_len [B]` on the host.
    One gather for the batch, then views split by length (no kernel per request).
    """
    batch_size, num_nodes, _ = features.shape
    lengths = (accept_len + 1).tolist()
    rows = torch.arange(batch_size).view(-1, 1) * num_nodes + accept_index  # [B, D+1] flat rows
    keep = torch.arange(accept_index.shape[1]).view(1, -1) < (accept_len + 1).view(-1, 1)
    flat_rows = rows[keep].to(features.device)  # [sum n_b], path order per row
    gathered = features.reshape(batch_size * num_nodes, -1).index_select(0, flat_rows)  # [sum n_b, F]
    return list(gathered.split(lengths))
