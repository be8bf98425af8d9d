"""The step observer's record: the tokens each request's verify produced, as integers.

With no stop condition before max_tokens, a request's output grows by exactly its verified
tokens each step (plus the prefill token once), an independent count to check them against.
The bundled (trained) pair makes steps of several tokens, so the counts differ step to step.
"""

import json
from pathlib import Path

from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.models import bundled_target_dir, load_tokenizer
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.group import start_workers
from ddtree_serve.serve.observed_engine import ObservedEngine, StepRecord


def observed_engine(config: ServeConfig) -> tuple[ObservedEngine, list[StepRecord]]:
    """An engine over the config's in-process workers, and the list its step records go to."""
    target, drafter = start_workers(config)
    records: list[StepRecord] = []
    engine = ObservedEngine(
        config.engine.to_settings(),
        target,
        drafter,
        load_tokenizer(bundled_target_dir()),
        observer=records.append,
    )
    return engine, records


def test_step_records_count_each_requests_verified_tokens() -> None:
    config = ServeConfig.model_validate(
        {
            "engine": {"max_seq_len": 256, "max_num_seqs": 4, "budget": 16},
            "placement": {"workers": "in_process"},
        }
    )
    engine, records = observed_engine(config)
    max_tokens = {"a": 30, "b": 45, "c": 12}
    prompts = ["def add(a, b):", "for i in range(10):", "import os"]
    for request_id, prompt in zip(max_tokens, prompts, strict=True):
        engine.add_request(
            request_id, prompt, SamplingParams(max_tokens=max_tokens[request_id], ignore_eos=True)
        )
    verified = dict.fromkeys(max_tokens, 0)
    steps = dict.fromkeys(max_tokens, 0)
    while engine.has_unfinished_requests():
        engine.step()
        record = records[-1]
        assert set(record.num_step_tokens) == {output.request_id for output in record.outputs}
        for output in record.outputs:
            num_tokens = record.num_step_tokens[output.request_id]
            assert 1 <= num_tokens <= engine.block_size
            verified[output.request_id] += num_tokens
            steps[output.request_id] += 1
            if output.finished:  # max_tokens cut the last step's tokens
                assert (
                    len(output.token_ids) == max_tokens[output.request_id] <= 1 + verified[output.request_id]
                )
                assert output.stats.steps == steps[output.request_id]
            else:
                assert len(output.token_ids) == 1 + verified[output.request_id]
    assert [record.index for record in records] == list(range(1, len(records) + 1))
    assert len({n for record in records for n in record.num_step_tokens.values()}) > 1
    assert all(record.budget is None for record in records)  # the fixed policy reports no choice


def test_step_records_carry_the_adaptive_budgets_choice_of_that_step(tmp_path: Path) -> None:
    """A drafter costly enough that most steps decode plainly: both kinds of step are reported."""
    cost_file = tmp_path / "costly_drafter.json"
    cost_file.write_text(json.dumps({"tokens": [1, 4096], "ms": [10.0, 10.0], "draft_ms": 1000.0}))
    config = ServeConfig.model_validate(
        {
            "engine": {
                "max_seq_len": 256,
                "max_num_seqs": 2,
                "budget": 8,
                "budget_policy": "adaptive",
                "cost_curve": str(cost_file),
            },
            "placement": {"workers": "in_process"},
        }
    )
    engine, records = observed_engine(config)
    for request_id, prompt in (("a", "def add(a, b):"), ("b", "import os")):
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        record = records[-1]
        assert record.budget is engine.budget_policy.last_step  # this step's own record
        assert len(record.budget.num_nodes) == len(record.num_step_tokens)
        for output in record.outputs:  # tokens = accepted drafts + the bonus (before max_tokens cuts)
            assert record.num_step_tokens[output.request_id] >= 1
        assert sum(record.num_step_tokens.values()) == record.budget.accepted + len(record.num_step_tokens)
    drafted = [record.budget.drafted for record in records]
    assert any(drafted) and not all(drafted)
