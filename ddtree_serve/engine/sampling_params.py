"""Per-request generation settings, validated when built so bad values fail at the boundary."""

from dataclasses import dataclass

from ddtree_serve.verify.probs import GREEDY_TEMPERATURE_EPS

MAX_SEED = 2**64
"""Seeds are below this (a torch generator's range); the HTTP body's check reads it too."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    A plain frozen dataclass (not pydantic) so the engine loop depends on nothing but torch;
    the HTTP layer maps its request models onto it. `draft_budget` only changes speed: the
    output distribution is the target's whatever the tree.
    """

    max_tokens: int = 128  # generated tokens, the first (prefill) token included
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None  # seeds the request's coin generator; None = nondeterministic
    stop: tuple[str, ...] = ()  # stop strings; the output ends before the first match
    stop_token_ids: tuple[int, ...] = ()  # stop tokens; the output ends before them
    ignore_eos: bool = False  # keep generating past the tokenizer's end-of-text token
    draft_budget: int | None = None  # DDTree nodes per step, at most the engine's; None = its budget

    def __post_init__(self) -> None:
        # Normalise list inputs (JSON, CLI) to tuples so a params object is immutable all the way down.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if self.seed is not None and not 0 <= self.seed < MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.draft_budget is not None and self.draft_budget < 1:
            raise ValueError(f"draft_budget must be >= 1, got {self.draft_budget}")

    @property
    def greedy(self) -> bool:
        """Temperatures below `GREEDY_TEMPERATURE_EPS` decode greedily, like 0 (see `target_probs`)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS
