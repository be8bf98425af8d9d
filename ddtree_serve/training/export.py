"""Write trained modules as HF-style model directories, in half precision.

The directory writer is the models package's own (`save_model_dir`), so the training output
has exactly the layout the loader reads; this adds the storage dtype and HF's generation config.
"""

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddtree_serve.models.loading import save_model_dir

STORAGE_DTYPE = torch.float16
STORAGE_DTYPE_NAME = "float16"


def save_half_precision(module: nn.Module, config: dict[str, Any], model_dir: Path) -> int:
    """config.json + float16 model.safetensors (a tied head stored once); returns the weights' bytes."""
    save_model_dir(module, config, model_dir, dtype=STORAGE_DTYPE)
    return (model_dir / "model.safetensors").stat().st_size


def save_generation_config(model_dir: Path, eos_token_id: int) -> None:
    """generation_config.json as HF dirs carry it (greedy by default, EOS = end-of-text)."""
    generation_config = {"bos_token_id": eos_token_id, "eos_token_id": eos_token_id, "do_sample": False}
    (model_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
