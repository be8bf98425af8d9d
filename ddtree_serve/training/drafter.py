"""Stage 3: train the DFlash drafter against the frozen target, DFlash-style.

One training row is a token sequence `[T]` with the target's context features `[T, F]`.
N random anchors are drawn per row; block n is `[token[a_n], MASK x (bs - 1)]` at positions
`a_n .. a_n + bs - 1`. All N blocks of a row go through the drafter in one forward, side by
side, under a block-structured mask: block n sees the context features strictly before its
anchor (exactly what the runtime has cached when it drafts after bonus token a_n) and its
own block, non-causally; blocks never see each other.

Block position k (1..bs-1) predicts token `a_n + k`. Its label is the target's distribution
at position `a_n + k - 1` (self-distillation: the drafter is scored on agreeing with the
target, and soft labels also calibrate the top-K lists that DDTree expands), weighted by
`exp(-(k - 1) / gamma)` because a late position only counts when every earlier one was accepted.
"""

import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ddtree_serve.models.dflash import DFlashDraftModel
from ddtree_serve.models.layers import causal_mask
from ddtree_serve.models.qwen3 import Qwen3ForCausalLM, context_features
from ddtree_serve.training.data import sample_windows
from ddtree_serve.training.generation import continue_prompts
from ddtree_serve.training.loop import (
    BestWeights,
    StageClock,
    autocast_for,
    make_optimizer,
    set_learning_rate,
)
from ddtree_serve.training.recipe import DrafterTraining
from ddtree_serve.training.target import StageResult

GENERATION_CHUNK_ROWS = 8192


@dataclass(frozen=True)
class DraftLoss:
    """The weighted soft cross-entropy and a greedy-agreement readout of one batch."""

    loss: torch.Tensor  # scalar, differentiable
    # mean number of leading block positions whose draft argmax equals the target argmax, plus 1:
    # the chain acceptance length at temperature 0 when the row is the target's greedy output
    greedy_tau: float


def sample_anchors(
    batch_size: int, seq_len: int, num_anchors: int, block_size: int, generator: torch.Generator
) -> torch.Tensor:
    """`[B, N]` distinct sorted anchors in `[1, seq_len - block_size]` (every label in range)."""
    num_candidates = seq_len - block_size
    if num_anchors > num_candidates:
        raise ValueError(
            f"{num_anchors} anchors do not fit a sequence of {seq_len} with blocks of {block_size}"
        )
    scores = torch.rand(batch_size, num_candidates, generator=generator, device=generator.device)
    return scores.argsort(dim=1)[:, :num_anchors].sort(dim=1).values + 1


def block_attention_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """`[B, N * bs, seq_len + N * bs]` bool: context strictly before the own anchor, then the own block."""
    batch_size, num_blocks = anchors.shape
    device = anchors.device
    query_block = torch.arange(num_blocks * block_size, device=device) // block_size  # [Q]
    query_anchor = anchors[:, query_block]  # [B, Q]
    sees_context = torch.arange(seq_len, device=device)[None, None, :] < query_anchor[:, :, None]
    sees_block = (query_block[:, None] == query_block[None, :]).expand(batch_size, -1, -1)
    return torch.cat([sees_context, sees_block], dim=2)


