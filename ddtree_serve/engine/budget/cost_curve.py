"""What a step costs: verify time over (batch size, target tokens), and the drafter's time per batch.

"Target tokens" are the tokens one verify forward processes, padding included (the engine pads
every tree of a batch to the widest, so `batch * widest tree`). The curve is a grid measured at
start-up (`measure.py`) or loaded from a file, interpolated bilinearly between grid points (held
at the edge rows past the batch axis; along tokens held below the first point and extrapolated
linearly, never downward, past the last), then refreshed from live step timings: a
measured step moves its neighbouring grid points toward `measured / predicted` by an EMA weight.

The machine's speed also drifts as a whole from what the grid was measured at (on the CI CPU,
mid-run steps took 1.3-1.45x their start-up calibration, plain and drafted alike), and a policy
mostly takes one kind of step: cells it takes would learn the drift, the cells it turns away
from would keep the start-up price and look cheap, the probes that then follow cost real time.
So every prediction is `drift x grid`: `drift` is an EMA, over every timed verify, of measured
over the start-up (or file) grid's prediction, and the grid points learn each cell's own
remainder (measured over `drift x grid`). Cells never timed follow the machine; the drafter's
cost too (every step verifies, not every step drafts: its grid learns only its own way from
the target's drift, so the two never pull one number back and forth).

File format (JSON; `load_cost_curve`), tolerant of what other benchmarks write:

    {"batch": [1, 8], "tokens": [8, 64, 512], "ms": [[...3 values...], [...]]}   # ms[batch][tokens]
    {"tokens": [1, 8, 16, 64, 128], "ms": [0.47, 2.0, 3.5, 8.2, 9.9]}           # total tokens only
    {"entries": [{"batch": 1, "tokens": 8, "ms": 2.0}, ...]}  or a bare list of such entries

Entries may give `tree_tokens` (per request; target tokens = batch x tree_tokens) and
`ms_per_layer` with a top-level `scale` (layers), as `bench/kimi_slice.py` writes them.
Aliases: "batch_size"/"batch_sizes" for "batch"; "num_tokens"/"n"/"N" for "tokens";
"step_ms"/"time_ms"/"latency_ms" for "ms". Optional: "draft_ms" (a number, a list aligned with
"batch", or {"batch": ms}), the drafter's cost per call, default 0; "scale" (a number) multiplies
every verify time, e.g. the layer count when the file holds one layer's cost. Other keys
(device, notes) are ignored. Entries missing from a grid are interpolated within their batch row.
"""

import bisect
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

_BATCH_KEYS = ("batch", "batch_size", "batch_sizes")
_TOKEN_KEYS = ("tokens", "num_tokens", "n", "N")
_MS_KEYS = ("ms", "step_ms", "time_ms", "latency_ms", "ms_per_layer")

MAX_STEP_RATIO = 4.0
"""The most one live timing may count as, against its prediction, when the curve learns it."""

MAX_DRIFT_MOVE = 1.5
"""The most one live timing may count as, against the drift, when the drift learns it."""


