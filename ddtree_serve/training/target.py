"""Stage 2: train the Qwen3 target as a plain next-token language model on the corpus."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ddtree_serve.models.layers import causal_mask
from ddtree_serve.models.qwen3 import Qwen3ForCausalLM
from ddtree_serve.training.data import eval_windows, sample_windows
from ddtree_serve.training.loop import (
    BestWeights,
    StageClock,
    autocast_for,
    make_optimizer,
    set_learning_rate,
)
from ddtree_serve.training.recipe import StageSchedule

MAX_EVAL_WINDOWS = 256


@dataclass(frozen=True)
class StageResult:
    """What a stage reports: steps, tokens, time, and the held-out loss of the kept weights."""

    steps: int
    tokens: int
    elapsed_s: float
    final_train_loss: float
    heldout_loss: float
    best_step: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.elapsed_s, 1e-9)


def lm_loss(model: Qwen3ForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of `tokens [B, T]` (predicting tokens 1..T-1)."""
    batch_size, seq_len = tokens.shape
    positions = torch.arange(seq_len, device=tokens.device).expand(batch_size, seq_len)
    hidden = model(tokens, positions, causal_mask(seq_len, tokens.device)).hidden
    logits = model.logits(hidden[:, :-1])  # [B, T-1, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


@torch.no_grad()
def heldout_lm_loss(model: Qwen3ForCausalLM, stream: torch.Tensor, seq_len: int, batch_size: int) -> float:
    """Token-weighted mean next-token loss over non-overlapping held-out windows."""
    was_training = model.training
    model.eval()
    windows = eval_windows(stream, seq_len, MAX_EVAL_WINDOWS)
    total, count = 0.0, 0
    with autocast_for(stream.device):
        for chunk in windows.split(batch_size):
            total += lm_loss(model, chunk).item() * chunk.numel()
            count += chunk.numel()
    model.train(was_training)
    return total / count


def train_target(
    model: Qwen3ForCausalLM,
    train_stream: torch.Tensor,
    heldout_stream: torch.Tensor,
    schedule: StageSchedule,
    generator: torch.Generator,
) -> StageResult:
    """Train until the schedule's step or time budget; keep the weights of the best held-out loss."""
    optimizer = make_optimizer(model.parameters(), schedule)
    clock = StageClock(schedule)
    best = BestWeights()
    last_eval_s = 0.0
    train_loss = float("nan")
    model.train()
    progress = tqdm(total=schedule.max_steps, desc="target", unit="step", mininterval=2.0)
    while not clock.done():
        set_learning_rate(optimizer, clock.learning_rate())
        batch = sample_windows(train_stream, schedule.batch_size, schedule.seq_len, generator)
        with autocast_for(batch.device):
            loss = lm_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        clock.step += 1
        progress.update(1)
        if clock.step % 10 == 0 or clock.done():
            train_loss = loss.item()
            tokens_per_s = clock.step * batch.numel() / clock.elapsed_s
            progress.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tokens_per_s:.3g}", refresh=False)
        if clock.elapsed_s - last_eval_s >= schedule.eval_every_s or clock.done():
            last_eval_s = clock.elapsed_s
            heldout = heldout_lm_loss(model, heldout_stream, schedule.seq_len, schedule.batch_size)
            best.offer(model, heldout, clock.step)
            progress.write(f"target step {clock.step}: train {loss.item():.4f} heldout {heldout:.4f}")
    progress.close()
    elapsed_s = clock.elapsed_s
    best.restore(model)
    return StageResult(
        steps=clock.step,
        tokens=clock.step * schedule.batch_size * schedule.seq_len,
        elapsed_s=elapsed_s,
        final_train_loss=loss.item(),
        heldout_loss=best.loss,
        best_step=best.step,
    )
