"""The bundled pair in the repository: sizes, shared tokenizer, and the drafter's contract."""

import json

import pytest

from ddtree_serve.models import bundled_drafter_dir, bundled_target_dir, load_tokenizer
from ddtree_serve.models.dflash import DFlashConfig
from ddtree_serve.models.qwen3 import Qwen3Config
from ddtree_serve.training.tokenizer import special_token_ids

pytestmark = pytest.mark.skipif(
    not (bundled_drafter_dir() / "model.safetensors").exists(), reason="bundled pair not trained yet"
)


def test_bundled_pair_is_small_and_shares_one_tokenizer() -> None:
    target_dir, drafter_dir = bundled_target_dir(), bundled_drafter_dir()
    weights_bytes = sum((d / "model.safetensors").stat().st_size for d in (target_dir, drafter_dir))
    assert weights_bytes <= 30 * 1024 * 1024
    assert (target_dir / "tokenizer.json").read_bytes() == (drafter_dir / "tokenizer.json").read_bytes()
    tokenizer = load_tokenizer(target_dir)
    eos_id, mask_id = special_token_ids(tokenizer)
    target = Qwen3Config.from_json_file(target_dir / "config.json")
    drafter = DFlashConfig.from_json_file(drafter_dir / "config.json")
    assert drafter.mask_token_id == mask_id and target.eos_token_ids == (eos_id,)
    assert target.vocab_size == drafter.decoder.vocab_size == tokenizer.get_vocab_size()
    assert target.model_type == "qwen3" and target.max_position_embeddings >= 1024
    assert drafter.block_size == 16 and 1 <= drafter.decoder.num_hidden_layers <= 3
    assert max(drafter.target_layer_ids) < target.num_hidden_layers


def test_bundled_report_records_a_finite_heldout_loss() -> None:
    report = json.loads((bundled_target_dir().parent / "training_report.json").read_text())
    assert 0 < report["target"]["heldout_loss"] < 4.0
    assert report["tokenizer"]["vocab_size"] == 8192
