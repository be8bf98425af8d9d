"""In-process `Target` and `Drafter`: the model runners behind the engine's seam, same process.

The context handle here is a plain list of device tensors (one per request of the call), so the
drafter reads the target's features without a copy. `build_local_engine` loads both models
from an `EngineConfig` and wires them into a `SpecEngine`.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ddtree_serve.engine.greedy_walk import greedy_walk_on_host
from ddtree_serve.engine.interfaces import (
    ContextSlice,
    DraftOutput,
    PrefillOutput,
    SamplingBatch,
    VerifyOutput,
)
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.engine.timing import StageTimer
from ddtree_serve.models import (
    DFlashDrafter,
    TargetRunner,
    bundled_drafter_dir,
    bundled_target_dir,
    load_tokenizer,
)
from ddtree_serve.tree import VerifyBatch, build_chain, build_verify_batch, draft_topk
from ddtree_serve.verify import VerifyResult, backend_available, target_probs, verify_sampling

if TYPE_CHECKING:
    from ddtree_serve.config import EngineConfig


class LocalTarget:
    """`Target` over a `TargetRunner` in this process."""

    def __init__(self, runner: TargetRunner, verify_backend: str, timer: StageTimer | None = None) -> None:
        self.runner = runner
        self.verify_backend = verify_backend
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

    def prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        sampling: SamplingBatch,
        coins: torch.Tensor | None,
    ) -> PrefillOutput:
        # One forward for all prompts; timed as the engine's "prefill" stage.
        last_logits, features = self.runner.prefill_batch(list(slots), [list(p) for p in prompts])  # [B, V]
        if sampling.all_greedy:
            first_tokens = last_logits.argmax(dim=-1)
        else:
            # The first token is an "ar" step's bonus: a root-only tree verified with coin_final.
            assert coins is not None, "sampling needs coins"
            roots = build_verify_batch([build_chain([], 0) for _ in slots])
            no_coins = torch.zeros(roots.batch_size, 1)
            first_tokens = self._verify_sampling(
                roots, last_logits.unsqueeze(1), sampling, no_coins, coins
            ).bonus_token
        return PrefillOutput(first_tokens=first_tokens.cpu(), context=features)

    def verify(
        self,
        slots: Sequence[int],
        batch: VerifyBatch,
        sampling: SamplingBatch,
        coins: torch.Tensor | None,
        coin_final: torch.Tensor | None,
        return_context: bool,
    ) -> VerifyOutput:
        device_batch = batch.to(self.device, non_blocking=True)
        starts = [self.runner.seq_len(slot) for slot in slots]
        with self.timer.stage("target_forward"):
            logits, features = self.runner.verify(list(slots), device_batch, starts)  # [B, N, V], [B, N, F]
        if sampling.all_greedy:
            # One [B, N] copy to the host, then the walk there (no per-level device syncs).
            accept_index, accept_len, bonus = greedy_walk_on_host(batch, logits.argmax(dim=-1).cpu())
        else:
            assert coins is not None and coin_final is not None, "sampling needs coins"
            result = self._verify_sampling(device_batch, logits, sampling, coins, coin_final)
            # One device -> host copy for all small results.
            packed = torch.cat(
                [result.accept_index, result.accept_len.view(-1, 1), result.bonus_token.view(-1, 1)], dim=1
            ).cpu()  # [B, D+3]
            accept_index, accept_len, bonus = packed[:, :-2], packed[:, -2], packed[:, -1]
        self.runner.commit(list(slots), accept_index)  # host indices: compaction needs no sync
        context = None
        if return_context:
            context = _accepted_features(features, accept_index, accept_len)
        return VerifyOutput(
            accept_index=accept_index, accept_len=accept_len, bonus_token=bonus, context=context
        )

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
            batch,
            probs,
            coins.to(logits.device, non_blocking=True),
            coin_final.to(logits.device, non_blocking=True),
            backend=self.verify_backend,
        )


class LocalDrafter:
    """`Drafter` over a `DFlashDrafter` in this process; returns top-K on the host."""

    def __init__(self, drafter: DFlashDrafter, timer: StageTimer | None = None) -> None:
        self.drafter = drafter
        self.timer = timer or StageTimer()

    @property
    def block_size(self) -> int:
        return int(self.drafter.block_size)

    def draft(
        self,
        slots: Sequence[int],
        bonus_tokens: torch.Tensor,
        contexts: Sequence[ContextSlice],
        top_k: int,
    ) -> DraftOutput:
        new_context = [context.handle[context.index] for context in contexts]  # each [n_b, F]
        with self.timer.stage("draft_forward"):
            logits = self.drafter.draft(list(slots), bonus_tokens, new_context)  # [B, L, V]
        logp, ids = draft_topk(logits, top_k)  # [B, L, K]
        packed = torch.cat([logp, ids.to(logp.dtype)], dim=-1).cpu()  # one copy; ids < 2^24 exact
        k = logp.shape[-1]
        return DraftOutput(logp=packed[..., :k].contiguous(), ids=packed[..., k:].long())

    def release(self, slot: int) -> None:
        self.drafter.release(slot)


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
    flat_rows = rows[keep].to(features.device, non_blocking=True)  # [sum n_b], path order per row
    gathered = features.reshape(batch_size * num_nodes, -1).index_select(0, flat_rows)  # [sum n_b, F]
    return list(gathered.split(lengths))


def resolve_verify_backend(name: str, device: str) -> str:
    """'auto' -> triton on CUDA when it imports, else torch; explicit names are checked."""
    if name == "auto":
        return "triton" if device.startswith("cuda") and backend_available("triton") else "torch"
    if not backend_available(name):
        raise ValueError(f"verify backend {name!r} is not available here")
    return name


def build_local_engine(config: "EngineConfig") -> SpecEngine:
    """Load the target (and the drafter, unless mode 'ar') and wire an in-process `SpecEngine`."""
    target_dir = Path(config.target) if config.target is not None else bundled_target_dir()
    drafter_dir = Path(config.drafter) if config.drafter is not None else bundled_drafter_dir()
    synchronize = torch.cuda.synchronize if config.device.startswith("cuda") else None
    timer = StageTimer(enabled=config.record_timings, synchronize=synchronize)
    settings = config.to_settings()
    drafter = None
    if settings.mode != "ar":
        drafter = LocalDrafter(
            DFlashDrafter.from_pretrained(
                drafter_dir,
                target_dir,
                num_slots=settings.max_num_seqs,
                max_seq_len=settings.max_seq_len,
                device=config.device,
                dtype=config.torch_dtype,
                enforce_eager=config.enforce_eager,
            ),
            timer,
        )
    runner = TargetRunner.from_pretrained(
        target_dir,
        num_slots=settings.max_num_seqs,
        max_seq_len=settings.max_seq_len,
        device=config.device,
        dtype=config.torch_dtype,
        # The target taps the hidden layers its drafter was trained on.
        target_layer_ids=drafter.drafter.target_layer_ids if drafter is not None else None,
        enforce_eager=config.enforce_eager,
    )
    target = LocalTarget(runner, resolve_verify_backend(config.verify_backend, config.device), timer)
    return SpecEngine(settings, target, drafter, load_tokenizer(target_dir), timer)
