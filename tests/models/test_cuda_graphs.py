"""CUDA graphs of the verify and draft forwards (and of prefills, read as chain trees through the
verify's): padding to a bucket changes no real result.

On the CPU the padded forwards run eagerly (capture off) against the unpadded eager ones: the
same numbers up to float32 rounding, the same committed cache, and the same greedy engine
output. On CUDA a replayed graph
equals the padded forward run eagerly to the bit (float32), on every bucket, and greedy engine
output with graphs equals eager output.
"""

from pathlib import Path

import pytest
import torch

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.models.cuda_graphs import BATCH_BUCKETS, TOKEN_BUCKETS, pick_bucket, row_bucket
from ddtree_serve.models.drafter import DFlashDrafter
from ddtree_serve.models.drafter_graphs import DrafterGraphs
from ddtree_serve.models.kv_cache import SlotKVCache
from ddtree_serve.models.runner import TargetRunner
from ddtree_serve.models.target_graphs import PREFILL_GRAPH_MAX_TOKENS, TargetGraphs
from tests.engine.conftest import run_to_completion
from tests.models.trees import random_parents, tree_inputs

LAYER_IDS = (1, 2)
TOL = 1e-5
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def with_scratch_slot(cache: SlotKVCache) -> SlotKVCache:
    """An empty cache shaped like `cache` plus the scratch slot that padded rows write to."""
    return SlotKVCache(
        num_layers=cache.keys.shape[0],
        num_slots=cache.num_slots,
        max_seq_len=cache.max_seq_len,
        num_kv_heads=cache.keys.shape[3],
        head_dim=cache.keys.shape[4],
        value_head_dim=cache.values.shape[4],
        dtype=cache.keys.dtype,
        device=cache.device,
        scratch_slots=1,
    )


def pad_to_buckets(runner: TargetRunner) -> None:
    """Make `runner`'s prefills and verifies pad to buckets and run eagerly (the graphs' path,
    capture off): a fresh cache with the scratch slot their padded rows write to."""
    runner.cache = with_scratch_slot(runner.cache)
    runner.graphs = TargetGraphs(
        runner.model, runner.cache, runner.target_layer_ids, scratch_slot=runner.num_slots, capture=False
    )


def padded_target(path: Path, num_slots: int, max_seq_len: int) -> TargetRunner:
    """A CPU runner whose verify pads to buckets and runs eagerly (the graph path, capture off)."""
    runner = TargetRunner.from_pretrained(
        path, num_slots=num_slots, max_seq_len=max_seq_len, target_layer_ids=LAYER_IDS
    )
    pad_to_buckets(runner)
    return runner


def padded_drafter(drafter_dir: Path, target_dir: Path, num_slots: int, max_seq_len: int) -> DFlashDrafter:
    drafter = DFlashDrafter.from_pretrained(
        drafter_dir, target_dir, num_slots=num_slots, max_seq_len=max_seq_len
    )
    pad_drafter_to_buckets(drafter)
    return drafter


def pad_drafter_to_buckets(drafter: DFlashDrafter) -> None:
    """Make `drafter`'s appends and blocks pad to buckets and run eagerly (the graphs' path,
    capture off): a fresh cache with the scratch slot their padded rows write to."""
    drafter.cache = with_scratch_slot(drafter.cache)
    drafter.graphs = DrafterGraphs(
        drafter.model,
        drafter.cache,
        drafter.embed_weight,
        drafter.head_weight,
        scratch_slot=drafter.cache.num_slots,
        capture=False,
    )


def assert_same_committed_cache(eager: TargetRunner, padded: TargetRunner, slots: list[int]) -> None:
    """Each slot holds as many rows in both runners, with the same keys and values."""
    for slot in slots:
        length = eager.seq_len(slot)
        assert padded.seq_len(slot) == length
        for cache in ("keys", "values"):
            committed = getattr(eager.cache, cache)[:, slot, :length]
            assert (getattr(padded.cache, cache)[:, slot, :length] - committed).abs().max() < TOL


def random_trees(sizes: list[int], vocab: int, gen: torch.Generator) -> list[tuple[list[int], list[int]]]:
    return [(torch.randint(0, vocab, (n,), generator=gen).tolist(), random_parents(n, gen)) for n in sizes]


