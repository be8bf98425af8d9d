"""The in-process engine: `SpecEngine` calling the target and draft steps directly.

No transport: the context handle is the list of device tensors `TargetStep` made, so the
drafter reads the target's features without a copy. `build_local_engine` loads both models
from an `EngineConfig` and wires them into a `SpecEngine`.
"""

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ddtree_serve.engine.draft_step import DraftStep
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.engine.target_step import TargetStep
from ddtree_serve.engine.timing import StageTimer
from ddtree_serve.models import (
    DFlashDrafter,
    TargetRunner,
    bundled_drafter_dir,
    bundled_target_dir,
    load_tokenizer,
)
from ddtree_serve.verify import backend_available

if TYPE_CHECKING:
    from ddtree_serve.config import EngineConfig


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
        drafter = DraftStep(
            DFlashDrafter.from_pretrained(
                drafter_dir,
                target_dir,
                num_slots=settings.max_num_seqs,
                max_seq_len=settings.max_seq_len,
                device=config.device,
                dtype=config.torch_dtype,
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
    )
    target = TargetStep(runner, resolve_verify_backend(config.verify_backend, config.device), timer)
    return SpecEngine(settings, target, drafter, load_tokenizer(target_dir), timer)
