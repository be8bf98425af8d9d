"""The adaptive budget over real worker actors on a local Ray cluster (CPU): its start-up cost
calibration runs through the served step graph, and its steps decode plain decoding's tokens.

The calibration prefills scratch slots for every timed call; over the step graph each prefill
delivers its context features to the drafter's worker, which keeps them until a draft or a
release of the slot (`ddtree-serve serve --budget-policy adaptive` without a cost file once
failed to deploy on the deliveries it left behind).
"""

import shutil
import tempfile

import pytest
import ray

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.builder import target_dir
from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.models import load_tokenizer
from ddtree_serve.serve.compiled_graph import GraphTarget
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.group import start_workers
from tests.serve.conftest import run_schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ENGINE = EngineConfig(
    mode="ddtree", budget=8, max_num_seqs=3, max_seq_len=256, budget_policy="adaptive", cost_curve=None
)
PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n", "for i in range(10):"]


def test_the_adaptive_policy_calibrates_and_decodes_over_the_step_graph() -> None:
    temp_dir = tempfile.mkdtemp(prefix="ddtree-adaptive-")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir)
    try:
        target, drafter = start_workers(ServeConfig(engine=ENGINE))
        assert isinstance(target, GraphTarget)  # the default transport: the step graph
        try:
            engine = SpecEngine(ENGINE.to_settings(), target, drafter, load_tokenizer(target_dir(ENGINE)))
            assert engine.budget_policy is not None and engine.budget_policy.cost.draft_ms(1) > 0.0
            schedule = [
                (3 * i, f"r{i}", prompt, SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True))
                for i, (prompt, length) in enumerate(zip(PROMPTS, (30, 12, 24, 18), strict=True))
            ]
            plain = build_local_engine(ENGINE.model_copy(update={"mode": "ar", "budget_policy": "fixed"}))
            assert run_schedule(engine, schedule) == run_schedule(plain, schedule)
        finally:
            target.close()
            for worker in (target, drafter):
                if getattr(worker, "actor", None) is not None:
                    ray.kill(worker.actor)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
