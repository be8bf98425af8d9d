"""What to train: sizes of the bundled pair and the training hyper-parameters, as presets.

`full` is the bundled pair (trained on one H200 in a few minutes); `smoke` is a tiny CPU
configuration for the tests. The model sizes become HF-style `config.json` dicts here, so the
training code builds its modules from exactly the configs the runtime loader reads.
"""

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class TargetShape:
    """Qwen3 decoder sizes of the target."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class DrafterShape:
    """DFlash drafter sizes; `target_layer_ids` index target layers (HF hidden-state index - 1)."""

    num_layers: int
    intermediate_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class StageSchedule:
    """Optimiser and stopping rule of one training stage (stops at max_steps or time_budget_s)."""

    batch_size: int
    seq_len: int
    max_steps: int
    time_budget_s: float
    lr: float
    warmup_steps: int
    weight_decay: float = 0.1
    eval_every_s: float = 30.0


@dataclass(frozen=True)
class DrafterTraining:
    """DFlash-specific choices: anchors per sequence, loss decay, self-distillation data."""

    schedule: StageSchedule
    anchors_per_seq: int
    loss_decay_gamma: float
    # Fraction of each batch made of the target's own continuations (greedy and sampled);
    # the rest is corpus text. The drafter is scored on the target's outputs, so it learns them.
    generated_fraction: float
    num_generated_seqs: int
    generation_prompt_len: int


@dataclass(frozen=True)
class PairRecipe:
    """Everything the training script needs besides paths, device and seed."""

    vocab_size: int
    target: TargetShape
    drafter: DrafterShape
    target_training: StageSchedule
    drafter_training: DrafterTraining
    max_corpus_files: int | None = None
    rms_norm_eps: float = 1e-6

    def with_overrides(
        self,
        target_budget_s: float | None = None,
        drafter_budget_s: float | None = None,
        drafter_lr: float | None = None,
        generated_seqs: int | None = None,
    ) -> "PairRecipe":
        """The same recipe with the given fields replaced (None keeps the preset's value)."""
        target_training = self.target_training
        if target_budget_s is not None:
            target_training = replace(target_training, time_budget_s=target_budget_s)
        schedule = self.drafter_training.schedule
        if drafter_budget_s is not None:
            schedule = replace(schedule, time_budget_s=drafter_budget_s)
        if drafter_lr is not None:
            schedule = replace(schedule, lr=drafter_lr)
        drafter_training = replace(self.drafter_training, schedule=schedule)
        if generated_seqs is not None:
            drafter_training = replace(drafter_training, num_generated_seqs=generated_seqs)
        return replace(self, target_training=target_training, drafter_training=drafter_training)


FULL = PairRecipe(
    vocab_size=8192,
    target=TargetShape(
        hidden_size=256,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=768,
        max_position_embeddings=2048,
    ),
    drafter=DrafterShape(num_layers=3, intermediate_size=768, block_size=16, target_layer_ids=(1, 3, 5)),
    target_training=StageSchedule(
        batch_size=128, seq_len=1024, max_steps=100_000, time_budget_s=180.0, lr=3e-3, warmup_steps=100
    ),
    drafter_training=DrafterTraining(
        schedule=StageSchedule(
            batch_size=64, seq_len=512, max_steps=100_000, time_budget_s=180.0, lr=2e-3, warmup_steps=100
        ),
        anchors_per_seq=64,
        loss_decay_gamma=7.0,
        generated_fraction=0.5,
        num_generated_seqs=4096,
        generation_prompt_len=64,
    ),
)

SMOKE = PairRecipe(
    vocab_size=512,
    target=TargetShape(
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        intermediate_size=128,
        max_position_embeddings=256,
    ),
    drafter=DrafterShape(num_layers=1, intermediate_size=128, block_size=8, target_layer_ids=(0, 1)),
    target_training=StageSchedule(
        batch_size=8, seq_len=64, max_steps=20, time_budget_s=8.0, lr=3e-3, warmup_steps=5, eval_every_s=60.0
    ),
    drafter_training=DrafterTraining(
        schedule=StageSchedule(
            batch_size=8,
            seq_len=64,
            max_steps=20,
            time_budget_s=8.0,
            lr=3e-3,
            warmup_steps=5,
            eval_every_s=60.0,
        ),
        anchors_per_seq=4,
        loss_decay_gamma=4.0,
        generated_fraction=0.5,
        num_generated_seqs=8,
        generation_prompt_len=16,
    ),
    max_corpus_files=6,
)

PRESETS: dict[str, PairRecipe] = {"full": FULL, "smoke": SMOKE}


def target_hf_config(recipe: PairRecipe, eos_token_id: int, torch_dtype: str) -> dict[str, Any]:
    """The target's `config.json` (HF Qwen3 layout)."""
    shape = recipe.target
    return {
        "architectures": ["Qwen3ForCausalLM"],
        **_qwen3_fields(recipe, shape.num_layers, shape.intermediate_size, eos_token_id, torch_dtype),
        "tie_word_embeddings": True,
        "max_window_layers": shape.num_layers,
        "use_cache": True,
    }


def drafter_hf_config(
    recipe: PairRecipe, eos_token_id: int, mask_token_id: int, torch_dtype: str
) -> dict[str, Any]:
    """The drafter's `config.json`, laid out like z-lab's DFlash checkpoints."""
    drafter = recipe.drafter
    return {
        "architectures": ["DFlashDraftModel"],
        "block_size": drafter.block_size,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(drafter.target_layer_ids),
        },
        "num_target_layers": recipe.target.num_layers,
        **_qwen3_fields(recipe, drafter.num_layers, drafter.intermediate_size, eos_token_id, torch_dtype),
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * drafter.num_layers,
    }


def _qwen3_fields(
    recipe: PairRecipe, num_layers: int, intermediate_size: int, eos_token_id: int, torch_dtype: str
) -> dict[str, Any]:
    """The Qwen3 decoder fields both models share: the drafter's layers have the target's shape."""
    shape = recipe.target
    return {
        "model_type": "qwen3",
        "vocab_size": recipe.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": recipe.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "initializer_range": 0.02,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": torch_dtype,
    }
