"""The DFlash training objective: anchors, the block-structured mask, what each block can see."""

from pathlib import Path

import torch

from ddtree_serve.models.dflash import DFlashConfig, DFlashDraftModel
from ddtree_serve.models.drafter import DFlashDrafter
from ddtree_serve.models.layers import causal_mask
from ddtree_serve.models.loading import save_model_dir
from ddtree_serve.models.qwen3 import Qwen3Config, Qwen3ForCausalLM, context_features
from ddtree_serve.training.drafter import block_attention_mask, dflash_loss, sample_anchors
from ddtree_serve.training.generation import continue_prompts
from ddtree_serve.training.loop import init_weights
from ddtree_serve.training.recipe import SMOKE, drafter_hf_config, target_hf_config

EOS_ID, MASK_ID = 0, 1


def tiny_pair() -> tuple[Qwen3ForCausalLM, DFlashDraftModel]:
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config.from_dict(target_hf_config(SMOKE, EOS_ID, "float32")))
    draft = DFlashDraftModel(DFlashConfig.from_dict(drafter_hf_config(SMOKE, EOS_ID, MASK_ID, "float32")))
    init_weights(target, SMOKE.target.num_layers)
    init_weights(draft, SMOKE.drafter.num_layers)
    return target.eval(), draft.eval()


def test_anchors_are_distinct_sorted_and_leave_room_for_the_block() -> None:
    generator = torch.Generator().manual_seed(0)
    anchors = sample_anchors(batch_size=16, seq_len=40, num_anchors=20, block_size=8, generator=generator)
    assert anchors.shape == (16, 20)
    assert int(anchors.min()) >= 1 and int(anchors.max()) <= 40 - 8
    assert bool((anchors[:, 1:] > anchors[:, :-1]).all())


def test_block_mask_sees_context_strictly_before_its_anchor_and_only_its_own_block() -> None:
    anchors = torch.tensor([[2, 5]])
    mask = block_attention_mask(anchors, seq_len=8, block_size=3)[0]  # [6, 8 + 6]
    context, blocks = mask[:, :8], mask[:, 8:]
    expected_context = torch.zeros(6, 8, dtype=torch.bool)
    expected_context[:3, :2] = True  # block 0: anchor 2 sees positions 0, 1
    expected_context[3:, :5] = True  # block 1: anchor 5 sees positions 0..4
    assert torch.equal(context, expected_context)
    expected_blocks = torch.zeros(6, 6, dtype=torch.bool)
    expected_blocks[:3, :3] = True
    expected_blocks[3:, 3:] = True
    assert torch.equal(blocks, expected_blocks)


