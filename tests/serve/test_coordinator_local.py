"""Coordinator handle logic in Serve's local testing mode: no cluster, models in this process.

Fast checks of what the end-to-end tests cannot isolate: the chunk stream and its usage, the
error kinds the Coordinator raises, and that the step observer's phase spans reach the file.
"""

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from ray import serve

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.builder import TargetStepFactory
from ddtree_serve.engine.llm import LLM
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.coordinator import Coordinator
from ddtree_serve.serve.errors import ErrorKind, RequestError, as_request_error
from ddtree_serve.serve.protocol import GenerationChunk, GenerationRequest
from tests.conftest import TinyModelDirs
from tests.serve.conftest import tiny_serve_config

pytestmark = pytest.mark.timeout(120)


def local_coordinator(dirs: TinyModelDirs, target_factory: Any = None, **sections: Any) -> Any:
    raw = tiny_serve_config(dirs, placement={"workers": "in_process"}, **sections)
    raw["observability"] = {"metrics": False, **raw.get("observability", {})}
    config = ServeConfig.model_validate(raw)
    app = serve.deployment(Coordinator, name="Coordinator").bind(config, target_factory)
    return serve.run(app, name=f"local-{id(raw)}", route_prefix=None, _local_testing_mode=True), config


async def collect(handle: Any, request: GenerationRequest) -> list[GenerationChunk]:
    return [chunk async for chunk in handle.options(stream=True).generate.remote(request)]


def test_stream_of_chunks_equals_the_in_process_engine_and_ends_with_usage(
    tiny_model_dirs: TinyModelDirs,
) -> None:
    handle, config = local_coordinator(tiny_model_dirs)
    params = SamplingParams(max_tokens=20)
    want = LLM.from_config(EngineConfig.model_validate(config.engine.model_dump())).generate(
        "def add(a, b):", params
    )[0]
    chunks = asyncio.run(collect(handle, GenerationRequest("r1", "def add(a, b):", params)))
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    assert "".join(c.text for c in chunks) == want.text
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].finish_reason == want.finish_reason and usage is not None
    assert usage.completion_tokens == len(want.token_ids) and usage.num_steps >= 1
    stats = handle.stats.remote().result()
    assert stats["running"] == stats["waiting"] == stats["open_streams"] == 0
    assert stats["engine_steps"] >= usage.num_steps and stats["engine_step_seconds"] > 0.0


@pytest.mark.parametrize(
    ("engine", "prompt", "kind"),
    [
        ({"max_queue_len": 0}, "hi", ErrorKind.OVERLOADED),  # a queue of 0 refuses everything
        ({}, "a " * 600, ErrorKind.INVALID_ARGUMENT),  # longer than max_seq_len
    ],
)
def test_refusals_carry_their_error_kind(
    tiny_model_dirs: TinyModelDirs, engine: dict, prompt: str, kind: ErrorKind
) -> None:
    handle, _ = local_coordinator(tiny_model_dirs, engine=engine)
    with pytest.raises(Exception) as raised:
        asyncio.run(collect(handle, GenerationRequest("bad", prompt, SamplingParams(max_tokens=4))))
    error = as_request_error(raised.value)
    assert isinstance(error, RequestError) and error.kind is kind and error.message


def test_request_and_phase_spans_reach_the_file_exporter(
    tiny_model_dirs: TinyModelDirs, tmp_path: Path
) -> None:
    spans_path = tmp_path / "spans.jsonl"
    handle, _ = local_coordinator(
        tiny_model_dirs, observability={"tracing": {"exporter": "file", "file_path": str(spans_path)}}
    )
    carrier = {"traceparent": "00-11111111111111111111111111111111-2222222222222222-01"}
    asyncio.run(collect(handle, GenerationRequest("traced", "hi", SamplingParams(max_tokens=6), carrier)))
    spans = [json.loads(line) for line in spans_path.read_text().splitlines()]
    request = next(s for s in spans if s["name"] == "ddtree.request")
    assert request["parent_id"] == "0x2222222222222222"
    assert request["attributes"]["request_id"] == "traced"
    phases = {s["name"] for s in spans if s["parent_id"] == request["context"]["span_id"]}
    assert {"prefill", "draft", "build", "verify", "append"} <= phases


class _BrokenVerifyFactory(TargetStepFactory):
    """The real target, except that every verify fails (a lost device, say)."""

    def __call__(self) -> Any:
        target = super().__call__()

        def broken_verify(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("device lost")

        target.verify_and_commit = broken_verify  # type: ignore[method-assign]
        return target


def test_a_dead_engine_fails_requests_and_the_health_probe(tiny_model_dirs: TinyModelDirs) -> None:
    """/health and gRPC Check probe `stats`: it must not report a group whose engine stopped."""
    raw = tiny_serve_config(tiny_model_dirs)
    factory = _BrokenVerifyFactory(ServeConfig.model_validate(raw).engine)
    handle, _ = local_coordinator(tiny_model_dirs, target_factory=factory)
    with pytest.raises(Exception) as raised:
        asyncio.run(collect(handle, GenerationRequest("dies", "hi", SamplingParams(max_tokens=8))))
    error = as_request_error(raised.value)
    assert isinstance(error, RequestError) and error.kind is ErrorKind.INTERNAL
    with pytest.raises(Exception, match="engine"):
        handle.stats.remote().result()
