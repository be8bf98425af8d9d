"""What one execution of the compiled step graph carries to each worker, and back.

`compiled_graph.py` drives the graph; the workers (`workers.py`) run these calls. One execution
carries at most one drafter call with inputs and one target call (the overlapped step pairs a
draft of one micro-batch with the verify of the other), each after the slots released since the
previous execution: releases travel with the next call instead of as calls of their own, and stay in
order with the graph's calls (Ray orders a caller's actor calls, not a graph's channels).
The target's context features reach the drafter inside the graph as a `ContextDelivery`; the
engine only ever holds a `GraphContext` marker. An execution may also carry a chained draft: a
`DrafterCall` that the drafter runs right after taking a verify's delivery, with the verdict's
bonus tokens as its roots (the serial step's next draft, in the same round trip).
"""

from dataclasses import dataclass
from typing import Any, Literal

TargetMethod = Literal["prefill", "verify_and_commit", "encode_context"]


@dataclass(frozen=True)
class TargetCall:
    """A target seam call in one graph execution, numbered so a broken execution can be replayed."""

    call_id: int
    releases: tuple[int, ...]  # slots to release first
    method: TargetMethod | None  # None: only the releases
    inputs: Any  # the wired seam input of `method`


@dataclass(frozen=True)
class DrafterCall:
    releases: tuple[int, ...]  # slots to release first (their undrafted context goes too)
    # a wired `DraftInput` without its contexts (the drafter holds them, delivered), or None:
    # releases only
    inputs: Any
    context_counts: tuple[int, ...] = ()  # per slot: the delivered slices this draft takes
    chained: bool = False  # runs after the execution's verify, from its bonus tokens


@dataclass(frozen=True)
class ContextDelivery:
    """Features of one target call for the drafter: entry i belongs to slot `slots[i]`."""

    slots: tuple[int, ...]
    features: Any  # wired `PackedFeatures`: entry i is [n_i, F]
    # a verify's bonus token per slot (the next root): what a chained draft drafts after
    bonus_tokens: tuple[int, ...] | None = None


@dataclass(frozen=True)
class GraphContext:
    """The engine's `ContextHandle` over the graph: the features already went to the drafter.

    The drafter keeps each slot's delivered features in order and drafts from them; a
    `ContextSlice` pointing here only counts as one delivered entry (checked there)."""

    call_id: int
