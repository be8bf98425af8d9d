"""What a step costs besides its priced parts: the engine's own host work, learned live.

The policy prices a step as the drafter's call, the host build and the verify forward. The rest
of the step is the engine's bookkeeping (the choice itself, appending tokens, stop checks, the
outputs, its own records), and it is not small next to a fast target: on the H200 a plain
decode step of the bundled pair at batch 16 took 3.5 ms where its verify call took 1.9 ms,
so a policy blind to it priced plain steps at half their cost. Drafted and plain steps differ
in that work (a drafted step appends and checks more tokens and observes its trees), so each
kind has its own figure: an EMA of the step's wall time less its priced parts.
"""

from dataclasses import dataclass

MAX_SAMPLE_RATIO = 4.0
MAX_SAMPLE_FLOOR_MS = 1.0


@dataclass
class StepOverhead:
    """Unpriced milliseconds of a plain and of a drafted step, as the engine measured them."""

    plain_ms: float = 0.0
    drafted_ms: float = 0.0
    ema_weight: float = 0.2

    def __post_init__(self) -> None:
        if min(self.plain_ms, self.drafted_ms) < 0 or not 0.0 <= self.ema_weight <= 1.0:
            raise ValueError("step overheads must be >= 0 ms and ema_weight in [0, 1]")

    def ms(self, drafted: bool) -> float:
        """The figure for a drafted (True) or a plain step."""
        return self.drafted_ms if drafted else self.plain_ms

    def observe(self, drafted: bool, unpriced_ms: float) -> None:
        """One step's wall time less its priced parts. One sample counts as at most
        `MAX_SAMPLE_RATIO` times the figure plus `MAX_SAMPLE_FLOOR_MS` (from 0 it still learns,
        and an outlier, a CUDA graph captured or the process descheduled, moves it a little)."""
        current = self.ms(drafted)
        sample = min(max(unpriced_ms, 0.0), MAX_SAMPLE_RATIO * current + MAX_SAMPLE_FLOOR_MS)
        updated = current + self.ema_weight * (sample - current)
        if drafted:
            self.drafted_ms = updated
        else:
            self.plain_ms = updated
