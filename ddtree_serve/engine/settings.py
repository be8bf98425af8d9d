"""The engine's own view of its configuration: a frozen dataclass, validated upstream.

`ddtree_serve.config.EngineConfig` (pydantic) validates user input and converts to this;
code inside the engine reads only these fields and never writes derived values back.
"""

from dataclasses import dataclass
from typing import Literal

SpecMode = Literal["ar", "chain", "ddtree"]
SPEC_MODES: tuple[SpecMode, ...] = ("ar", "chain", "ddtree")
BudgetPolicy = Literal["fixed", "adaptive"]
BUDGET_POLICIES: tuple[BudgetPolicy, ...] = ("fixed", "adaptive")


@dataclass(frozen=True)
class EngineSettings:
    """Limits and defaults of one `SpecEngine`; see `EngineConfig` for each field's meaning."""

    mode: SpecMode = "ddtree"
    budget: int = 32
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 4096
    max_seq_len: int = 2048
    max_queue_len: int = 1024
    record_timings: bool = False
    budget_policy: BudgetPolicy = "fixed"
    cost_curve: str | None = None  # JSON file for the adaptive policy; None = measure at start-up
