"""The adaptive choice keeps to the verify graphs a graphed target has captured."""

import json
from collections import defaultdict

import numpy as np

from ddtree_serve.engine.budget import AdaptiveBudget, CostCurve
from ddtree_serve.engine.builder import build_draft_step, build_target_step
from ddtree_serve.engine.graph_shapes import VerifyGraphShapes
from ddtree_serve.engine.interfaces import PrefillInput, PrefillOutput, VerifyInput, VerifyOutput
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.models.cuda_graphs import TOKEN_BUCKETS, pick_bucket, verify_bucket
from ddtree_serve.tree import TreeBatch, build_chain
from tests.engine.conftest import run_to_completion
from tests.engine.fakes import RecordingTarget
from tests.engine.test_budget_engine import steer_by_the_file


def test_captured_buckets_are_per_batch_bucket_and_row_bucket():
    shapes = VerifyGraphShapes(TOKEN_BUCKETS, max_seq_len=1024)
    shapes.record(4, 17, max_start=8)
    shapes.record(4, 33, max_start=8)
    shapes.record(4, 1, max_start=300)
    assert shapes.captured_buckets(3, max_start=20) == (17, 33)  # batch 3 runs batch 4's graphs
    assert shapes.captured_buckets(8, max_start=20) == ()  # another batch bucket
    assert shapes.captured_buckets(4, max_start=300) == (1,)  # rows 512: the root-only graph
    shapes.record(4, 9, max_start=300)
    assert shapes.captured_buckets(4, max_start=300) == (1, 9)
    # At 240 cached tokens the rows a width reads depend on it: 240 + 33 is the 512-row bucket.
    shapes.record(4, 33, max_start=240)
    assert shapes.captured_buckets(4, max_start=240) == (33,)
    assert VerifyGraphShapes.padded_nodes(10, (1, 17, 33)) == 17
    assert VerifyGraphShapes.padded_nodes(18, (1, 17, 33)) == 33
    assert VerifyGraphShapes.padded_nodes(10, None) is None


def test_a_step_may_verify_in_a_captured_graph_or_its_ceilings_own():
    shapes = VerifyGraphShapes(TOKEN_BUCKETS, max_seq_len=1024)
    shapes.record(4, 17, max_start=8)
    shapes.record(4, 64, max_start=8)
    assert shapes.allowed_buckets(4, max_start=8, ceiling=32) == (17, 33)  # 64 is past the ceiling
    assert shapes.allowed_buckets(4, max_start=8, ceiling=16) == (17,)
    assert shapes.allowed_buckets(8, max_start=8, ceiling=8) == (9,)  # nothing captured: its own
    assert shapes.allowed_buckets(300, max_start=8, ceiling=8) is None  # no batch bucket: eager
    # Near the end of the cache the ceiling's bucket would read past it: the captured that fit.
    shapes.record(4, 17, max_start=1000)
    assert shapes.allowed_buckets(4, max_start=1000, ceiling=32) == (17,)
    assert shapes.allowed_buckets(8, max_start=1000, ceiling=32) is None  # none there: free


def test_the_widest_tree_fills_a_captured_bucket():
    cost = CostCurve([1], [1, 64], [[1.0, 1.0]], draft_ms=[0.0])  # free nodes: the widest pays
    tree = TreeBatch.from_trees([build_chain(np.arange(1, 33), 7, np.full(32, -0.01))])
    free = AdaptiveBudget(cost, token_buckets=TOKEN_BUCKETS).choose(tree, [32])
    kept = AdaptiveBudget(cost, token_buckets=TOKEN_BUCKETS).choose(tree, [32], captured=(1, 9))
    assert free.num_nodes == (32,) and kept.num_nodes == (8,)


