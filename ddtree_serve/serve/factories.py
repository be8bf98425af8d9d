"""Picklable builders of the in-process models that the Ray workers wrap.

Each worker loads only its own model on its own device: the target needs the drafter's
`target_layer_ids` (the layers whose features it must tap), read from the drafter's config
file rather than by loading the drafter.
"""

from dataclasses import dataclass
from pathlib import Path

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.local import LocalDrafter, LocalTarget, resolve_verify_backend
from ddtree_serve.models import DFlashDrafter, TargetRunner, bundled_drafter_dir, bundled_target_dir
from ddtree_serve.models.dflash import DFlashConfig


def target_dir(config: EngineConfig) -> Path:
    return Path(config.target) if config.target is not None else bundled_target_dir()


def drafter_dir(config: EngineConfig) -> Path:
    return Path(config.drafter) if config.drafter is not None else bundled_drafter_dir()


@dataclass(frozen=True)
class LocalTargetFactory:
    """Builds the `LocalTarget` of `config` inside the TargetWorker."""

    config: EngineConfig

    def __call__(self) -> LocalTarget:
        layer_ids = None
        if self.config.mode != "ar":
            layer_ids = DFlashConfig.from_json_file(drafter_dir(self.config) / "config.json").target_layer_ids
        runner = TargetRunner.from_pretrained(
            target_dir(self.config),
            num_slots=self.config.max_num_seqs,
            max_seq_len=self.config.max_seq_len,
            device=self.config.device,
            dtype=self.config.torch_dtype,
            target_layer_ids=layer_ids,
            enforce_eager=self.config.enforce_eager,
        )
        return LocalTarget(runner, resolve_verify_backend(self.config.verify_backend, self.config.device))


@dataclass(frozen=True)
class LocalDrafterFactory:
    """Builds the `LocalDrafter` of `config` inside the DrafterWorker."""

    config: EngineConfig

    def __call__(self) -> LocalDrafter:
        drafter = DFlashDrafter.from_pretrained(
            drafter_dir(self.config),
            target_dir(self.config),
            num_slots=self.config.max_num_seqs,
            max_seq_len=self.config.max_seq_len,
            device=self.config.device,
            dtype=self.config.torch_dtype,
            enforce_eager=self.config.enforce_eager,
        )
        return LocalDrafter(drafter)