class CostCurve:
    """Predicted verify and draft milliseconds; refreshed in place by live timings."""

    def __init__(
        self,
        batch_sizes: Sequence[float],
        token_counts: Sequence[float],
        verify_ms: Sequence[Sequence[float]],
        draft_ms: Sequence[float] | None = None,
        ema_weight: float = 0.1,
    ) -> None:
        self.batch_sizes = np.asarray(batch_sizes, dtype=np.float64)  # [nb] ascending
        self.token_counts = np.asarray(token_counts, dtype=np.float64)  # [nt] ascending
        self.grid_ms = np.array(verify_ms, dtype=np.float64).reshape(len(self.batch_sizes), -1)  # [nb, nt]
        no_draft = np.zeros(len(self.batch_sizes))
        self.draft_grid_ms = no_draft if draft_ms is None else np.array(draft_ms, dtype=np.float64)  # [nb]
        shapes_match = self.draft_grid_ms.shape == self.batch_sizes.shape
        if self.grid_ms.shape[1] != len(self.token_counts) or not shapes_match:
            raise ValueError("cost grid shapes do not match its batch sizes and token counts")
        for axis in (self.batch_sizes, self.token_counts):
            if len(axis) == 0 or np.any(np.diff(axis) <= 0):
                raise ValueError("cost grid axes must be non-empty and strictly ascending")
        if np.any(self.grid_ms <= 0) or np.any(self.draft_grid_ms < 0):
            raise ValueError("verify times must be > 0 ms and draft times >= 0 ms")
        self.ema_weight = ema_weight  # 0 freezes the curve (grid points and drift)
        # The axes as tuples of floats, for the scalar lookups the policy makes every step.
        self._batch_axis = tuple(self.batch_sizes.tolist())
        self._token_axis = tuple(self.token_counts.tolist())
        # The verify grid as measured (or loaded), which `drift` is measured against.
        self._start_grid_ms = self.grid_ms.copy()
        self.drift = 1.0  # live timings over the start grid's prediction (EMA)

    def verify_ms(self, batch_size: int, target_tokens: np.ndarray | float) -> np.ndarray:
        """Predicted verify milliseconds of `batch_size` requests over `target_tokens` tokens.

        The policy asks this several times a step, so it interpolates one blended row (exact:
        the blend is linear, and each row's extrapolation slope is clamped before blending)."""
        if isinstance(target_tokens, int | float | np.integer | np.floating):
            return np.float64(self.drift * self._grid_at(self.grid_ms, batch_size, float(target_tokens)))
        (b0, b1), (wb0, wb1) = _bracket(self._batch_axis, batch_size)
        grid = self.grid_ms
        row = grid[b0] if wb1 == 0.0 else wb0 * grid[b0] + wb1 * grid[b1]
        tokens = np.asarray(target_tokens, dtype=np.float64)
        inner = np.interp(tokens, self.token_counts, row)
        last = self._token_axis[-1]
        if len(self._token_axis) == 1 or not np.any(tokens > last):
            return self.drift * inner
        slope = wb0 * _last_slope(self.token_counts, grid[b0])
        if wb1 != 0.0:
            slope += wb1 * _last_slope(self.token_counts, grid[b1])
        return self.drift * np.where(tokens > last, row[-1] + slope * (tokens - last), inner)

    def _grid_at(self, grid: np.ndarray, batch_size: float, tokens: float) -> float:
        """`grid` (the live one or the start one) at one point, as `verify_ms` reads it."""
        (b0, b1), (wb0, wb1) = _bracket(self._batch_axis, batch_size)
        value = wb0 * self._row_ms(grid[b0], tokens)
        if wb1 != 0.0:
            value += wb1 * self._row_ms(grid[b1], tokens)
        return value

    def _row_ms(self, ms: np.ndarray, tokens: float) -> float:
        """One batch row of a grid at `tokens`, as `verify_ms` reads it (held below the first
        point, extrapolated past the last)."""
        axis = self._token_axis
        if tokens > axis[-1] and len(axis) > 1:
            return float(ms[-1]) + _last_slope(self.token_counts, ms) * (tokens - axis[-1])
        (lo, hi), (w_lo, w_hi) = _bracket(axis, tokens)
        return w_lo * float(ms[lo]) + (w_hi * float(ms[hi]) if w_hi != 0.0 else 0.0)

    def draft_ms(self, batch_size: int) -> float:
        """Predicted milliseconds of one drafter call for `batch_size` requests (interpolated
        along the batch axis, held below its first point, extrapolated past its last)."""
        return self.drift * self._draft_at(self.draft_grid_ms, batch_size)

    def _draft_at(self, ms: np.ndarray, batch_size: float) -> float:
        axis = self._batch_axis
        if batch_size <= axis[0] or len(axis) == 1:
            return float(ms[0])
        if batch_size >= axis[-1]:
            return float(ms[-1]) + _last_slope(self.batch_sizes, ms) * (batch_size - axis[-1])
        (lo, hi), (w_lo, w_hi) = _bracket(axis, batch_size)
        return w_lo * float(ms[lo]) + w_hi * float(ms[hi])

    def observe_verify(self, batch_size: int, target_tokens: int, measured_ms: float) -> None:
        """Move the grid points around (batch, tokens) toward the measured/predicted ratio; the
        ratio counts as at most `MAX_STEP_RATIO` (or its inverse), so one timing moves a point
        by at most `1 + ema_weight * (MAX_STEP_RATIO - 1)` (a CUDA graph captured mid-run, a
        process descheduled: an outlier must not price a width out for the rest of the run)."""
        self._observe_drift(measured_ms / self._grid_at(self._start_grid_ms, batch_size, target_tokens))
        ratio = measured_ms / float(self.verify_ms(batch_size, target_tokens))
        ratio = min(max(ratio, 1.0 / MAX_STEP_RATIO), MAX_STEP_RATIO)
        (b0, b1), (wb0, wb1) = _bracket(self._batch_axis, batch_size)
        (t0, t1), (wt0, wt1) = _bracket(self._token_axis, target_tokens)
        for b, wb in ((b0, wb0), (b1, wb1)):
            for t, wt in ((t0, wt0), (t1, wt1)):
                self.grid_ms[b, t] *= 1.0 + self.ema_weight * wb * wt * (ratio - 1.0)

    def observe_draft(self, batch_size: int, measured_ms: float) -> None:
        """Move the drafter's cost at this batch toward the measurement, bounded like a verify."""
        predicted = self.draft_ms(batch_size)
        if predicted > 0:
            measured_ms = min(max(measured_ms, predicted / MAX_STEP_RATIO), predicted * MAX_STEP_RATIO)
        (b0, b1), (wb0, wb1) = _bracket(self._batch_axis, batch_size)
        local_ms = measured_ms / self.drift  # the drafter's own way from the target's drift
        for b, wb in ((b0, wb0), (b1, wb1)):
            self.draft_grid_ms[b] += self.ema_weight * wb * (local_ms - self.draft_grid_ms[b])

    def _observe_drift(self, ratio: float) -> None:
        """One timing over the start grid's prediction: it counts as at most `MAX_DRIFT_MOVE`
        times the drift (or its inverse), so an outlier moves every cell by a few percent."""
        ratio = min(max(ratio, self.drift / MAX_DRIFT_MOVE), self.drift * MAX_DRIFT_MOVE)
        self.drift += self.ema_weight * (ratio - self.drift)

    def to_json(self) -> dict[str, Any]:
        """The grid form `load_cost_curve` reads back."""
        return {
            "batch": self.batch_sizes.tolist(),
            "tokens": self.token_counts.tolist(),
            "ms": (self.drift * self.grid_ms).tolist(),
            "draft_ms": (self.drift * self.draft_grid_ms).tolist(),
        }


