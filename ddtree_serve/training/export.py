"""Write trained modules as HF-style model directories (config.json + model.safetensors).

Weights are stored in half precision to keep the bundled pair small. A tied LM head is not
stored (its tensor is the embedding), as Hugging Face does for tied checkpoints.
"""

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

STORAGE_DTYPE = torch.float16
STORAGE_DTYPE_NAME = "float16"


def half_precision_state(module: nn.Module, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The module's parameters and persistent buffers as contiguous CPU fp16 tensors."""
    return {
        name: tensor.detach().to("cpu", STORAGE_DTYPE).contiguous()
        for name, tensor in module.state_dict().items()
        if name not in skip
    }


def save_model_dir(
    model_dir: Path, config: dict[str, Any], state: dict[str, torch.Tensor], metadata: dict[str, str]
) -> int:
    """Write config.json and model.safetensors into `model_dir`; returns the weights' size in bytes."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights_path = model_dir / "model.safetensors"
    save_file(state, str(weights_path), metadata={"format": "pt", **metadata})
    return weights_path.stat().st_size


def save_generation_config(model_dir: Path, eos_token_id: int) -> None:
    """generation_config.json as HF dirs carry it (greedy by default, EOS = end-of-text)."""
    generation_config = {"bos_token_id": eos_token_id, "eos_token_id": eos_token_id, "do_sample": False}
    (model_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