class GraphedTarget(RecordingTarget):
    """The CPU target, claiming graph buckets; records each verify's graph key, and the gate's
    ceiling when it is given the policy."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.cached: dict[int, int] = {}
        self.keys: list[tuple[int, int, int]] = []
        self.ceilings: list[int] = []
        self.policy: AdaptiveBudget | None = None

    @property
    def verify_token_buckets(self) -> tuple[int, ...] | None:
        return TOKEN_BUCKETS

    def prefill(self, inputs: PrefillInput) -> PrefillOutput:
        output = super().prefill(inputs)
        self.cached.update(zip(inputs.slots, output.num_cached_tokens, strict=True))
        return output

    def verify_and_commit(self, inputs: VerifyInput) -> VerifyOutput:
        max_start = max(self.cached[slot] for slot in inputs.slots)
        key = verify_bucket(len(inputs.slots), inputs.batch.padded_num_nodes, max_start, self.max_seq_len)
        self.keys.append(key)
        self.ceilings.append(0 if self.policy is None else self.policy.ceiling)
        output = super().verify_and_commit(inputs)
        self.cached.update(zip(inputs.slots, output.num_cached_tokens, strict=True))
        return output


def test_past_the_calibrated_rows_each_width_is_a_ceilings_bucket(
    make_pair_config, prompt_ids, pair_tokenizer, tmp_path
):
    """Contexts cross from the 256-row bucket (captured at start-up) into the 512 one: every
    drafted verify there runs the bucket of a ceiling the gate chose in that (batch, rows)
    bucket, never the allocator's own width (a capture per width), and the output is still
    plain greedy decoding's."""
    config = make_pair_config(mode="ddtree", budget=16, max_num_seqs=3, max_seq_len=1024)
    target = GraphedTarget(build_target_step(config))
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    plain = SpecEngine(config.model_copy(update={"mode": "ar"}).to_settings(), target, None, pair_tokenizer)
    for i, prompt in enumerate(prompt_ids):
        plain.add_request(str(i), prompt, params)
    expected = run_to_completion(plain)
    target.keys.clear()
    target.ceilings.clear()
    moderate = tmp_path / "moderate.json"  # nodes priced so the allocator's widths vary (8-17)
    moderate.write_text(json.dumps({"tokens": [1, 64], "ms": [10.0, 30.0], "draft_ms": 1.0}))
    adaptive_config = config.model_copy(update={"budget_policy": "adaptive", "cost_curve": str(moderate)})
    engine = SpecEngine(adaptive_config.to_settings(), target, build_draft_step(config), pair_tokenizer)
    target.keys.clear()  # the start-up capture's verifies (`graph_warmup`) are no steps
    target.ceilings.clear()
    steer_by_the_file(engine)
    target.policy = engine.budget_policy
    for i, prompt in enumerate(prompt_ids):
        engine.add_request(str(i), prompt, params)
    assert run_to_completion(engine) == expected
    ceilings_seen: dict[tuple[int, int], set[int]] = defaultdict(set)
    past_first_rows = 0
    for (padded_batch, padded_nodes, num_rows), ceiling in zip(target.keys, target.ceilings, strict=True):
        if padded_nodes == 1:
            continue  # a plain step
        if num_rows == 256:  # captured at start-up (`graph_warmup`): every width up to the budget's
            assert padded_nodes <= pick_bucket(config.budget + 1, TOKEN_BUCKETS)
            continue
        buckets = ceilings_seen[padded_batch, num_rows]
        buckets.add(pick_bucket(ceiling + 1, TOKEN_BUCKETS))
        assert padded_nodes in buckets, (padded_nodes, ceiling, buckets)
        past_first_rows += num_rows > 256
    assert past_first_rows, "no drafted step ran past the first row bucket"


def confident_policy() -> tuple[AdaptiveBudget, TreeBatch, int]:
    cost = CostCurve([1], [1, 64], [[1.0, 1.0]], draft_ms=[0.0])  # free nodes: the widest pays
    policy = AdaptiveBudget(cost, token_buckets=TOKEN_BUCKETS, learning_steps=0)  # the curve is given
    policy.gate.record_curve(np.full((1, 32), 0.9), np.array([32]))
    ceiling = policy.plan([32])
    assert ceiling == 32
    tree = TreeBatch.from_trees([build_chain(np.arange(1, 33), 7, np.full(32, -0.01))])
    return policy, tree, ceiling


def test_a_step_cut_by_captured_graphs_teaches_its_ceiling_no_step_time():
    for captured, taught in ((None, True), ((1, 9), False)):
        policy, tree, ceiling = confident_policy()
        allocation = policy.choose(tree, [32], captured)
        policy.record_verify_ms(1.0)
        policy.observe(tree.prefix(allocation.num_nodes), [[]])
        policy.record_step_ms(50.0)  # far off the prediction: a ratio would move
        assert (policy.gate.residual.ratio(1, ceiling) != 1.0) == taught


def test_the_cost_curve_learns_the_width_the_verify_ran():
    """A 4-node tree verified in the captured 17-node graph: the lesson is a 17-token forward."""
    policy, _, _ = confident_policy()
    short = TreeBatch.from_trees([build_chain(np.arange(1, 5), 7, np.full(4, -0.01))])
    observed = []
    policy.cost.observe_verify = lambda batch_size, tokens, ms: observed.append(tokens)
    allocation = policy.choose(short, [32], (1, 17))
    policy.record_verify_ms(1.0)
    policy.observe(short.prefix(allocation.num_nodes), [[]], padded_num_nodes=17)
    policy.learn()
    assert allocation.num_nodes == (4,) and observed == [17]