def test_buckets_hold_the_size_and_rows_stay_within_the_cache() -> None:
    assert pick_bucket(3, BATCH_BUCKETS) == 4 and pick_bucket(16, BATCH_BUCKETS) == 16
    assert pick_bucket(33, TOKEN_BUCKETS) == 33 and pick_bucket(34, TOKEN_BUCKETS) == 48
    assert pick_bucket(10_000, TOKEN_BUCKETS) is None
    assert row_bucket(1, 2048) == 256 and row_bucket(257, 2048) == 512 and row_bucket(1500, 2048) == 2048
    assert row_bucket(300, 300) == 300 and row_bucket(301, 300) is None


def test_padded_verify_equals_eager_verify_and_commits_the_same_cache(tiny_target_dir: Path) -> None:
    """Batches and trees that pad to other sizes (3 -> 4 rows, 5 -> 8 nodes, 12 -> 16 ...).

    The last step's 34 nodes pad to 48, past max_seq_len behind the long prompt: it runs eagerly.
    """
    num_slots, max_seq_len = 4, 300
    eager = TargetRunner.from_pretrained(
        tiny_target_dir, num_slots=num_slots, max_seq_len=max_seq_len, target_layer_ids=LAYER_IDS
    )
    padded = padded_target(tiny_target_dir, num_slots, max_seq_len)
    gen = torch.Generator().manual_seed(5)
    vocab = eager.vocab_size
    slots = [3, 0, 2]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (13, 5, 260)]
    for runner in (eager, padded):
        runner.prefill_batch(slots, prompts)
    for step, sizes in enumerate([[5, 1, 3], [12, 7, 12], [1, 1, 1], [34, 20, 9]]):
        batch = tree_inputs(random_trees(sizes, vocab, gen), padded_num_nodes=max(sizes))
        (ref_logits, ref_features), (logits, features) = (r.verify(slots, batch) for r in (eager, padded))
        assert logits.shape == ref_logits.shape and features.shape == ref_features.shape
        assert (logits - ref_logits).abs().max() < TOL, step
        assert (features - ref_features).abs().max() < TOL, step
        # keep the root and node 1 where there is one (any node indices: commit only compacts)
        accept_index = torch.tensor([[0, 1 if n > 1 else -1] for n in sizes])
        for runner in (eager, padded):
            runner.commit(slots, accept_index)
    assert padded.graphs is not None and padded.graphs.forward.num_buckets == 3
    assert_same_committed_cache(eager, padded, slots)
    untouched = padded.cache.keys[:, 1]  # slot 1 holds no request: no padded write lands there
    assert not untouched.any()


def test_verify_without_a_bucket_runs_eagerly(tiny_target_dir: Path) -> None:
    """A tree whose padded rows would pass max_seq_len takes the eager path, same result."""
    eager = TargetRunner.from_pretrained(
        tiny_target_dir, num_slots=1, max_seq_len=40, target_layer_ids=LAYER_IDS
    )
    padded = padded_target(tiny_target_dir, 1, 40)
    prompt = list(range(10, 38))  # 28 cached + 10 nodes fit in 40 rows; 28 + 16 padded do not
    batch = tree_inputs(
        random_trees([10], eager.vocab_size, torch.Generator().manual_seed(1)), padded_num_nodes=10
    )
    outputs = []
    for runner in (eager, padded):
        runner.prefill(0, prompt)
        outputs.append(runner.verify([0], batch))
    # the prompt's bucket only (its prefill, a chain tree); the verify found none
    assert padded.graphs is not None and padded.graphs.forward.num_buckets == 1
    assert (outputs[0][0] - outputs[1][0]).abs().max() < TOL


def test_prefill_from_a_verify_graph_equals_eager_prefill(tiny_target_dir: Path) -> None:
    """Prompts as chain trees in a padded verify bucket: 3 -> 4 rows, 13 -> 16 nodes, then a
    second chunk after each slot's cached prompt, then one too long for any bucket (eager).
    Same logits, features and cache as the eager prefill; the padded rows touch no slot."""
    num_slots, max_seq_len = 4, 300
    eager = TargetRunner.from_pretrained(
        tiny_target_dir, num_slots=num_slots, max_seq_len=max_seq_len, target_layer_ids=LAYER_IDS
    )
    padded = padded_target(tiny_target_dir, num_slots, max_seq_len)
    gen = torch.Generator().manual_seed(11)
    slots = [3, 0, 2]
    for lengths in ((13, 5, 9), (1, 7, 2), (4, 270, 3)):
        prompts = [torch.randint(0, eager.vocab_size, (n,), generator=gen).tolist() for n in lengths]
        (ref_logits, ref_features), (logits, features) = (
            r.prefill_batch(slots, prompts) for r in (eager, padded)
        )
        assert logits.shape == ref_logits.shape and (logits - ref_logits).abs().max() < TOL, lengths
        for got, ref in zip(features, ref_features, strict=True):
            assert got.shape == ref.shape and (got - ref).abs().max() < TOL, lengths
    assert padded.graphs is not None and padded.graphs.forward.num_buckets == 2  # the last ran eagerly
    assert_same_committed_cache(eager, padded, slots)
    assert not padded.cache.keys[:, 1].any()  # slot 1 holds no request