def load_cost_curve(source: str | Path | Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> CostCurve:
    """A `CostCurve` from a JSON file path or its parsed content (formats in the module docstring)."""
    data = json.loads(Path(source).read_text()) if isinstance(source, str | Path) else source
    spec: Mapping[str, Any] = {"entries": data} if isinstance(data, Sequence) else data
    if not isinstance(spec, Mapping) or not all(isinstance(e, Mapping) for e in spec.get("entries", ())):
        raise ValueError("a cost curve is a JSON object, or a list of entries that are objects")
    if "entries" in spec:
        batch_sizes, token_counts, grid = _grid_from_entries(spec["entries"])
    else:
        token_counts = [float(t) for t in _field(spec, _TOKEN_KEYS)]
        ms = np.asarray(_field(spec, _MS_KEYS), dtype=np.float64)
        batch_field = next((spec[k] for k in _BATCH_KEYS if k in spec), None)
        batch_sizes = [1.0] if batch_field is None else [float(b) for b in batch_field]
        grid = ms.reshape(len(batch_sizes), len(token_counts))
    grid = grid * float(spec.get("scale", 1.0))
    return CostCurve(batch_sizes, token_counts, grid, _draft_ms(spec.get("draft_ms", 0.0), batch_sizes))


def _grid_from_entries(entries: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[float], np.ndarray]:
    points = [
        (float(_field(e, _BATCH_KEYS, default=1)), _entry_tokens(e), float(_field(e, _MS_KEYS)))
        for e in entries
    ]
    if not points:
        raise ValueError("a cost curve needs at least one entry")
    batch_sizes = sorted({b for b, _, _ in points})
    token_counts = sorted({t for _, t, _ in points})
    grid = np.empty((len(batch_sizes), len(token_counts)))
    for row, batch in enumerate(batch_sizes):
        row_points = sorted((t, ms) for b, t, ms in points if b == batch)
        xs, ys = (np.array(v, dtype=np.float64) for v in zip(*row_points, strict=True))
        grid[row] = _interp_extrapolate(np.array(token_counts), xs, ys)
    return batch_sizes, token_counts, grid


def _entry_tokens(entry: Mapping[str, Any]) -> float:
    """Target tokens of one entry: `tokens` as given, or `tree_tokens` per request (the Kimi slice
    benchmark's entries) times the batch."""
    if "tree_tokens" in entry:
        return float(entry["tree_tokens"]) * float(_field(entry, _BATCH_KEYS, default=1))
    return float(_field(entry, _TOKEN_KEYS))


def _draft_ms(value: Any, batch_sizes: list[float]) -> list[float]:
    if isinstance(value, Mapping):
        xs = np.array(sorted(float(k) for k in value), dtype=np.float64)
        ys = np.array([float(value[k]) for k in sorted(value, key=float)], dtype=np.float64)
        return _interp_extrapolate(np.array(batch_sizes), xs, ys).tolist()
    if isinstance(value, Sequence):
        return [float(v) for v in value]
    return [float(value)] * len(batch_sizes)


def _field(spec: Mapping[str, Any], keys: tuple[str, ...], default: Any = None) -> Any:
    for key in keys:
        if key in spec:
            return spec[key]
    if default is None:
        raise ValueError(f"cost curve entry has none of the keys {keys}")
    return default


def _bracket(axis: tuple[float, ...], x: float) -> tuple[tuple[int, int], tuple[float, float]]:
    """The two grid indices around x and their linear weights; clamped at the ends."""
    if x <= axis[0] or len(axis) == 1:
        return (0, 0), (1.0, 0.0)
    if x >= axis[-1]:
        last = len(axis) - 1
        return (last, last), (1.0, 0.0)
    hi = bisect.bisect_left(axis, x)
    lo = hi - 1
    w_hi = (x - axis[lo]) / (axis[hi] - axis[lo])
    return (lo, hi), (1.0 - w_hi, w_hi)


def _last_slope(xs: np.ndarray, ys: np.ndarray) -> float:
    """The last segment's slope, floored at 0: how a curve continues past its last point."""
    return max(float(ys[-1] - ys[-2]) / float(xs[-1] - xs[-2]), 0.0)


def _interp_extrapolate(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Linear interpolation; held at the first value below the range (a smaller shape is not
    assumed cheaper than the smallest measured) and continued with the last segment's slope,
    floored at 0, above it (a larger shape is never assumed cheaper)."""
    inner = np.interp(x, xs, ys)
    if len(xs) == 1:
        return inner
    return np.where(x > xs[-1], ys[-1] + _last_slope(xs, ys) * (x - xs[-1]), inner)