def test_an_engine_given_a_policy_keeps_to_the_graphs_its_target_captured(
    make_pair_config, prompt_ids, pair_tokenizer, tmp_path
):
    """The captured shapes are the target's and go with the policy: a second engine over the
    same target and policy (a benchmark's) reads the same record (where the first one drafted,
    the second verifies in the graphs it captured: its ceilings' buckets are among them)."""
    config = make_pair_config(mode="ddtree", budget=16, max_num_seqs=3)
    target, drafter = GraphedTarget(build_target_step(config)), build_draft_step(config)
    moderate = tmp_path / "moderate.json"
    moderate.write_text(json.dumps({"tokens": [1, 64], "ms": [10.0, 30.0], "draft_ms": 1.0}))
    adaptive = {"budget_policy": "adaptive", "cost_curve": str(moderate)}
    settings = config.model_copy(update=adaptive).to_settings()
    first = SpecEngine(settings, target, drafter, pair_tokenizer)
    steer_by_the_file(first)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(prompt_ids):
        first.add_request(f"first-{i}", prompt, params)
    run_to_completion(first)
    captured = set(target.keys)
    target.keys.clear()
    second = SpecEngine(settings, target, drafter, pair_tokenizer, budget_policy=first.budget_policy)
    assert second.graph_shapes is first.graph_shapes is not None
    for i, prompt in enumerate(prompt_ids):
        second.add_request(f"second-{i}", prompt, params)
    run_to_completion(second)
    # Where the first engine drafted, the second keeps to its widths (elsewhere it chooses
    # freely, as the first did); plain steps' root-only verifies aside.
    known = {(batch, rows) for batch, width, rows in captured if width > 1}
    drafted = {(batch, width, rows) for batch, width, rows in target.keys if width > 1}
    again = {key for key in drafted if (key[0], key[2]) in known}
    assert again and again <= captured


def test_a_graph_key_is_new_once():
    shapes = VerifyGraphShapes(TOKEN_BUCKETS, max_seq_len=1024)
    assert shapes.record(2, 33, max_start=8)
    assert not shapes.record(2, 33, max_start=100)  # the same graph: batch 2, 33 nodes, 256 rows
    assert shapes.record(2, 20, max_start=100)  # the 32-node bucket's
    assert shapes.record(2, 33, max_start=240)  # 240 + 33 reads the 512-row bucket: a new graph
    assert not shapes.record(300, 33, max_start=8)  # no batch bucket: eager, nothing captured


def test_a_verify_that_captured_its_graph_teaches_no_cost():
    """A capture's ~18 ms verify, clamped as an outlier, still raised its cell of the cost curve
    by 30%, and the allocator then kept off that cell, so its price stayed: the step teaches
    neither the curve (nor its drift), nor the step overhead, nor its ceiling's ratio."""
    for captured_graph in (False, True):
        policy, tree, ceiling = confident_policy()
        before = policy.cost.grid_ms.copy()
        allocation = policy.choose(tree, [32])
        policy.record_verify_ms(18.0, captured_graph=captured_graph)
        policy.observe(tree.prefix(allocation.num_nodes), [[]])
        policy.record_step_ms(20.0)
        policy.learn()
        taught = not captured_graph
        assert (not np.array_equal(policy.cost.grid_ms, before)) == taught
        assert (policy.cost.drift != 1.0) == taught
        assert (policy.overhead.drafted_ms != 0.0) == taught
        assert (policy.gate.residual.ratio(1, ceiling) != 1.0) == taught


def test_the_engine_tells_the_policy_which_verifies_captured(
    make_pair_config, prompt_ids, pair_tokenizer, tmp_path
):
    """Exactly the steps whose verify met its graph key first (not captured at start-up, nor by
    an earlier step) are reported as captures: past the 256 cache rows every width is new."""
    config = make_pair_config(mode="ddtree", budget=16, max_num_seqs=3, max_seq_len=1024)
    target = GraphedTarget(build_target_step(config))
    moderate = tmp_path / "moderate.json"  # nodes priced so the allocator's widths vary (8-17)
    moderate.write_text(json.dumps({"tokens": [1, 64], "ms": [10.0, 30.0], "draft_ms": 1.0}))
    adaptive_config = config.model_copy(update={"budget_policy": "adaptive", "cost_curve": str(moderate)})
    engine = SpecEngine(adaptive_config.to_settings(), target, build_draft_step(config), pair_tokenizer)
    seen = set(target.keys)  # the start-up capture's (`graph_warmup`)
    target.keys.clear()
    steer_by_the_file(engine)
    policy = engine.budget_policy
    reported: list[bool] = []
    record_verify_ms = policy.record_verify_ms

    def recording(verify_ms: float, captured_graph: bool = False) -> None:
        reported.append(captured_graph)
        record_verify_ms(verify_ms, captured_graph)

    policy.record_verify_ms = recording
    params = SamplingParams(max_tokens=260, ignore_eos=True)
    for i, prompt in enumerate(prompt_ids):
        engine.add_request(str(i), prompt, params)
    run_to_completion(engine)
    expected = []
    for key in target.keys:
        expected.append(key is not None and key not in seen)
        seen.add(key)
    assert reported == expected
    assert any(expected) and not all(expected)
