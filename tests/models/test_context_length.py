"""The target's context length, as vLLM derives `max_model_len` from a config."""

import json
from pathlib import Path

import pytest

from ddtree_serve.models.context_length import context_length, target_context_length
from tests.models.kimi_dirs import KIMI_QUANTIZATION_CONFIG, KIMI_TEXT_CONFIG, KIMI_VISION_CONFIG


@pytest.mark.parametrize(
    ("max_position_embeddings", "rope_scaling", "expected"),
    [
        (1024, None, 1024),
        (1024, {}, 1024),
        # Kimi K2 / DeepSeek-V3: YaRN from a 4,096-position window, factor 64 / 40
        (262144, {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096}, 262144),
        (163840, {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}, 163840),
        # Qwen3's long-context recipe: YaRN x4 over 32,768, with the config's 40,960 left as shipped
        (40960, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
        (2048, {"rope_type": "linear", "factor": 2.0}, 4096),
        # YaRN that does not say its pre-scaling window: only the stated length is known
        (8192, {"rope_type": "yarn", "factor": 4.0}, 8192),
        # Llama 3's scaling states the extended window itself
        (131072, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 131072),
    ],
)
def test_context_length_follows_the_scaling(
    max_position_embeddings: int, rope_scaling: dict | None, expected: int
) -> None:
    assert context_length(max_position_embeddings, rope_scaling) == expected


def test_target_context_length_reads_the_directory(tiny_target_dir: Path, tmp_path: Path) -> None:
    stated = json.loads((tiny_target_dir / "config.json").read_text())["max_position_embeddings"]
    assert target_context_length(tiny_target_dir) == stated
    # a Kimi K2.x wrapper: the decoder's window sits under text_config (YaRN x4 from 48 here)
    scaling = {**KIMI_TEXT_CONFIG["rope_scaling"], "original_max_position_embeddings": 48}
    text = {**KIMI_TEXT_CONFIG, "model_type": "kimi_k2", "quantization_config": KIMI_QUANTIZATION_CONFIG}
    text["rope_scaling"] = scaling
    wrapper = {"model_type": "kimi_k25", "text_config": text, "vision_config": KIMI_VISION_CONFIG}
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    (kimi / "config.json").write_text(json.dumps(wrapper))
    assert target_context_length(kimi) == 48 * 4
