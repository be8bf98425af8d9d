"""The three stages in order: tokenizer -> target -> drafter, each writing its HF-style directory.

Output layout (`out_dir`): `target/` and `drafter/` model directories (config.json,
model.safetensors, tokenizer.json, ...) and `training_report.json` with the figures of each
stage. The modules are built from the very config dicts that are written, through the
runtime's own config parsers, so what was trained is what loads.
"""

import json
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from ddtree_serve.models.dflash import DFlashConfig, DFlashDraftModel
from ddtree_serve.models.loading import load_draft_model, load_target_model
from ddtree_serve.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from ddtree_serve.training.corpus import load_corpus, stdlib_root
from ddtree_serve.training.data import encode_stream
from ddtree_serve.training.drafter import train_drafter
from ddtree_serve.training.export import STORAGE_DTYPE_NAME, save_generation_config, save_half_precision
from ddtree_serve.training.loop import init_weights
from ddtree_serve.training.recipe import PairRecipe, drafter_hf_config, target_hf_config
from ddtree_serve.training.target import heldout_lm_loss, train_target
from ddtree_serve.training.tokenizer import save_tokenizer, special_token_ids, train_tokenizer

STAGES = ("tokenizer", "target", "drafter")
NUM_DRAFTER_EVAL_ROWS = 64


def train_pair(
    recipe: PairRecipe,
    out_dir: Path,
    device: torch.device,
    seed: int,
    tokenizer_path: Path | None = None,
    target_from: Path | None = None,
    drafter_from: Path | None = None,
    command: str = "",
) -> dict[str, Any]:
    """Run the stages and write the pair into `out_dir`; returns (and writes) the report."""
    started = time.perf_counter()
    torch.manual_seed(seed)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    target_dir, drafter_dir = out_dir / "target", out_dir / "drafter"
    report: dict[str, Any] = {
        "recipe": asdict(recipe),
        "seed": seed,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "corpus_root": str(stdlib_root()),
        "command": command,
    }

    # stage 1: tokenizer
    train_docs, heldout_docs = load_corpus(max_files=recipe.max_corpus_files)
    stage_started = time.perf_counter()
    if tokenizer_path is not None:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    else:
        tokenizer = train_tokenizer((doc.text for doc in train_docs), recipe.vocab_size)
    if tokenizer.get_vocab_size() != recipe.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.get_vocab_size()} entries, recipe wants {recipe.vocab_size}"
        )
    eos_id, mask_id = special_token_ids(tokenizer)
    for model_dir in (target_dir, drafter_dir):
        save_tokenizer(tokenizer, model_dir, recipe.target.max_position_embeddings)
    train_stream = encode_stream(tokenizer, train_docs, eos_id).to(device)
    heldout_stream = encode_stream(tokenizer, heldout_docs, eos_id).to(device)
    report["tokenizer"] = {
        "vocab_size": tokenizer.get_vocab_size(),
        "eos_token_id": eos_id,
        "mask_token_id": mask_id,
        "reused_from": None if tokenizer_path is None else str(tokenizer_path),
        "train_files": len(train_docs),
        "heldout_files": len(heldout_docs),
        "heldout_paths": [doc.rel_path for doc in heldout_docs],
        "train_tokens": train_stream.numel(),
        "heldout_tokens": heldout_stream.numel(),
        "seconds": time.perf_counter() - stage_started,
    }
    print(
        f"tokenizer: {report['tokenizer']['train_tokens']} train / {heldout_stream.numel()} held-out tokens"
    )

    # stage 2: target
    target_config = target_hf_config(recipe, eos_id, STORAGE_DTYPE_NAME)
    schedule = recipe.target_training
    if target_from is not None:
        target = load_target_model(target_from, dtype=torch.float32, device=device)
        heldout = heldout_lm_loss(target, heldout_stream, schedule.seq_len, schedule.batch_size)
        report["target"] = {"reused_from": str(target_from), "heldout_loss": heldout}
    else:
        target = Qwen3ForCausalLM(Qwen3Config.from_dict(target_config))
        init_weights(target, recipe.target.num_layers)
        target.to(device)
        result = train_target(target, train_stream, heldout_stream, schedule, generator)
        report["target"] = {**asdict(result), "tokens_per_s": result.tokens_per_s}
    report["target"]["num_params"] = sum(p.numel() for p in target.parameters())
    report["target"]["weights_bytes"] = save_half_precision(target, target_config, target_dir)
    save_generation_config(target_dir, eos_id)
    print(f"target: held-out loss {report['target']['heldout_loss']:.4f}")

    # stage 3: drafter
    drafter_config = drafter_hf_config(recipe, eos_id, mask_id, STORAGE_DTYPE_NAME)
    if drafter_from is not None:
        draft_model = load_draft_model(drafter_from, dtype=torch.float32, device=device).requires_grad_(True)
        if draft_model.config != DFlashConfig.from_dict(drafter_config):
            raise ValueError(f"drafter in {drafter_from} does not match the recipe's drafter config")
    else:
        draft_model = DFlashDraftModel(DFlashConfig.from_dict(drafter_config))
        init_weights(draft_model, recipe.drafter.num_layers)
        draft_model.to(device)
    num_eval_rows = min(NUM_DRAFTER_EVAL_ROWS, recipe.drafter_training.schedule.batch_size * 4)
    drafter_result = train_drafter(
        draft_model, target, train_stream, heldout_stream, recipe.drafter_training, num_eval_rows, generator
    )
    report["drafter"] = {
        "continued_from": None if drafter_from is None else str(drafter_from),
        **asdict(drafter_result.stage),
        "tokens_per_s": drafter_result.stage.tokens_per_s,
        "heldout_greedy_tau": drafter_result.heldout_greedy_tau,
        "generation_s": drafter_result.generation_s,
        "generated_rows": drafter_result.generated_rows,
        "num_params": sum(p.numel() for p in draft_model.parameters()),
    }
    report["drafter"]["weights_bytes"] = save_half_precision(draft_model, drafter_config, drafter_dir)
    print(
        f"drafter: held-out loss {drafter_result.stage.heldout_loss:.4f}, "
        f"greedy tau {drafter_result.heldout_greedy_tau:.3f}"
    )

    report["total_seconds"] = time.perf_counter() - started
    (out_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
