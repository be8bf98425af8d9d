"""Random-weight model directories in the real on-disk layout, for tests and CPU benchmarks.

They exercise every loading and serving path without a model hub: a target directory is a
Qwen3 `config.json` + `model.safetensors` (+ an optional `tokenizer.json`), a drafter
directory is a z-lab-style DFlash `config.json` + `model.safetensors`.
"""

from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

from ddtree_serve.models.dflash import DFlashConfig, DFlashDraftModel
from ddtree_serve.models.layers import RMSNorm
from ddtree_serve.models.loading import save_model_dir
from ddtree_serve.models.qwen3 import Qwen3Config, Qwen3ForCausalLM


def randomize_(module: nn.Module, seed: int, std: float = 0.05) -> nn.Module:
    """Fill weights from a seeded normal; norm weights near 1 (so wrong norm wiring shows)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, RMSNorm):
                sub.weight.copy_(1.0 + 0.1 * torch.randn(sub.weight.shape, generator=generator))
            elif isinstance(sub, nn.Linear | nn.Embedding):
                sub.weight.copy_(std * torch.randn(sub.weight.shape, generator=generator))
                if getattr(sub, "bias", None) is not None:
                    sub.bias.copy_(std * torch.randn(sub.bias.shape, generator=generator))
    return module


def write_random_target_dir(
    path: str | Path, config: dict, *, seed: int = 0, tokenizer: Tokenizer | None = None
) -> Path:
    """Write a random-weight target (HF config dict `config`) and, if given, its tokenizer."""
    model = randomize_(Qwen3ForCausalLM(Qwen3Config.from_dict(config)), seed)
    path = save_model_dir(model, config, path)
    if tokenizer is not None:
        tokenizer.save(str(path / "tokenizer.json"))
    return path


def write_random_drafter_dir(path: str | Path, config: dict, *, seed: int = 1) -> Path:
    """Write a random-weight DFlash drafter for the z-lab-style config dict `config`."""
    model = randomize_(DFlashDraftModel(DFlashConfig.from_dict(config)), seed)
    return save_model_dir(model, config, path)
