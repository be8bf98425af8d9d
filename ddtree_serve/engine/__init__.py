"""In-process speculative decoding: requests, scheduler, the SpecEngine step loop, `LLM`."""

from ddtree_serve.engine.interfaces import (
    ContextHandle,
    ContextSlice,
    Drafter,
    DraftOutput,
    PrefillOutput,
    SamplingBatch,
    Target,
    VerifyOutput,
)
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.settings import SPEC_MODES, EngineSettings, SpecMode

__all__ = [
    "SPEC_MODES",
    "ContextHandle",
    "ContextSlice",
    "DraftOutput",
    "Drafter",
    "EngineSettings",
    "PrefillOutput",
    "SamplingBatch",
    "SamplingParams",
    "SpecMode",
    "Target",
    "VerifyOutput",
]