def test_a_block_ignores_every_token_from_its_anchor_on_except_the_anchor_itself() -> None:
    target, draft = tiny_pair()
    block_size = draft.config.block_size
    seq_len = 32
    tokens = torch.randint(2, SMOKE.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[6, 20]])

    def block_logits(row: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(seq_len)[None]
        out = target(row, positions, causal_mask(seq_len), output_layer_ids=draft.config.target_layer_ids)
        features = torch.cat([out.layer_hidden[i] for i in draft.config.target_layer_ids], dim=-1)
        block = torch.full((1, 2, block_size), MASK_ID)
        block[:, :, 0] = row.gather(1, anchors)
        embeds = target.model.embed_tokens(block.flatten(1))
        block_positions = (anchors[:, :, None] + torch.arange(block_size)).flatten(1)
        mask = block_attention_mask(anchors, seq_len, block_size)
        return draft(embeds, block_positions, mask, features, positions).unflatten(1, (2, block_size))

    with torch.no_grad():
        reference = block_logits(tokens)
        later = tokens.clone()
        later[:, 7:] = (later[:, 7:] + 1) % SMOKE.vocab_size  # everything after block 0's anchor
        changed = block_logits(later)
        earlier = tokens.clone()
        earlier[:, 5] = (earlier[:, 5] + 1) % SMOKE.vocab_size  # just before block 0's anchor
        changed_before = block_logits(earlier)
    torch.testing.assert_close(changed[:, 0], reference[:, 0], rtol=0, atol=1e-6)
    assert not torch.allclose(changed[:, 1], reference[:, 1])
    assert not torch.allclose(changed_before[:, 0], reference[:, 0])


def test_loss_is_finite_differentiable_and_greedy_tau_in_range() -> None:
    target, draft = tiny_pair()
    target.requires_grad_(False)  # as in train_drafter: the target (and its embedding/head) is frozen
    draft.train()
    tokens = torch.randint(2, SMOKE.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    anchors = sample_anchors(2, 40, 4, draft.config.block_size, torch.Generator().manual_seed(3))
    result = dflash_loss(draft, target, tokens, anchors, loss_decay_gamma=4.0)
    result.loss.backward()
    assert torch.isfinite(result.loss)
    assert 1.0 <= result.greedy_tau <= draft.config.block_size
    assert all(p.grad is not None for p in draft.parameters())
    assert all(p.grad is None for p in target.parameters())


def test_cached_continuation_is_greedy_after_the_sampled_prefix() -> None:
    target, _ = tiny_pair()
    prompts = torch.randint(2, SMOKE.vocab_size, (3, 5), generator=torch.Generator().manual_seed(4))
    num_sampled = torch.tensor([0, 0, 2])  # the last row samples two tokens, then goes greedy
    out = continue_prompts(target, prompts, 6, num_sampled, torch.Generator().manual_seed(5))
    assert torch.equal(out[:, :5], prompts)
    with torch.no_grad():
        for b, first_greedy in enumerate([5, 5, 7]):
            row = out[b : b + 1, :first_greedy]
            while row.shape[1] < out.shape[1]:
                length = row.shape[1]
                hidden = target(row, torch.arange(length)[None], causal_mask(length)).hidden
                row = torch.cat([row, target.logits(hidden[:, -1]).argmax(-1, keepdim=True)], dim=1)
            assert torch.equal(out[b], row[0])


def test_runtime_drafter_reproduces_the_training_forward(tmp_path: Path) -> None:
    """What the drafter is trained on is what `DFlashDrafter.draft` computes at serving time."""
    target, draft = tiny_pair()
    save_model_dir(target, target_hf_config(SMOKE, EOS_ID, "float32"), tmp_path / "target")
    save_model_dir(draft, drafter_hf_config(SMOKE, EOS_ID, MASK_ID, "float32"), tmp_path / "drafter")
    runtime = DFlashDrafter.from_pretrained(
        tmp_path / "drafter", tmp_path / "target", num_slots=1, max_seq_len=64
    )
    block_size, seq_len = draft.config.block_size, 32
    tokens = torch.randint(2, SMOKE.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(6))
    anchors = torch.tensor([[6, 20]])
    with torch.no_grad():
        positions = torch.arange(seq_len)[None]
        out = target(tokens, positions, causal_mask(seq_len), output_layer_ids=draft.config.target_layer_ids)
        features = context_features(out, draft.config.target_layer_ids)
        block = torch.full((1, 2, block_size), MASK_ID)
        block[:, :, 0] = tokens.gather(1, anchors)
        hidden = draft(
            target.model.embed_tokens(block.flatten(1)),
            (anchors[:, :, None] + torch.arange(block_size)).flatten(1),
            block_attention_mask(anchors, seq_len, block_size),
            features,
            positions,
        ).unflatten(1, (2, block_size))
        trained_logits = target.logits(hidden[:, :, 1:])  # [1, 2, bs-1, V]
    for n, anchor in enumerate(anchors[0].tolist()):
        served = runtime.draft([0], tokens[:, anchor], [features[0, :anchor]])  # [1, bs-1, V]
        runtime.release(0)
        torch.testing.assert_close(served[0], trained_logits[0, n], rtol=1e-4, atol=1e-4)