def test_padded_draft_equals_eager_draft(tiny_target_dir: Path, tiny_drafter_dir: Path) -> None:
    num_slots, max_seq_len = 4, 320
    eager = DFlashDrafter.from_pretrained(
        tiny_drafter_dir, tiny_target_dir, num_slots=num_slots, max_seq_len=max_seq_len
    )
    padded = padded_drafter(tiny_drafter_dir, tiny_target_dir, num_slots, max_seq_len)
    gen = torch.Generator().manual_seed(2)
    slots = [2, 0, 3]
    # a long first context (a prompt), then steps of 1..block_size accepted tokens per slot
    for counts in ([270, 6, 3], [1, 8, 4], [3, 1, 1], [8, 8, 8]):
        context = [torch.randn(n, eager.feature_dim, generator=gen) for n in counts]
        bonus = torch.randint(0, eager.vocab_size, (3,), generator=gen)
        ref = eager.draft(slots, bonus, context)
        out = padded.draft(slots, bonus, context)
        assert out.shape == ref.shape == (3, eager.block_size - 1, eager.vocab_size)
        assert (out - ref).abs().max() < TOL, counts
    for slot in slots:
        length = eager.context_len(slot)
        assert padded.context_len(slot) == length
        assert (padded.cache.keys[:, slot, :length] - eager.cache.keys[:, slot, :length]).abs().max() < TOL
    assert not padded.cache.keys[:, 1].any()  # no padded context lands in a request slot


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("batch_size", [1, 3, 8, 16])
def test_cuda_verify_replay_equals_padded_eager_to_the_bit(tiny_target_dir: Path, batch_size: int) -> None:
    """Every token bucket up to 129 at this batch size, at a short and a long prefix, in float32."""
    runner = TargetRunner.from_pretrained(
        tiny_target_dir, num_slots=16, max_seq_len=1024, device="cuda", target_layer_ids=LAYER_IDS
    )
    assert runner.graphs is not None
    reference = TargetGraphs(
        runner.model, runner.cache, runner.target_layer_ids, scratch_slot=runner.num_slots, capture=False
    )
    gen = torch.Generator().manual_seed(batch_size)
    vocab = runner.vocab_size
    slots = list(range(16 - batch_size, 16))[::-1]  # descending: a gather, not a slice
    token_buckets = [n for n in TOKEN_BUCKETS if n <= 129]
    for prefix in (20, 400):  # row buckets 256 and 1024
        prompts = [torch.randint(0, vocab, (prefix - b,), generator=gen) for b in range(batch_size)]
        counts = [len(p) for p in prompts]
        tokens = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True)
        chains = reference.prefill(slots, tokens, counts, runner.cache.slot_lengths(slots))
        if chains is not None:  # a graphed prefill (at batch 16 the 400-token chains run eagerly)
            last = torch.tensor(counts) - 1
            want_logits, want_features = chains[0][torch.arange(batch_size), last], chains[1].clone()
            logits, features = runner.prefill_batch(slots, prompts)
            assert torch.equal(logits, want_logits), prefix
            assert all(torch.equal(f, want_features[b, : counts[b]]) for b, f in enumerate(features)), prefix
        else:
            runner.prefill_batch(slots, prompts)
        for num_nodes in token_buckets:
            sizes = [max(1, num_nodes - b % 2) for b in range(batch_size)]
            batch = tree_inputs(random_trees(sizes, vocab, gen), padded_num_nodes=num_nodes).to("cuda")
            replayed = [t.clone() for t in runner.verify(slots, batch)]
            eager = reference.verify(slots, batch, runner.cache.slot_lengths(slots))
            assert eager is not None
            for got, want in zip(replayed, eager, strict=True):
                assert torch.equal(got, want), (prefix, num_nodes)
    prefill_graphs = 1 if pick_bucket(batch_size, BATCH_BUCKETS) * 512 <= PREFILL_GRAPH_MAX_TOKENS else 0
    assert runner.graphs.forward.num_graphs == 2 * len(token_buckets) + prefill_graphs  # 400 -> 512


