"""The real Coordinator class over an injected engine on CPU (`sync_init`): no Serve, no Ray.

The prompt limit has one source, the engine, which knows how many cache rows one step's tree
takes: at and around that boundary the Coordinator and the engine give the same answer.
"""

import asyncio
from collections.abc import Iterator

import pytest

from ddtree_serve.engine.async_llm import AsyncLLM
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine
from ddtree_serve.models import load_tokenizer
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.coordinator import Coordinator
from ddtree_serve.serve.errors import ErrorKind, RequestError
from ddtree_serve.serve.group import start_workers
from ddtree_serve.serve.protocol import GenerationChunk, GenerationRequest
from tests.conftest import TinyModelDirs
from tests.serve.conftest import tiny_serve_config

pytestmark = pytest.mark.timeout(120)


def in_process_engine(config: ServeConfig) -> SpecEngine:
    target, drafter = start_workers(config)
    return SpecEngine(config.engine.to_settings(), target, drafter, load_tokenizer(config.engine.target))


def serve_config(dirs: TinyModelDirs, mode: str, **limits: int) -> ServeConfig:
    raw = tiny_serve_config(dirs, engine={"mode": mode}, placement={"workers": "in_process"}, limits=limits)
    return ServeConfig.model_validate(raw)


@pytest.fixture
def running_llms() -> Iterator[list[AsyncLLM]]:
    """Engine threads a test starts; shut down when it ends."""
    llms: list[AsyncLLM] = []
    yield llms
    for llm in llms:
        llm.shutdown()


def coordinator_over(config: ServeConfig, running_llms: list[AsyncLLM]) -> tuple[Coordinator, AsyncLLM]:
    llm = AsyncLLM(in_process_engine(config))
    running_llms.append(llm)
    return Coordinator.sync_init(config, llm), llm


async def collect(coordinator: Coordinator, request: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in coordinator.generate(request)]


def engine_accepts(engine: SpecEngine, request_id: str, prompt: str) -> bool:
    try:
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=1))
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("mode", ["ddtree", "chain", "ar"])
def test_prompts_at_the_boundary_get_the_same_answer_from_the_coordinator_and_the_engine(
    tiny_model_dirs: TinyModelDirs, mode: str, running_llms: list[AsyncLLM]
) -> None:
    config = serve_config(tiny_model_dirs, mode)
    engine = in_process_engine(config)
    coordinator, _ = coordinator_over(config, running_llms)
    limit = engine.max_prompt_tokens
    max_seq_len = config.engine.max_seq_len
    assert limit < max_seq_len - 1 or mode == "ar"  # the tree takes room beyond one token
    tokenizer = engine.tokenizer
    for num_tokens in sorted({limit - 1, limit, limit + 1, max_seq_len - 1, max_seq_len}):
        prompt = "Z" * num_tokens  # one token per "Z" in the tiny tokenizer
        assert len(tokenizer.encode(prompt).ids) == num_tokens
        accepted_by_engine = engine_accepts(engine, f"engine-{num_tokens}", prompt)
        assert accepted_by_engine == (num_tokens <= limit)
        request = GenerationRequest(f"coord-{num_tokens}", prompt, SamplingParams(max_tokens=1))
        try:
            chunks = asyncio.run(collect(coordinator, request))
        except RequestError as error:
            assert not accepted_by_engine, (
                f"{num_tokens} tokens: the engine accepts what the Coordinator refuses"
            )
            assert error.kind is ErrorKind.INVALID_ARGUMENT and error.param == "prompt"
            assert error.message.endswith(f"more than the limit of {limit}")  # the engine's limit
        else:
            assert accepted_by_engine, f"{num_tokens} tokens: the Coordinator accepts what the engine refuses"
            assert chunks[-1].finish_reason is not None and chunks[-1].usage is not None


@pytest.mark.parametrize("configured", [10, 100_000])
def test_a_configured_prompt_limit_only_lowers_the_engines(
    tiny_model_dirs: TinyModelDirs, configured: int, running_llms: list[AsyncLLM]
) -> None:
    config = serve_config(tiny_model_dirs, "ddtree", max_prompt_tokens=configured)
    coordinator, llm = coordinator_over(config, running_llms)
    limit = min(configured, llm.engine.max_prompt_tokens)
    request = GenerationRequest("long", "Z" * (limit + 1), SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match=f"more than the limit of {limit}$"):
        asyncio.run(collect(coordinator, request))
    fits = GenerationRequest("fits", "Z" * limit, SamplingParams(max_tokens=1))
    assert asyncio.run(collect(coordinator, fits))[-1].finish_reason is not None
