"""The one model builder: an `EngineConfig` in, the target and draft steps out.

Only here does the code know where the model directories are, which target layers feed the
drafter, which verify backend runs, and how the step timer reads the device. `build_local_engine` (for
`LLM`, the CLI and the benches) and the Ray workers (through the picklable factories) both
build through it, so each model loads one way.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.draft_step import DraftStep
from ddtree_serve.engine.target_step import TargetStep
from ddtree_serve.engine.timing import StageTimer
from ddtree_serve.models import (
    DFlashConfig,
    DFlashDrafter,
    TargetRunner,
    bundled_drafter_dir,
    bundled_target_dir,
)
from ddtree_serve.models.context_length import target_context_length
from ddtree_serve.models.parallel import RankSpec, TensorParallel, join_group
from ddtree_serve.verify import backend_available

log = logging.getLogger(__name__)


def target_dir(config: EngineConfig) -> Path:
    return Path(config.target) if config.target is not None else bundled_target_dir()


def drafter_dir(config: EngineConfig) -> Path:
    return Path(config.drafter) if config.drafter is not None else bundled_drafter_dir()


def target_layer_ids(config: EngineConfig) -> tuple[int, ...] | None:
    """The target layers whose outputs the drafter was trained on; None in mode 'ar' (no drafter).

    Read from the drafter's config file, so a target worker never loads the drafter.
    """
    if config.mode == "ar":
        return None
    return DFlashConfig.from_json_file(drafter_dir(config) / "config.json").target_layer_ids


def fitted_max_seq_len(config: EngineConfig) -> int:
    """The positions a slot holds: `max_seq_len`, capped at the target's context length when the
    config leaves it at its default; an explicit longer one is refused (vLLM's `max_model_len`),
    and so is a cap that leaves a ddtree slot no room beside its tree (`EngineConfig` checks an
    uncapped length).

    Raises ValueError naming the lengths, before any weight loads.
    """
    limit = target_context_length(target_dir(config))
    if config.max_seq_len <= limit:
        return config.max_seq_len
    if "max_seq_len" in config.model_fields_set:
        raise ValueError(
            f"max_seq_len {config.max_seq_len} is longer than the target's context length {limit} "
            f"({target_dir(config) / 'config.json'}): set max_seq_len to {limit} or less"
        )
    if config.mode == "ddtree" and limit <= config.budget + 1:
        raise ValueError(
            f"the target's context length {limit} leaves no room for a prompt beside one step's "
            f"tree (budget + 1 = {config.budget + 1} positions): lower budget"
        )
    return limit


def resolve_verify_backend(name: str, device: str) -> str:
    """'auto' -> triton on CUDA when it imports, else torch; explicit names are checked."""
    if name == "auto":
        return "triton" if device.startswith("cuda") and backend_available("triton") else "torch"
    if not backend_available(name):
        raise ValueError(f"verify backend {name!r} is not available here")
    return name


def stage_timer(config: EngineConfig) -> StageTimer:
    """The step timer: on when `record_timings`; CUDA events on CUDA (no syncs added)."""
    return StageTimer(enabled=config.record_timings, cuda_events=config.device.startswith("cuda"))


def build_target_step(
    config: EngineConfig, timer: StageTimer | None = None, tensor_parallel: TensorParallel | None = None
) -> TargetStep:
    """`tensor_parallel`: this process is one rank of a target group and loads only its shard."""
    max_seq_len = fitted_max_seq_len(config)
    if max_seq_len < config.max_seq_len:
        log.info(
            "max_seq_len %d capped to the target's context length %d (set max_seq_len to choose less)",
            config.max_seq_len,
            max_seq_len,
        )
    runner = TargetRunner.from_pretrained(
        target_dir(config),
        num_slots=config.max_num_seqs,
        max_seq_len=max_seq_len,
        device=config.device,
        dtype=config.torch_dtype,
        enforce_eager=config.enforce_eager,
        target_layer_ids=target_layer_ids(config),
        tensor_parallel=tensor_parallel,
        mla_cache=config.mla_cache,
    )
    return TargetStep(runner, resolve_verify_backend(config.verify_backend, config.device), timer)


def build_draft_step(config: EngineConfig, timer: StageTimer | None = None) -> DraftStep:
    drafter = DFlashDrafter.from_pretrained(
        drafter_dir(config),
        target_dir(config),
        num_slots=config.max_num_seqs,
        max_seq_len=fitted_max_seq_len(config),
        device=config.device,
        dtype=config.torch_dtype,
        enforce_eager=config.enforce_eager,
    )
    return DraftStep(drafter, timer)


@dataclass(frozen=True)
class TargetStepFactory:
    """Builds the `TargetStep` of `config` where it is called (inside the TargetWorker)."""

    config: EngineConfig

    def __call__(self) -> TargetStep:
        return build_target_step(self.config)


@dataclass(frozen=True)
class TargetRankFactory:
    """Builds one rank's `TargetStep` where it is called (inside that rank's TargetWorker).

    Joining the group blocks until every rank of `rank.world_size` has called it.
    """

    config: EngineConfig
    rank: RankSpec

    def __call__(self) -> TargetStep:
        fitted_max_seq_len(self.config)  # a refused length fails each rank before the rendezvous
        return build_target_step(self.config, tensor_parallel=join_group(self.rank, self.config.device))


@dataclass(frozen=True)
class DraftStepFactory:
    """Builds the `DraftStep` of `config` where it is called (inside the DrafterWorker)."""

    config: EngineConfig

    def __call__(self) -> DraftStep:
        return build_draft_step(self.config)
