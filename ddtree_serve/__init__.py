"""ddtree-serve: speculative decoding with DDTree draft trees over a DFlash drafter, served on Ray Serve.

The public surface is small: `LLM` (offline generation) and `SamplingParams`; the server lives in
`ddtree_serve.serve`. Both names load lazily so that `import ddtree_serve` stays cheap.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from ddtree_serve.engine import LLM, SamplingParams


def __getattr__(name: str) -> Any:
    if name in ("LLM", "SamplingParams"):
        from ddtree_serve import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'ddtree_serve' has no attribute {name!r}")