@pytest.mark.gpu
@cuda_only
def test_cuda_draft_replay_equals_padded_eager_to_the_bit(
    tiny_target_dir: Path, tiny_drafter_dir: Path
) -> None:
    """Every batch bucket up to 16 for the block; append buckets from 1 to 256 new tokens."""
    drafter = DFlashDrafter.from_pretrained(
        tiny_drafter_dir, tiny_target_dir, num_slots=16, max_seq_len=1024, device="cuda"
    )
    assert drafter.graphs is not None
    reference = DrafterGraphs(
        drafter.model,
        drafter.cache,
        drafter.embed_weight,
        drafter.head_weight,
        scratch_slot=drafter.cache.num_slots,
        capture=False,
    )
    gen = torch.Generator().manual_seed(0)
    for batch_size in [b for b in BATCH_BUCKETS if b <= 16]:
        slots = list(range(batch_size))[::-1]
        counts = [1 + (3 * b) % drafter.block_size for b in range(batch_size)]
        context = [torch.randn(n, drafter.feature_dim, generator=gen).cuda() for n in counts]
        bonus = torch.randint(0, drafter.vocab_size, (batch_size,), generator=gen)
        replayed = drafter.draft(slots, bonus, context).clone()  # appends through its graph
        lens = drafter.cache.slot_lengths(slots)
        eager = reference.draft(slots, bonus, lens)
        assert eager is not None and torch.equal(replayed, eager), batch_size
    # the same new context appended by replay (slot 0) and eagerly (slot 1) at the same positions
    for num_tokens in (1, 5, 16, 100, 256):
        features = torch.randn(num_tokens, drafter.feature_dim, generator=gen).cuda()
        for slot, graphs in ((0, drafter.graphs), (1, reference)):
            done = graphs.append_context(
                [features], torch.full((num_tokens,), slot), torch.arange(num_tokens) + 500
            )
            assert done
        for cache in (drafter.cache.keys, drafter.cache.values):
            rows = slice(500, 500 + num_tokens)
            assert torch.equal(cache[:, 0, rows], cache[:, 1, rows]), num_tokens


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize(("mode", "budget"), [("ar", 1), ("chain", 1), ("ddtree", 8), ("ddtree", 32)])
def test_cuda_greedy_output_with_graphs_equals_eager(
    tiny_target_dir: Path, tiny_drafter_dir: Path, mode, budget
) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 9, 30, 2)]
    outputs = []
    for enforce_eager in (True, False):
        config = EngineConfig(
            target=str(tiny_target_dir),
            drafter=str(tiny_drafter_dir),
            device="cuda",
            mode=mode,
            budget=budget,
            max_num_seqs=3,  # requests join as others finish: batch sizes 1..3 and changing slots
            max_seq_len=256,
            enforce_eager=enforce_eager,
        )
        engine = build_local_engine(config)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        outputs.append(run_to_completion(engine))
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize(("mode", "budget"), [("ar", 1), ("ddtree", 8)])
def test_engine_greedy_output_with_padded_target_graphs_equals_eager(
    tiny_target_dir: Path, tiny_drafter_dir: Path, mode: str, budget: int
) -> None:
    """The engine over a target whose prefills and verifies run padded to buckets (the graphs'
    path, capture off) makes the eager engine's greedy output: newcomers prefill as chains while
    others verify trees, in batches of 1-3 (the 70-token prompt's chain pads to 96 nodes)."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 9, 70, 2)]
    outputs, buckets = [], 0
    for padded in (False, True):
        config = EngineConfig(
            target=str(tiny_target_dir),
            drafter=str(tiny_drafter_dir),
            mode=mode,
            budget=budget,
            max_num_seqs=3,
            max_seq_len=256,
        )
        engine = build_local_engine(config)
        if padded:
            runner = engine.target.runner
            pad_to_buckets(runner)
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        outputs.append(run_to_completion(engine))
        if padded:
            buckets = runner.graphs.forward.num_buckets
    assert outputs[0] == outputs[1]
    assert buckets > 0
