"""Engines over the tiny random pair: plain (real drafter) and with the oracle drafter."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.local import LocalTarget
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.models import TargetRunner, load_tokenizer
from tests.engine.fakes import OracleDrafter, RecordingTarget

PROMPTS = ["def add(a, b):", "The quick brown fox", "import os\nimport sys\n"]
REFERENCE_TOKENS = 24  # greedy continuation length the oracle knows

OracleEngineFactory = Callable[..., tuple[SpecEngine, RecordingTarget]]


def run_to_completion(engine: SpecEngine) -> dict[str, list[int]]:
    """Step until idle; final token ids per request id."""
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.token_ids)
    return finished


@pytest.fixture(scope="session")
def tiny_tokenizer_from_dir(tiny_target_dir: Path):
    return load_tokenizer(tiny_target_dir)


@pytest.fixture(scope="session")
def prompt_ids(tiny_tokenizer_from_dir) -> list[list[int]]:
    return [tiny_tokenizer_from_dir.encode(p).ids for p in PROMPTS]


@pytest.fixture(scope="session")
def make_tiny_config(tiny_target_dir: Path, tiny_drafter_dir: Path) -> Callable[..., EngineConfig]:
    def make(**overrides) -> EngineConfig:
        return EngineConfig(target=str(tiny_target_dir), drafter=str(tiny_drafter_dir), **overrides)

    return make


@pytest.fixture(scope="session")
def greedy_references(make_tiny_config, prompt_ids) -> dict[tuple[int, ...], list[int]]:
    """prompt -> prompt + greedy continuation, from plain ("ar") decoding."""
    from ddtree_serve.engine.local import build_local_engine

    engine = build_local_engine(make_tiny_config(mode="ar", max_num_seqs=len(prompt_ids)))
    params = SamplingParams(max_tokens=REFERENCE_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompt_ids):
        engine.add_request(str(i), prompt, params)
    outputs = run_to_completion(engine)
    return {tuple(p): [*p, *outputs[str(i)]] for i, p in enumerate(prompt_ids)}


@pytest.fixture(scope="session")
def make_oracle_engine(
    tiny_target_dir: Path, tiny_tokenizer_from_dir, greedy_references
) -> OracleEngineFactory:
    """SpecEngine over the real tiny target and an `OracleDrafter` that knows the references."""

    def make(
        mode: str, budget: int = 8, max_num_seqs: int = 1, **settings
    ) -> tuple[SpecEngine, RecordingTarget]:
        config = EngineConfig(
            target=str(tiny_target_dir), mode="ar", max_num_seqs=max_num_seqs, budget=budget
        )
        runner = TargetRunner.from_pretrained(
            tiny_target_dir, num_slots=max_num_seqs, max_seq_len=config.max_seq_len, dtype=torch.float32
        )
        target = RecordingTarget(LocalTarget(runner, verify_backend="torch"))
        drafter = OracleDrafter(target, greedy_references, vocab_size=runner.vocab_size)
        engine_settings = config.model_copy(update={"mode": mode, **settings}).to_settings()
        return SpecEngine(engine_settings, target, drafter, tiny_tokenizer_from_dir), target

    return make
