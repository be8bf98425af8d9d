"""The start-up capture of a graphed engine's verify and draft graphs (`engine.graph_warmup`).

On the CPU the graphs' padded path runs eagerly (capture off) and records each bucket it meets,
so the warm-up's shapes are read from the buckets: every verify shape a fixed budget's steps can
meet and a draft per batch bucket, on slots left empty, before the first request.
"""

import json
import logging
from pathlib import Path

import pytest

from ddtree_serve.engine.budget import CostCurve
from ddtree_serve.engine.builder import build_draft_step, build_target_step
from ddtree_serve.engine.graph_warmup import warmup_shapes
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.models.cuda_graphs import BATCH_BUCKETS, TOKEN_BUCKETS
from tests.engine.conftest import run_to_completion
from tests.models.test_cuda_graphs import pad_drafter_to_buckets, pad_to_buckets


def test_the_shapes_are_every_bucket_below_the_full_batch_and_the_full_tree_and_those():
    shapes = warmup_shapes(TOKEN_BUCKETS, max_num_seqs=5, max_tree_tokens=9, drafts=True, vocab_size=8192)
    # 5 requests pad to 8 (no more slots to fill it); a budget-8 tree and its root
    assert set(shapes.verifies) == {(b, n) for b in (1, 2, 4, 5) for n in (1, 2, 4, 8, 9)}
    sizes = [b * n for b, n in shapes.verifies]
    assert sizes == sorted(sizes)  # smallest first
    assert shapes.draft_batch_sizes == (1, 2, 4, 5) and shapes.left_out == 0
    assert shapes.num_calls == 4 * 5 + 4
    one = warmup_shapes(TOKEN_BUCKETS, 1, 10, drafts=True, vocab_size=8192)
    assert [n for _, n in one.verifies] == [1, 2, 4, 8, 9, 10]  # 10 pads to 16
    plain = warmup_shapes(TOKEN_BUCKETS, max_num_seqs=1000, max_tree_tokens=1, drafts=False, vocab_size=8192)
    assert [b for b, _ in plain.verifies] == list(BATCH_BUCKETS) and plain.draft_batch_sizes == ()


def test_the_largest_verify_shapes_are_left_out_past_the_logits_cap():
    """Each graph keeps its padded [batch, nodes, vocab] logits: the warm-up takes the smallest
    shapes while their logits stay within the cap and leaves the rest to their first meeting."""
    vocab = 150_000
    whole = warmup_shapes(TOKEN_BUCKETS, 64, 65, drafts=True, vocab_size=vocab, max_logits_gib=1e9)
    capped = warmup_shapes(TOKEN_BUCKETS, 64, 65, drafts=True, vocab_size=vocab, max_logits_gib=8.0)
    assert len(whole.verifies) == 9 * 12 and whole.left_out == 0
    held = sum(b * n for b, n in capped.verifies) * vocab * 2 / 2**30  # 64 and 65 are buckets
    assert held <= 8.0 < held + capped.left_out_gib
    assert capped.verifies == whole.verifies[: len(capped.verifies)]
    assert capped.left_out == len(whole.verifies) - len(capped.verifies) > 0
    assert (64, 65) not in capped.verifies and capped.draft_batch_sizes == whole.draft_batch_sizes


@pytest.mark.parametrize(("mode", "budget"), [("ar", 1), ("ddtree", 8)])
def test_a_graphed_engine_meets_every_step_shape_at_start_up_and_leaves_its_slots_empty(
    make_pair_config, pair_tokenizer, mode: str, budget: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Built over a target and drafter on the graphs' path, a fixed-budget engine runs each verify
    bucket of its batch sizes (1-3 requests pad to 1, 2, 4) and tree widths, and a draft per batch
    bucket, before any request; every slot is empty after, and its greedy output is the eager
    engine's."""
    config = make_pair_config(mode=mode, budget=budget, max_num_seqs=3, max_seq_len=256)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 9, 2)]
    outputs = []
    for graphed in (False, True):
        target = build_target_step(config, None)
        drafter = build_draft_step(config, None) if mode != "ar" else None
        if graphed:
            pad_to_buckets(target.runner)
            if drafter is not None:
                pad_drafter_to_buckets(drafter.drafter)
        with caplog.at_level(logging.INFO, logger="ddtree_serve.engine.graph_warmup"):
            engine = SpecEngine(config.to_settings(), target, drafter, pair_tokenizer)
        if graphed:
            widths = (1,) if mode == "ar" else (1, 2, 4, 8, 9)
            verify_keys = {(b, n, 256) for b in (1, 2, 4) for n in widths}
            assert verify_keys <= set(target.runner.graphs.forward._buckets)
            if drafter is not None:
                assert {(b, 256) for b in (1, 2, 4)} <= set(drafter.drafter.graphs.block._buckets)
            assert all(target.runner.seq_len(slot) == 0 for slot in range(3))
            assert "captured CUDA graphs for" in caplog.text
        else:
            assert "capturing CUDA graphs" not in caplog.text  # an eager target warms nothing up
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        outputs.append(run_to_completion(engine))
    assert outputs[0] == outputs[1]


def test_an_adaptive_engine_from_a_cost_file_captures_the_shapes_and_knows_them(
    make_pair_config, pair_tokenizer, tmp_path: Path
) -> None:
    """A policy read from a cost file has not run the calibration's shapes: the engine captures
    them at start-up and records them, so its steps may verify in any of them at once."""
    curve = CostCurve([1, 4], [1.0, 4096.0], [[1.0, 5.0], [1.5, 6.0]], draft_ms=[1.0, 1.2])
    cost_file = tmp_path / "cost.json"
    cost_file.write_text(json.dumps(curve.to_json()))
    config = make_pair_config(
        mode="ddtree",
        budget=8,
        max_num_seqs=3,
        max_seq_len=256,
        budget_policy="adaptive",
        cost_curve=str(cost_file),
    )
    target, drafter = build_target_step(config, None), build_draft_step(config, None)
    pad_to_buckets(target.runner)
    pad_drafter_to_buckets(drafter.drafter)
    engine = SpecEngine(config.to_settings(), target, drafter, pair_tokenizer)
    assert {(b, n, 256) for b in (1, 2, 4) for n in (1, 2, 4, 8, 9)} <= set(
        target.runner.graphs.forward._buckets
    )
    for batch_size in (1, 2, 3):
        assert engine.graph_shapes.captured_buckets(batch_size, max_start=20) == (1, 2, 4, 8, 9)