def dflash_loss(
    draft_model: DFlashDraftModel,
    target: Qwen3ForCausalLM,
    tokens: torch.Tensor,
    anchors: torch.Tensor,
    loss_decay_gamma: float,
) -> DraftLoss:
    """Weighted soft cross-entropy of the drafter's blocks against the target's distributions."""
    config = draft_model.config
    block_size = config.block_size
    batch_size, seq_len = tokens.shape
    device = tokens.device
    positions = torch.arange(seq_len, device=device).expand(batch_size, seq_len)
    with torch.no_grad():
        target_out = target(
            tokens, positions, causal_mask(seq_len, device), output_layer_ids=config.target_layer_ids
        )
        features = context_features(target_out, config.target_layer_ids)  # [B, T, F]
        target_logits = target.logits(target_out.hidden)  # [B, T, V]

    offsets = torch.arange(block_size, device=device)
    block_positions = anchors[:, :, None] + offsets  # [B, N, bs]
    block_tokens = torch.full_like(block_positions, config.mask_token_id)
    block_tokens[:, :, 0] = tokens.gather(1, anchors)
    noise_embeds = target.model.embed_tokens(block_tokens.flatten(1)) * config.input_embedding_scale
    mask = block_attention_mask(anchors, seq_len, block_size)
    draft_hidden = draft_model(noise_embeds, block_positions.flatten(1), mask, features, positions)
    draft_hidden = draft_hidden.unflatten(1, (anchors.shape[1], block_size))[:, :, 1:]  # [B, N, bs-1, H]
    draft_logprobs = torch.log_softmax(target.logits(draft_hidden).float(), dim=-1)  # [B, N, bs-1, V]

    label_source = block_positions[:, :, :-1]  # position a+k-1 predicts token a+k, k = 1..bs-1
    batch_index = torch.arange(batch_size, device=device)[:, None, None]
    with torch.no_grad():
        label_logits = target_logits[batch_index, label_source].float()  # [B, N, bs-1, V]
        label_probs = torch.softmax(label_logits, dim=-1)
    cross_entropy = -(label_probs * draft_logprobs).sum(-1)  # [B, N, bs-1]
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / loss_decay_gamma)  # [bs-1]
    loss = (cross_entropy * weights).mean(dim=(0, 1)).sum() / weights.sum()

    with torch.no_grad():
        matches = draft_logprobs.argmax(-1) == label_logits.argmax(-1)  # [B, N, bs-1]
        accepted = matches.long().cumprod(dim=-1).sum(-1).float()
        greedy_tau = 1.0 + accepted.mean().item()
    return DraftLoss(loss=loss, greedy_tau=greedy_tau)


