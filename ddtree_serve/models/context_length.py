"""The longest sequence a target's positions were built for, read as vLLM reads `max_model_len`.

A slot longer than this puts tokens at positions the model never saw (or past the end of a
YaRN-extended window), where its output is no longer the model's; so the engine caps its
default `max_seq_len` here and refuses an explicit longer one, as vLLM does for `max_model_len`.
"""

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddtree_serve.models.families import target_family
from ddtree_serve.models.loading import read_config

# Scalings whose `max_position_embeddings` already states the extended window (vLLM's list).
_FACTOR_ALREADY_APPLIED = frozenset({"su", "longrope", "llama3"})


def context_length(max_position_embeddings: int, rope_scaling: Mapping[str, Any] | None) -> int:
    """`max_position_embeddings`, stretched by a RoPE scaling `factor` where the config states the
    pre-scaling window (YaRN: `original_max_position_embeddings` x factor)."""
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    factor = scaling.get("factor")
    if factor is None or rope_type in _FACTOR_ALREADY_APPLIED:
        return max_position_embeddings
    if rope_type != "yarn":
        return int(max_position_embeddings * float(factor))
    original = scaling.get("original_max_position_embeddings")
    # YaRN without its pre-scaling window: the stated length is all that is known
    return max_position_embeddings if original is None else int(int(original) * float(factor))


def target_context_length(path: str | Path) -> int:
    """The context length of the target model directory at `path` (its family's config parse)."""
    raw = read_config(path)
    config = target_family(raw).parse_config(raw)
    return context_length(config.max_position_embeddings, config.rope_scaling)
