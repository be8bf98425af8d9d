"""Validated configuration at the user boundary (Python, CLI, YAML all come through here).

Pydantic checks and documents every field once; the engine receives a plain frozen
`EngineSettings` from `EngineConfig.to_settings()` and the models their paths, device and dtype.
"""

import re
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from ddtree_serve.engine.sampling_params import SamplingParams
    from ddtree_serve.engine.settings import EngineSettings

_DEVICE_PATTERN = re.compile(r"^(cpu|cuda(:\d+)?)$")
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dir_problem(path: str | Path) -> str | None:
    """Why `path` is not a model directory on this disk (None: it has a config.json)."""
    return None if (Path(path) / "config.json").is_file() else "not a model directory (no config.json)"


class EngineConfig(BaseModel):
    """Everything needed to build one in-process speculative decoding engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str | None = Field(
        default=None,
        description="Directory of the target model (HF layout: config.json, *.safetensors, "
        "tokenizer.json). None = the bundled tiny Qwen3 target.",
    )
    drafter: str | None = Field(
        default=None,
        description="Directory of the DFlash drafter trained for `target`. None = the bundled "
        "drafter (only valid with the bundled target, or in mode 'ar').",
    )
    device: str = Field(default="cpu", description="Torch device for both models: 'cpu', 'cuda', 'cuda:N'.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Weight and activation dtype of both models."
    )
    mode: Literal["ar", "chain", "ddtree"] = Field(
        default="ddtree",
        description="Decoding mode: 'ar' plain target decoding (no drafter), 'chain' the linear "
        "DFlash draft, 'ddtree' best-first draft trees under `budget` nodes.",
    )
    budget: int = Field(
        default=32, ge=1, le=4096, description="Default DDTree node budget per request per step."
    )
    budget_policy: Literal["fixed", "adaptive"] = Field(
        default="fixed",
        description="'fixed': every tree gets `budget` nodes (or the request's draft_budget). "
        "'adaptive' (mode 'ddtree'): each step spends nodes across the batch where the calibrated "
        "drafter expects them accepted, while predicted tokens/s rise on the cost curve; a step may "
        "skip the drafter (plain decode). `budget` and draft_budget stay the ceilings.",
    )
    cost_curve: str | None = Field(
        default=None,
        description="Adaptive budget: JSON file of step costs over (batch, tree tokens) "
        "(format in ddtree_serve/engine/budget/cost_curve.py). None = measured at start-up.",
    )
    max_num_seqs: int = Field(
        default=8, ge=1, le=4096, description="Running requests at most (= KV slots per model)."
    )
    max_num_batched_tokens: int = Field(
        default=4096,
        ge=1,
        description="Tokens one step may feed the target (prompts being prefilled plus tree "
        "nodes); a single prompt longer than this still runs alone.",
    )
    max_seq_len: int = Field(
        default=2048,
        ge=16,
        description="Positions per slot: prompt + generated tokens + one tree. Left at the default, "
        "capped at the target's context length (max_position_embeddings, stretched by a RoPE "
        "scaling factor); a longer value set explicitly is refused, as vLLM's max_model_len.",
    )
    max_queue_len: int = Field(
        default=1024, ge=0, description="Requests waiting for a slot at most; more are refused."
    )
    verify_backend: Literal["auto", "torch", "triton", "sgl_kernel"] = Field(
        default="auto",
        description="Sampling verification backend; 'auto' picks triton on CUDA when importable, else torch.",
    )
    record_timings: bool = Field(
        default=False, description="Record per-stage step times (draft/build/verify/append)."
    )
    enforce_eager: bool = Field(
        default=False,
        description="Run every forward eagerly, without CUDA graphs (vLLM's name; for debugging). "
        "On CUDA the verify and draft forwards replay CUDA graphs otherwise; a CPU is always eager.",
    )
    mla_cache: Literal["latent", "decompressed"] = Field(
        default="latent",
        description="What an MLA target (DeepseekV3, Kimi K2.x) caches per token and layer: "
        "'latent' the compressed latent (kv_lora_rank + rope dims, 576 values for Kimi K2.6) with "
        "absorbed-weight attention; 'decompressed' every head's key and value (the reference, "
        "about 36x the memory for K2.6). Other families ignore it.",
    )
    default_max_tokens: int = Field(default=128, ge=1, description="max_tokens when a request sets none.")
    default_temperature: float = Field(default=0.0, ge=0.0, description="Temperature when unset; 0 = greedy.")
    default_top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="top_p when unset.")
    default_top_k: int = Field(default=0, ge=0, description="top_k when unset; 0 = off.")

    @field_validator("target", "drafter", "cost_curve")
    @classmethod
    def _check_path(cls, path: str | None) -> str | None:
        if path is not None and not path.strip():
            raise ValueError("an empty path (it names the working directory): give a path or leave it unset")
        return path

    @field_validator("device")
    @classmethod
    def _check_device(cls, device: str) -> str:
        if not _DEVICE_PATTERN.match(device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        return device

    @model_validator(mode="after")
    def _check_model_pair(self) -> "EngineConfig":
        if self.target is None and self.drafter is not None:
            raise ValueError("a custom drafter needs its own target: set `target` too")
        if self.budget_policy == "adaptive" and self.mode != "ddtree":
            raise ValueError(f"budget_policy 'adaptive' needs mode 'ddtree', got mode {self.mode!r}")
        if self.target is not None and self.drafter is None and self.mode != "ar":
            raise ValueError(f"mode {self.mode!r} with a custom target needs `drafter` (or use mode 'ar')")
        if self.mode == "ddtree" and self.max_seq_len <= self.budget + 1:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} leaves no room for a prompt beside one step's tree "
                f"(budget + 1 = {self.budget + 1} positions): raise max_seq_len or lower budget"
            )
        return self

    def missing_model_dir(self) -> str | None:
        """A message naming the first configured model directory without a config.json, if any.

        Not a validator: a config may name paths that exist only on the cluster's nodes, so the
        commands that load models on this machine's disk ask for it explicitly.
        """
        for field in ("target", "drafter"):
            path = getattr(self, field)
            if path is not None and (problem := model_dir_problem(path)):
                return f"{field} {path}: {problem}"
        return None

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.dtype]

    def to_settings(self) -> "EngineSettings":
        """The frozen view the engine loop reads."""
        # Imported here: the engine package imports this module, so a top-level import would cycle.
        from ddtree_serve.engine.settings import EngineSettings

        return EngineSettings(
            mode=self.mode,
            budget=self.budget,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_seq_len=self.max_seq_len,
            max_queue_len=self.max_queue_len,
            record_timings=self.record_timings,
            budget_policy=self.budget_policy,
            cost_curve=self.cost_curve,
        )

    def default_sampling_params(self) -> "SamplingParams":
        """Sampling used by requests that pass no `SamplingParams`."""
        from ddtree_serve.engine.sampling_params import SamplingParams

        return SamplingParams(
            max_tokens=self.default_max_tokens,
            temperature=self.default_temperature,
            top_p=self.default_top_p,
            top_k=self.default_top_k,
        )
