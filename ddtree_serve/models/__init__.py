"""Models: target runners for the Qwen3/Llama and DeepseekV3 (Kimi K2) families (slot KV cache, tree
verify, commit) and the DFlash drafter."""

from ddtree_serve.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from ddtree_serve.models.dflash import DFlashConfig, DFlashDraftModel
from ddtree_serve.models.drafter import DFlashDrafter
from ddtree_serve.models.loading import (
    bundled_drafter_dir,
    bundled_target_dir,
    load_draft_model,
    load_target_model,
    save_model_dir,
)
from ddtree_serve.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from ddtree_serve.models.runner import TargetRunner
from ddtree_serve.models.tokenizer import load_tokenizer

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashDrafter",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "TargetRunner",
    "bundled_drafter_dir",
    "bundled_target_dir",
    "load_draft_model",
    "load_target_model",
    "load_tokenizer",
    "save_model_dir",
]
