"""In-process speculative decoding: requests, scheduler, the SpecEngine step loop, `LLM`.

Public surface: `LLM` (offline batches), `AsyncLLM` (asyncio streaming over a background
engine thread), `SamplingParams`, and the `Drafter` / `Target` seam that the Ray workers
implement.
"""

from ddtree_serve.engine.async_llm import AsyncLLM, EngineDeadError
from ddtree_serve.engine.interfaces import (
    ContextHandle,
    ContextSlice,
    Drafter,
    DraftInput,
    DraftOutput,
    PrefillInput,
    PrefillOutput,
    SamplingBatch,
    Target,
    VerifyInput,
    VerifyOutput,
)
from ddtree_serve.engine.llm import LLM
from ddtree_serve.engine.outputs import CompletionOutput, Detokenizer
from ddtree_serve.engine.request import RequestOutput, RequestStats
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.scheduler import QueueFullError
from ddtree_serve.engine.settings import SPEC_MODES, EngineSettings, SpecMode
from ddtree_serve.engine.spec_engine import SpecEngine

__all__ = [
    "LLM",
    "SPEC_MODES",
    "AsyncLLM",
    "CompletionOutput",
    "ContextHandle",
    "ContextSlice",
    "Detokenizer",
    "DraftInput",
    "DraftOutput",
    "Drafter",
    "EngineDeadError",
    "EngineSettings",
    "PrefillInput",
    "PrefillOutput",
    "QueueFullError",
    "RequestOutput",
    "RequestStats",
    "SamplingBatch",
    "SamplingParams",
    "SpecEngine",
    "SpecMode",
    "Target",
    "VerifyInput",
    "VerifyOutput",
]
