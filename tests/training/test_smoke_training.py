"""The training script end to end, in its tiny CPU configuration."""

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from ddtree_serve.models.dflash import DFlashConfig
from ddtree_serve.models.loading import load_draft_model, load_target_model
from ddtree_serve.models.qwen3 import Qwen3Config
from ddtree_serve.training.__main__ import main


@pytest.mark.slow
def test_smoke_run_writes_a_loadable_pair_and_a_report(tmp_path: Path) -> None:
    out = tmp_path / "pair"
    main(["--smoke", "--out", str(out), "--device", "cpu"])

    report = json.loads((out / "training_report.json").read_text())
    assert math.isfinite(report["target"]["heldout_loss"])
    assert report["target"]["steps"] > 0 and report["drafter"]["steps"] > 0
    assert report["drafter"]["heldout_greedy_tau"] >= 1.0

    target_config = Qwen3Config.from_json_file(out / "target" / "config.json")
    drafter_config = DFlashConfig.from_json_file(out / "drafter" / "config.json")
    assert drafter_config.mask_token_id == report["tokenizer"]["mask_token_id"]
    assert drafter_config.feature_dim == len(drafter_config.target_layer_ids) * target_config.hidden_size
    assert (out / "target" / "tokenizer.json").read_bytes() == (
        out / "drafter" / "tokenizer.json"
    ).read_bytes()
    for model_dir in (out / "target", out / "drafter"):
        with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
            names = list(weights.keys())
            assert {str(weights.get_tensor(name).dtype) for name in names} == {"torch.float16"}
    with safe_open(str(out / "target" / "model.safetensors"), "pt") as weights:
        assert "lm_head.weight" not in list(weights.keys())  # the tied head is not stored

    # a retrain of the drafter alone reuses the target and its tokenizer, and may continue a drafter
    again = tmp_path / "again"
    reuse = ["--target-from", str(out / "target"), "--drafter-from", str(out / "drafter")]
    main(["--smoke", "--out", str(again), "--device", "cpu", *reuse])
    assert json.loads((again / "training_report.json").read_text())["drafter"]["continued_from"]
    assert (again / "target" / "tokenizer.json").read_bytes() == (
        out / "target" / "tokenizer.json"
    ).read_bytes()
    assert load_target_model(again / "target").config.vocab_size == target_config.vocab_size
    assert load_draft_model(again / "drafter").config.block_size == drafter_config.block_size