def generate_rows(
    target: Qwen3ForCausalLM,
    train_stream: torch.Tensor,
    heldout_stream: torch.Tensor,
    training: DrafterTraining,
    seq_len: int,
    num_eval_rows: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(training pool, held-out eval rows), both `[n, seq_len]`, generated in one batched pass.

    Pool: half of the rows sample their whole continuation (the target's distribution on
    novel text), half sample `generation_prompt_len // 2` tokens and then continue greedily
    (temperature-0 behaviour after a context the target did not memorise). Eval rows are
    greedy continuations of held-out prompts: what temperature-0 acceptance is measured on.
    """
    num_new = seq_len - training.generation_prompt_len
    num_pool = training.num_generated_seqs if training.generated_fraction > 0 else 0
    prompts = torch.cat(
        [
            sample_windows(train_stream, num_pool, training.generation_prompt_len, generator),
            sample_windows(heldout_stream, num_eval_rows, training.generation_prompt_len, generator),
        ]
    )
    num_sampled = torch.zeros(prompts.shape[0], dtype=torch.int64)
    num_sampled[: num_pool // 2] = num_new
    num_sampled[num_pool // 2 : num_pool] = training.generation_prompt_len // 2
    rows = torch.cat(
        [
            continue_prompts(target, chunk, num_new, chunk_sampled, generator)
            for chunk, chunk_sampled in zip(
                prompts.split(GENERATION_CHUNK_ROWS), num_sampled.split(GENERATION_CHUNK_ROWS), strict=True
            )
        ]
    )
    return rows[:num_pool], rows[num_pool:]


def mixed_batch(
    corpus_stream: torch.Tensor,
    generated_pool: torch.Tensor,
    batch_size: int,
    seq_len: int,
    generated_fraction: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """`[B, seq_len]`: a `generated_fraction` share of rows from the pool, the rest corpus windows."""
    num_generated = round(batch_size * generated_fraction) if generated_pool.shape[0] else 0
    parts = []
    if num_generated:
        picks = torch.randint(
            0, generated_pool.shape[0], (num_generated,), generator=generator, device=generator.device
        )
        parts.append(generated_pool[picks.to(generated_pool.device)])
    if batch_size - num_generated:
        parts.append(sample_windows(corpus_stream, batch_size - num_generated, seq_len, generator))
    return torch.cat(parts)


@torch.no_grad()
def evaluate_drafter(
    draft_model: DFlashDraftModel,
    target: Qwen3ForCausalLM,
    eval_rows: torch.Tensor,
    anchors: torch.Tensor,
    training: DrafterTraining,
) -> tuple[float, float]:
    """(loss, greedy tau) over fixed held-out rows and anchors, batch by batch."""
    draft_model.eval()
    batch_size = training.schedule.batch_size
    total_loss, total_tau, count = 0.0, 0.0, 0
    with autocast_for(eval_rows.device):
        for rows, row_anchors in zip(eval_rows.split(batch_size), anchors.split(batch_size), strict=True):
            result = dflash_loss(draft_model, target, rows, row_anchors, training.loss_decay_gamma)
            total_loss += result.loss.item() * rows.shape[0]
            total_tau += result.greedy_tau * rows.shape[0]
            count += rows.shape[0]
    draft_model.train()
    return total_loss / count, total_tau / count


@dataclass(frozen=True)
class DrafterStageResult:
    """The stage's figures: the common ones plus the held-out greedy tau and data-generation time."""

    stage: StageResult
    heldout_greedy_tau: float
    generation_s: float
    generated_rows: int


def train_drafter(
    draft_model: DFlashDraftModel,
    target: Qwen3ForCausalLM,
    train_stream: torch.Tensor,
    heldout_stream: torch.Tensor,
    training: DrafterTraining,
    num_eval_rows: int,
    generator: torch.Generator,
) -> DrafterStageResult:
    """Generate self-distillation data, then train until the step or time budget; keep the best weights."""
    schedule = training.schedule
    block_size = draft_model.config.block_size
    target.eval()
    target.requires_grad_(False)

    clock_generation = StageClock(schedule)
    generated_pool, eval_rows = generate_rows(
        target, train_stream, heldout_stream, training, schedule.seq_len, num_eval_rows, generator
    )
    eval_anchors = sample_anchors(
        eval_rows.shape[0], schedule.seq_len, training.anchors_per_seq, block_size, generator
    )
    generation_s = clock_generation.elapsed_s

    optimizer = make_optimizer(draft_model.parameters(), schedule)
    clock = StageClock(schedule)
    best = BestWeights()
    best_tau = math.nan
    last_eval_s = 0.0
    draft_model.train()
    progress = tqdm(total=schedule.max_steps, desc="drafter", unit="step", mininterval=2.0)
    while not clock.done():
        set_learning_rate(optimizer, clock.learning_rate())
        tokens = mixed_batch(
            train_stream,
            generated_pool,
            schedule.batch_size,
            schedule.seq_len,
            training.generated_fraction,
            generator,
        )
        anchors = sample_anchors(
            tokens.shape[0], schedule.seq_len, training.anchors_per_seq, block_size, generator
        )
        with autocast_for(tokens.device):
            result = dflash_loss(draft_model, target, tokens, anchors, training.loss_decay_gamma)
        optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(draft_model.parameters(), 1.0)
        optimizer.step()
        clock.step += 1
        progress.update(1)
        if clock.step % 10 == 0:
            progress.set_postfix(
                loss=f"{result.loss.item():.3f}", tau=f"{result.greedy_tau:.2f}", refresh=False
            )
        if clock.elapsed_s - last_eval_s >= schedule.eval_every_s or clock.done():
            last_eval_s = clock.elapsed_s
            heldout_loss, heldout_tau = evaluate_drafter(
                draft_model, target, eval_rows, eval_anchors, training
            )
            if best.offer(draft_model, heldout_loss, clock.step):
                best_tau = heldout_tau
            progress.write(
                f"drafter step {clock.step}: train {result.loss.item():.4f} "
                f"heldout {heldout_loss:.4f} greedy tau {heldout_tau:.3f}"
            )
    progress.close()
    elapsed_s = clock.elapsed_s
    best.restore(draft_model)
    stage = StageResult(
        steps=clock.step,
        tokens=clock.step * schedule.batch_size * schedule.seq_len,
        elapsed_s=elapsed_s,
        final_train_loss=result.loss.item(),
        heldout_loss=best.loss,
        best_step=best.step,
    )
    return DrafterStageResult(
        stage=stage,
        heldout_greedy_tau=best_tau,
        generation_s=generation_s,
        generated_rows=generated_pool.shape[0],
    )
