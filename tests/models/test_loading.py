"""Directory loading: tokenizer, eos ids, bundled paths, save/load round trip in half precision."""

import json
from pathlib import Path

import torch

from ddtree_serve.models import bundled_drafter_dir, bundled_target_dir, load_target_model, load_tokenizer
from ddtree_serve.models.loading import read_eos_token_ids, save_model_dir


def test_tokenizer_and_eos_load_from_the_directory(tiny_model_dirs) -> None:
    tokenizer = load_tokenizer(tiny_model_dirs.target)
    ids = tokenizer.encode("def add(a, b):").ids
    assert tokenizer.decode(ids) == "def add(a, b):"
    assert tokenizer.token_to_id("<|MASK|>") == tiny_model_dirs.mask_token_id
    assert read_eos_token_ids(tiny_model_dirs.target) == (tiny_model_dirs.eos_token_id,)


def test_half_precision_round_trip_keeps_tied_head(tiny_target_dir: Path, tmp_path: Path) -> None:
    model = load_target_model(tiny_target_dir)
    config = (tiny_target_dir / "config.json").read_text()

    save_model_dir(model, json.loads(config), tmp_path, dtype=torch.bfloat16)
    reloaded = load_target_model(tmp_path, dtype=torch.bfloat16)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert reloaded.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(reloaded.model.norm.weight, model.model.norm.weight.to(torch.bfloat16))


def test_bundled_dirs_live_in_the_package() -> None:
    assert bundled_target_dir().parent == bundled_drafter_dir().parent
    assert bundled_target_dir().parent.name == "bundled"
    assert (bundled_target_dir().name, bundled_drafter_dir().name) == ("target", "drafter")
