"""What the target and drafter stages share: init, optimiser, schedule, clock, best-weights keeping.

Stages stop on whichever comes first, a step count or a wall-clock budget, and the learning
rate follows the progress towards that stop, so a run cut short by its budget still ends
with a decayed learning rate instead of being killed mid-schedule.
"""

import math
import time
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from ddtree_serve.training.recipe import StageSchedule

INIT_STD = 0.02


def init_weights(module: nn.Module, num_layers: int) -> None:
    """GPT-style init: N(0, 0.02) weights, residual output projections scaled by 1/sqrt(2 * layers).

    Matters most for the tied embedding: PyTorch's default N(0, 1) embedding would start the
    LM head with logits of standard deviation sqrt(hidden).
    """
    residual_std = INIT_STD / math.sqrt(2 * num_layers)
    for name, param in module.named_parameters():
        if param.dim() < 2:
            continue  # norm weights keep their ones, biases their zeros
        std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else INIT_STD
        nn.init.normal_(param, mean=0.0, std=std)


def make_optimizer(params: Iterable[nn.Parameter], schedule: StageSchedule) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm weights are not decayed)."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": schedule.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=schedule.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


class StageClock:
    """Step count, elapsed time and the progress fraction that drives the schedule and stop."""

    def __init__(self, schedule: StageSchedule) -> None:
        self.schedule = schedule
        self.started = time.perf_counter()
        self.step = 0

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    @property
    def progress(self) -> float:
        """Fraction of the stage done: the further along of steps and wall-clock."""
        by_steps = self.step / self.schedule.max_steps
        by_time = self.elapsed_s / self.schedule.time_budget_s
        return min(1.0, max(by_steps, by_time))

    def done(self) -> bool:
        return self.progress >= 1.0

    def learning_rate(self) -> float:
        """Linear warmup over `warmup_steps`, then cosine decay to 10% of the peak by progress 1."""
        peak = self.schedule.lr
        if self.step < self.schedule.warmup_steps:
            return peak * (self.step + 1) / self.schedule.warmup_steps
        return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * self.progress)))


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def autocast_for(device: torch.device) -> AbstractContextManager:
    """bf16 autocast on CUDA; plain float32 on CPU (the smoke run and tests)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


class BestWeights:
    """Keeps a copy of the weights with the lowest held-out loss seen so far (early stopping)."""

    def __init__(self) -> None:
        self.loss = math.inf
        self.step = -1
        self._state: dict[str, torch.Tensor] | None = None

    def offer(self, module: nn.Module, loss: float, step: int) -> bool:
        if loss >= self.loss:
            return False
        self.loss, self.step = loss, step
        self._state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        return True

    def restore(self, module: nn.Module) -> None:
        if self._state is not None:
            module.load_state_dict(self._state)
