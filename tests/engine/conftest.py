"""Engines over the test model pair (bundled, else tiny random): real drafter or oracle drafter."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.engine.target_step import TargetStep
from ddtree_serve.models import TargetRunner, bundled_drafter_dir, bundled_target_dir, load_tokenizer
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


def run_joining_midway(
    engine: SpecEngine, prompts: list[list[int]], params: SamplingParams
) -> dict[str, list[int]]:
    """Adds request `i` for `prompts[i]` two steps after the one before (each joins a batch
    mid-generation), then steps until idle; final token ids per request id."""
    outputs: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        for _ in range(2):
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = list(output.token_ids)
    outputs.update(run_to_completion(engine))
    return outputs


def bundled_pair_present() -> bool:
    return (bundled_target_dir() / "config.json").exists() and (
        bundled_drafter_dir() / "config.json"
    ).exists()


@pytest.fixture(scope="session")
def pair_dirs(tiny_target_dir: Path, tiny_drafter_dir: Path) -> tuple[Path, Path]:
    """(target, drafter): the bundled pair once it is in the package, else the tiny random pair.

    The random target's greedy text repeats one token; the bundled one writes varied text.
    """
    if bundled_pair_present():
        return bundled_target_dir(), bundled_drafter_dir()
    return tiny_target_dir, tiny_drafter_dir


@pytest.fixture(scope="session")
def pair_tokenizer(pair_dirs: tuple[Path, Path]):
    return load_tokenizer(pair_dirs[0])


@pytest.fixture(scope="session")
def prompt_ids(pair_tokenizer) -> list[list[int]]:
    return [pair_tokenizer.encode(p).ids for p in PROMPTS]


@pytest.fixture(scope="session")
def make_pair_config(pair_dirs: tuple[Path, Path]) -> Callable[..., EngineConfig]:
    def make(**overrides) -> EngineConfig:
        return EngineConfig(target=str(pair_dirs[0]), drafter=str(pair_dirs[1]), **overrides)

    return make


@pytest.fixture(scope="session")
def greedy_references(make_pair_config, prompt_ids) -> dict[tuple[int, ...], list[int]]:
    """prompt -> prompt + greedy continuation, from plain ("ar") decoding."""
    from ddtree_serve.engine.local import build_local_engine

    engine = build_local_engine(make_pair_config(mode="ar", max_num_seqs=len(prompt_ids)))
    params = SamplingParams(max_tokens=REFERENCE_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompt_ids):
        engine.add_request(str(i), prompt, params)
    outputs = run_to_completion(engine)
    return {tuple(p): [*p, *outputs[str(i)]] for i, p in enumerate(prompt_ids)}


@pytest.fixture(scope="session")
def make_oracle_engine(
    pair_dirs: tuple[Path, Path], pair_tokenizer, greedy_references
) -> OracleEngineFactory:
    """SpecEngine over the real target and an `OracleDrafter` that knows the references."""
    target_dir = pair_dirs[0]

    def make(
        mode: str, budget: int = 8, max_num_seqs: int = 1, **settings
    ) -> tuple[SpecEngine, RecordingTarget]:
        config = EngineConfig(target=str(target_dir), mode="ar", max_num_seqs=max_num_seqs, budget=budget)
        runner = TargetRunner.from_pretrained(
            target_dir, num_slots=max_num_seqs, max_seq_len=config.max_seq_len, dtype=torch.float32
        )
        target = RecordingTarget(TargetStep(runner, verify_backend="torch"))
        drafter = OracleDrafter(target, greedy_references, vocab_size=runner.vocab_size)
        engine_settings = config.model_copy(update={"mode": mode, **settings}).to_settings()
        return SpecEngine(engine_settings, target, drafter, pair_tokenizer), target

    return make
