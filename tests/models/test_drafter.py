"""DFlashDrafter: z-lab checkpoint layout, [B, L, V] drafts, a cache that matches the stateless forward."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ddtree_serve.models.dflash import DFlashConfig
from ddtree_serve.models.drafter import DFlashDrafter
from ddtree_serve.models.loading import read_config
from ddtree_serve.models.random_weights import write_random_drafter_dir, write_random_target_dir
from ddtree_serve.models.runner import TargetRunner

HIDDEN = 64
VOCAB = 101
MASK_ID = 100
LAYER_IDS = [1, 9, 17, 25, 33]


def zlab_b16_config() -> dict:
    """`z-lab/Qwen3-8B-DFlash-b16`'s config.json with hidden/intermediate/heads/vocab reduced."""
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 16,
        "bos_token_id": 99,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS},
        "dtype": "bfloat16",
        "eos_token_id": 98,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": 192,
        "layer_types": ["full_attention"] * 5,
        "max_position_embeddings": 40960,
        "max_window_layers": 5,
        "model_type": "qwen3",
        "num_attention_heads": 8,
        "num_hidden_layers": 5,
        "num_key_value_heads": 2,
        "num_target_layers": 36,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }


def target_config() -> dict:
    """A target whose embedding/head the drafter borrows (only those tensors are read)."""
    return {**zlab_b16_config(), "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2}


@pytest.fixture(scope="module")
def zlab_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("zlab_shaped")
    target = write_random_target_dir(root / "target", target_config(), seed=0)
    drafter = write_random_drafter_dir(root / "drafter", zlab_b16_config(), seed=1)
    return drafter, target


def test_checkpoint_keys_follow_zlab_layout(zlab_dirs: tuple[Path, Path]) -> None:
    drafter = DFlashDrafter.from_pretrained(*zlab_dirs, num_slots=1, max_seq_len=8)
    per_layer = {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "mlp.down_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        *(f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")),
    }
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{name}" for i in range(5) for name in per_layer}
    assert set(drafter.model.state_dict()) == expected
    assert drafter.model.fc.weight.shape == (HIDDEN, len(LAYER_IDS) * HIDDEN)
    assert (drafter.block_size, drafter.mask_token_id, drafter.target_layer_ids) == (
        16,
        MASK_ID,
        tuple(LAYER_IDS),
    )
    assert read_config(zlab_dirs[0])["num_target_layers"] == 36


def test_draft_shape_determinism_and_stateless_equivalence(zlab_dirs: tuple[Path, Path]) -> None:
    drafter = DFlashDrafter.from_pretrained(*zlab_dirs, num_slots=4, max_seq_len=64)
    gen = torch.Generator().manual_seed(0)
    feature_dim = drafter.feature_dim
    contexts = [torch.randn(n, feature_dim, generator=gen) for n in (9, 4)]
    slots, bonus = [2, 0], torch.tensor([7, 12])
    # first draft gets part of the context, the second the rest: appends must accumulate
    drafter.draft(slots, bonus, [c[:3] for c in contexts])
    logits = drafter.draft(slots, bonus, [c[3:] for c in contexts])
    assert logits.shape == (2, 15, VOCAB)
    assert [drafter.context_len(s) for s in slots] == [9, 4]

    again = drafter.draft(slots, bonus, [torch.empty(0, feature_dim)] * 2)
    assert torch.equal(logits, again)  # no block K/V left behind

    model = drafter.model
    for b, context in enumerate(contexts):  # the stateless (training) forward on one row agrees
        n = context.shape[0]
        block = torch.tensor([[int(bonus[b])] + [MASK_ID] * 15])
        with torch.no_grad():
            hidden = model(
                F.embedding(block, drafter.embed_weight),
                torch.arange(n, n + 16)[None],
                torch.ones(1, 16, n + 16, dtype=torch.bool),
                context[None],
                torch.arange(n)[None],
            )
        reference = F.linear(hidden[:, 1:], drafter.head_weight)[0]
        assert (logits[b] - reference).abs().max() < 1e-4

    drafter.release(2)
    assert drafter.context_len(2) == 0


def test_tiny_pair_drafts_from_target_features(tiny_target_dir: Path, tiny_drafter_dir: Path) -> None:
    drafter = DFlashDrafter.from_pretrained(tiny_drafter_dir, tiny_target_dir, num_slots=2, max_seq_len=64)
    target = TargetRunner.from_pretrained(
        tiny_target_dir, num_slots=2, max_seq_len=64, target_layer_ids=drafter.target_layer_ids
    )
    assert target.feature_dim == drafter.feature_dim
    logits, features = target.prefill(1, [5, 6, 7, 8])
    draft_logits = drafter.draft([1], logits.argmax()[None], [features])
    assert draft_logits.shape == (1, drafter.block_size - 1, target.vocab_size)
    assert drafter.context_len(1) == target.seq_len(1)


def test_side_by_side_training_blocks_equal_separate_drafts(zlab_dirs: tuple[Path, Path]) -> None:
    """The stateless forward under a block mask: each block only sees its own context prefix."""
    drafter = DFlashDrafter.from_pretrained(*zlab_dirs, num_slots=1, max_seq_len=8)
    model, bs = drafter.model, 4
    gen = torch.Generator().manual_seed(5)
    context = torch.randn(1, 12, drafter.feature_dim, generator=gen)
    anchors, anchor_tokens = [3, 8], [11, 22]
    blocks = torch.tensor([[t] + [MASK_ID] * (bs - 1) for t in anchor_tokens]).view(1, -1)  # [1, 2 * bs]
    positions = torch.cat([torch.arange(a, a + bs) for a in anchors])[None]
    query_block = torch.arange(2 * bs) // bs
    sees_context = torch.arange(12)[None, :] < torch.tensor(anchors)[query_block][:, None]
    mask = torch.cat([sees_context, query_block[:, None] == query_block[None, :]], dim=1)[None]
    with torch.no_grad():
        joint = model(
            F.embedding(blocks, drafter.embed_weight), positions, mask, context, torch.arange(12)[None]
        )
        for n, a in enumerate(anchors):
            alone = model(
                F.embedding(blocks[:, n * bs : (n + 1) * bs], drafter.embed_weight),
                positions[:, n * bs : (n + 1) * bs],
                torch.ones(1, bs, a + bs, dtype=torch.bool),
                context[:, :a],
                torch.arange(a)[None],
            )
            assert (joint[:, n * bs : (n + 1) * bs] - alone).abs().max() < 1e-4


def test_config_variants_parse_like_zlab() -> None:
    config = zlab_b16_config()
    moved = {**config, "model_type": "llama", "mask_token_id": MASK_ID, "dflash_config": {}}
    parsed = DFlashConfig.from_dict(moved)  # fields at the top level, Llama-family target
    assert parsed.decoder.qk_norm and parsed.mask_token_id == MASK_ID
    assert parsed.target_layer_ids == tuple(LAYER_IDS)  # DFlash's default spread for 36 -> 5 layers
    assert parsed.feature_dim == 5 * HIDDEN
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig.from_dict({**config, "dflash_config": {}})
