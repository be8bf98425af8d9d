"""End to end: a real local Ray cluster, the deployed application, real HTTP and gRPC clients.

One cluster for the whole module (fake GPUs: the drafter and the target each take a GPU bundle,
so the placement group must really be formed). Models: the tiny random pair from
tests/conftest.py, so outputs are gibberish but exactly comparable with the in-process engine.
"""

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.llm import LLM
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.models.chat_template import CHATML_TEMPLATE, ChatTemplate
from ddtree_serve.serve.protos import SERVICE_NAME, DDTreeServeStub, pb2
from tests.conftest import TinyModelDirs
from tests.serve.conftest import ServeCluster, on_two_fake_gpus, start_serve_cluster, tiny_serve_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["def add(a, b):", "The quick brown fox", "import os\nimport sys", "for i in range(10):"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def spans_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spans") / "spans.jsonl"


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs: TinyModelDirs, spans_path: Path) -> Iterator[ServeCluster]:
    raw = tiny_serve_config(
        tiny_model_dirs,
        # Room for ~1000-token requests: the backpressure test needs streams that outlast it.
        engine={"max_seq_len": 1024},
        placement=on_two_fake_gpus(),
        observability={"metrics": True, "tracing": {"exporter": "file", "file_path": str(spans_path)}},
    )
    yield from start_serve_cluster(raw, num_gpus=2)


@pytest.fixture(scope="module")
def stub(cluster: ServeCluster) -> Iterator[Any]:
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        yield DDTreeServeStub(channel)


def greedy(max_tokens: int = MAX_TOKENS, **extra: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line.removeprefix("data: ")))
    return events


def wait_for(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    pytest.fail("condition not reached in time")


def stats(cluster: ServeCluster) -> dict[str, int]:
    return httpx.get(f"{cluster.http_url}/health", timeout=10).json()


# ---------------------------------------------------------------------------------- HTTP


def test_http_completion_greedy_equals_in_process_engine(cluster: ServeCluster, reference: LLM) -> None:
    expected = reference.generate(PROMPTS[:2], greedy())
    for prompt, want in zip(PROMPTS[:2], expected, strict=True):
        response = httpx.post(
            f"{cluster.http_url}/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
            headers={"x-request-id": f"req-{len(prompt)}"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["id"] == f"cmpl-req-{len(prompt)}" == f"cmpl-{response.headers['x-request-id']}"
        assert body["choices"][0]["text"] == want.text
        assert body["choices"][0]["finish_reason"] == want.finish_reason
        usage = body["usage"]
        assert usage["completion_tokens"] == len(want.token_ids)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["num_steps"] >= 1 and 1.0 <= usage["acceptance_length"] <= 8.0


def test_http_streaming_events_concatenate_to_the_engine_text(cluster: ServeCluster, reference: LLM) -> None:
    want = reference.generate(PROMPTS[2], greedy())[0]
    body = {
        "prompt": PROMPTS[2],
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    text_events = [e for e in events if e["choices"]]
    assert len(text_events) >= 2  # streamed (the first chunk is never held back), not one at the end
    assert "".join(e["choices"][0]["text"] for e in text_events) == want.text
    assert text_events[-1]["choices"][0]["finish_reason"] == want.finish_reason
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(want.token_ids)


def test_chat_streaming_and_not_streaming_equal_the_engine_on_the_chatml_prompt(
    cluster: ServeCluster, reference: LLM
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    chatml = ChatTemplate.from_dir(cluster.config.engine.target)
    assert chatml.source == CHATML_TEMPLATE  # the tiny target ships no template of its own
    want = reference.generate(chatml.render(messages), greedy(stop=(chatml.end_of_turn_text(),)))[0]
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS}
    whole = httpx.post(f"{cluster.http_url}/v1/chat/completions", json=body, timeout=60).json()
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    assert whole["usage"]["acceptance_length"] >= 1.0
    with httpx.stream(
        "POST", f"{cluster.http_url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        events = sse_events(response)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"]["content"] for e in events) == want.text


def test_models_and_health(cluster: ServeCluster) -> None:
    models = httpx.get(f"{cluster.http_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 1024  # the cluster's engine.max_seq_len
    health = stats(cluster)
    assert health["status"] == "ok" and health["max_num_seqs"] == 4


def test_openai_client_streams_a_completion(cluster: ServeCluster, reference: LLM) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused")
    want = reference.generate(PROMPTS[0], greedy())[0]
    stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want.text


# ---------------------------------------------------------------------------------- gRPC


def test_grpc_generate_streams_the_engine_tokens(cluster: ServeCluster, stub: Any, reference: LLM) -> None:
    want = reference.generate(PROMPTS[3], greedy())[0]
    request = pb2.GenerateRequest(
        model="tiny", prompt=PROMPTS[3], sampling=pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    )
    call = stub.Generate(request, metadata=[("x-request-id", "grpc-stream-1")])
    chunks = list(call)
    assert len(chunks) >= 2
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    assert "".join(c.text for c in chunks) == want.text
    assert chunks[-1].finish_reason == want.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(c.request_id == "grpc-stream-1" for c in chunks)
    assert ("x-request-id", "grpc-stream-1") in call.trailing_metadata()


def test_grpc_complete_and_model_info(stub: Any, reference: LLM) -> None:
    want = reference.generate(PROMPTS[1], greedy())[0]
    response = stub.Complete(
        pb2.GenerateRequest(
            prompt=PROMPTS[1], request_id="unary-1", sampling=pb2.SamplingParams(max_tokens=MAX_TOKENS)
        )
    )
    assert list(response.token_ids) == want.token_ids and response.text == want.text
    assert response.request_id == "unary-1" and response.usage.acceptance_length >= 1.0
    info = stub.ModelInfo(pb2.ModelInfoRequest())
    assert (info.model, info.draft_mode, info.block_size, info.tree_budget) == ("tiny", "ddtree", 8, 16)


def test_grpc_health_checking_and_reflection(cluster: ServeCluster) -> None:
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            response = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as error:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        reflection = ProtoReflectionDescriptorDatabase(channel)
        services = set(reflection.get_services())
        # What grpcurl needs to call a method it has never seen: the file that defines it.
        generate_file = reflection.FindFileContainingSymbol(SERVICE_NAME)
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= services
    assert "GenerateChunk" in {message.name for message in generate_file.message_type}


# ----------------------------------------------------------------------------- concurrency


def test_eight_concurrent_streams_over_both_protocols_all_complete_correctly(
    cluster: ServeCluster, reference: LLM
) -> None:
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(8)]
    expected = reference.generate(prompts, greedy())

    async def http_stream(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}
        async with client.stream("POST", f"{cluster.http_url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            parts = []
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    parts.append(json.loads(line[6:])["choices"][0]["text"])
            return "".join(parts)

    async def grpc_stream(stub: Any, prompt: str) -> str:
        request = pb2.GenerateRequest(prompt=prompt, sampling=pb2.SamplingParams(max_tokens=MAX_TOKENS))
        return "".join([chunk.text async for chunk in stub.Generate(request)])

    async def run_all() -> list[str]:
        async with (
            httpx.AsyncClient(timeout=120) as client,
            grpc.aio.insecure_channel(cluster.grpc_target) as channel,
        ):
            stub = DDTreeServeStub(channel)
            jobs = [
                http_stream(client, p) if i % 2 == 0 else grpc_stream(stub, p) for i, p in enumerate(prompts)
            ]
            return await asyncio.gather(*jobs)

    texts = asyncio.run(run_all())
    assert texts == [e.text for e in expected]


class HeldStreams:
    """Long HTTP streams opened concurrently on a background event loop and held until `close`.

    Queued requests get no response headers until they hold a slot, so each stream needs its
    own task; cancelling the tasks drops the connections the way a client that goes away does.
    """

    def __init__(self, url: str, body: dict[str, Any], count: int) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._client = httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=count + 1))
        self._tasks = [
            asyncio.run_coroutine_threadsafe(self._hold(url, body), self._loop) for _ in range(count)
        ]

    async def _hold(self, url: str, body: dict[str, Any]) -> None:
        async with self._client.stream("POST", url, json=body) as response:
            assert response.status_code == 200
            await asyncio.Event().wait()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


def test_backpressure_and_cancelled_streams_free_their_slots(cluster: ServeCluster, stub: Any) -> None:
    """Fill 4 slots and the queue of 8 with long streams, get refused, then disconnect them all."""
    long_body = {"prompt": PROMPTS[0], "max_tokens": 900, "ignore_eos": True, "stream": True}
    cancelled_before = stats(cluster)["cancelled"]
    url = f"{cluster.http_url}/v1/completions"
    # The engine counts admitted-but-unscheduled requests against its queue: fill the slots
    # first, then the queue, so none of the 12 is refused.
    held = [HeldStreams(url, long_body, count=4)]
    try:
        wait_for(lambda: stats(cluster)["running"] == 4)
        held.append(HeldStreams(url, long_body, count=8))
        wait_for(lambda: (s := stats(cluster))["running"] == 4 and s["waiting"] == 8)
        refused = httpx.post(
            f"{cluster.http_url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60
        )
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "overloaded_error"
        with pytest.raises(grpc.RpcError) as error:
            stub.Complete(pb2.GenerateRequest(prompt="hi", sampling=pb2.SamplingParams(max_tokens=4)))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for streams in held:
            streams.close()
    # 3 rounds of 4 x 900 tokens take far longer: the slots come back because of the cancels.
    wait_for(lambda: (s := stats(cluster))["running"] == 0 and s["waiting"] == 0 and s["open_streams"] == 0)
    assert stats(cluster)["cancelled"] - cancelled_before == 12
    ok = httpx.post(f"{cluster.http_url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200


# ------------------------------------------------------------------------------ bad inputs

LONG_PROMPT = "a " * 3000  # > max_seq_len (1024) tokens
HTTP_BAD_INPUTS: list[tuple[str, str, Any, int, str | None]] = [
    # (case, route, body (bytes = raw), status, offending param or None)
    ("not json", "/v1/completions", b"{not json", 400, None),
    ("json array", "/v1/completions", [1, 2], 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("prompt not text", "/v1/completions", {"prompt": 42}, 400, None),
    ("two prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("over-long prompt", "/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    ("max_tokens 0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, None),
    ("max_tokens text", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, None),
    ("top_p 0", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, None),
    ("top_p above 1", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, None),
    ("negative top_k", "/v1/completions", {"prompt": "hi", "top_k": -3}, 400, None),
    ("n = 2", "/v1/completions", {"prompt": "hi", "n": 2}, 400, "n"),
    ("logprobs", "/v1/completions", {"prompt": "hi", "logprobs": 5}, 400, "logprobs"),
    ("empty stop string", "/v1/completions", {"prompt": "hi", "stop": [""]}, 400, None),
    ("unknown model", "/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ("chat without messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "chat bad role",
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages.0.role",
    ),
    (
        "chat unknown model",
        "/v1/chat/completions",
        {"model": "x", "messages": [{"role": "user", "content": "x"}]},
        404,
        "model",
    ),
]
GRPC_BAD_INPUTS: list[tuple[str, dict[str, Any], grpc.StatusCode]] = [
    ("empty prompt", {"prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT),
    (
        "prompt and messages",
        {"prompt": "x", "messages": [pb2.ChatMessage(role="user", content="x")]},
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "bad role",
        {"messages": [pb2.ChatMessage(role="robot", content="x")]},
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "max_tokens 0",
        {"prompt": "x", "sampling": pb2.SamplingParams(max_tokens=0)},
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "top_p above 1",
        {"prompt": "x", "sampling": pb2.SamplingParams(top_p=2.0)},
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    ("over-long prompt", {"prompt": LONG_PROMPT}, grpc.StatusCode.INVALID_ARGUMENT),
    ("unknown model", {"prompt": "x", "model": "gpt-9"}, grpc.StatusCode.NOT_FOUND),
]


def test_bad_inputs_get_their_documented_errors_while_a_good_request_completes(
    cluster: ServeCluster, stub: Any
) -> None:
    good: dict[str, Any] = {}

    def run_good_request() -> None:
        body = {"prompt": PROMPTS[0], "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body, timeout=120) as response:
            good["events"] = sse_events(response)

    worker = threading.Thread(target=run_good_request)
    worker.start()
    wait_for(lambda: stats(cluster)["running"] >= 1)
    failures = []
    for case, route, body, status, param in HTTP_BAD_INPUTS:
        kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
        response = httpx.post(f"{cluster.http_url}{route}", timeout=60, **kwargs)
        error = response.json().get("error", {})
        if (
            response.status_code != status
            or not error.get("message")
            or (param and error.get("param") != param)
        ):
            failures.append((case, response.status_code, response.text[:200]))
    for case, fields, code in GRPC_BAD_INPUTS:
        for rpc in ("Complete", "Generate"):  # unary and server-streaming refuse alike
            try:
                response = getattr(stub, rpc)(pb2.GenerateRequest(**fields))
                if rpc == "Generate":
                    list(response)  # a stream reports its status when drained
                failures.append((f"{case} ({rpc})", "OK", ""))
            except grpc.RpcError as error:
                if error.code() != code or not error.details():
                    failures.append((f"{case} ({rpc})", error.code(), error.details()))
    worker.join(timeout=120)
    assert failures == []
    text_events = [e for e in good["events"] if e.get("choices")]
    assert text_events[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("error" in e for e in good["events"])


# --------------------------------------------------------------------------- observability


def test_metrics_appear_on_rays_metrics_endpoint(cluster: ServeCluster) -> None:
    wanted = [
        r"ray_ddtree_acceptance_length_bucket\{",
        r'ray_ddtree_step_phase_seconds_count\{[^}]*phase="verify"',
        r'ray_ddtree_step_phase_seconds_count\{[^}]*phase="draft"',
        r"ray_ddtree_accepted_tokens_per_step_bucket",
        r"ray_ddtree_tokens_per_step_bucket",
        r"ray_ddtree_active_requests\{",
        r"ray_ddtree_queued_requests\{",
        r"ray_ddtree_tree_budget\{[^}]*\} 16",
        r'ray_ddtree_finished_requests_total\{[^}]*finish_reason="length"',
    ]

    def all_present() -> bool:
        text = httpx.get(cluster.metrics_url, timeout=10).text
        return all(re.search(pattern, text) for pattern in wanted)

    wait_for(all_present, timeout_s=60)


def test_spans_are_parented_to_the_callers_trace_and_cover_every_phase(
    cluster: ServeCluster, spans_path: Path
) -> None:
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    traceparent = f"00-{trace_id}-{parent_id}-01"
    response = httpx.post(
        f"{cluster.http_url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 8},
        headers={"traceparent": traceparent},
        timeout=60,
    )
    assert response.status_code == 200
    grpc_trace_id = "0af7651916cd43dd8448eb211c80319c"
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        DDTreeServeStub(channel).Complete(
            pb2.GenerateRequest(prompt="hi", sampling=pb2.SamplingParams(max_tokens=8)),
            metadata=[("traceparent", f"00-{grpc_trace_id}-b7ad6b7169203331-01")],
        )

    def spans_of(trace: str) -> list[dict[str, Any]]:
        lines = spans_path.read_text().splitlines() if spans_path.exists() else []
        return [s for s in map(json.loads, lines) if s["context"]["trace_id"] == f"0x{trace}"]

    wait_for(lambda: {"append", "ddtree.request"} <= {s["name"] for s in spans_of(trace_id)})
    spans = spans_of(trace_id)
    by_name = {s["name"]: s for s in spans}
    ingress = by_name["POST /v1/completions"]
    request = by_name["ddtree.request"]
    assert ingress["parent_id"] == f"0x{parent_id}"
    assert request["parent_id"] == ingress["context"]["span_id"]
    assert request["attributes"]["ddtree.acceptance_length"] >= 1.0
    for phase in ("draft", "build", "verify", "append"):
        phase_spans = [s for s in spans if s["name"] == phase]
        assert phase_spans and all(s["parent_id"] == request["context"]["span_id"] for s in phase_spans)
    wait_for(
        lambda: {"grpc Complete", "ddtree.request", "verify"} <= {s["name"] for s in spans_of(grpc_trace_id)}
    )


def test_the_speculation_group_is_one_placement_group_with_gpu_bundles(cluster: ServeCluster) -> None:
    import ray

    expected = [{"CPU": 0.25}, {"CPU": 0.25, "GPU": 1.0}, {"CPU": 0.25, "GPU": 1.0}]
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    bundles = [[dict(b) for b in g["bundles"].values()] for g in groups]
    assert expected in bundles
    assert ray.available_resources().get("GPU", 0) == 0  # both fake GPUs are held by the workers


def test_actor_adapters_forward_context_as_an_object_ref_and_match_in_process_models(
    cluster: ServeCluster, tiny_model_dirs: TinyModelDirs
) -> None:
    """Prefill on a TargetWorker, draft on a DrafterWorker from the ref alone, vs the same in process."""
    import ray
    import torch

    from ddtree_serve.engine.builder import DraftStepFactory, TargetStepFactory
    from ddtree_serve.engine.interfaces import ContextSlice, DraftInput, PrefillInput, SamplingBatch
    from ddtree_serve.serve.workers import DrafterWorker, RayDrafter, RayTarget, TargetWorker

    engine_config = EngineConfig.model_validate(cluster.config.engine.model_dump())
    target_factory, drafter_factory = TargetStepFactory(engine_config), DraftStepFactory(engine_config)
    remote_target = RayTarget(TargetWorker.options(num_cpus=0.01).remote(target_factory))
    remote_drafter = RayDrafter(DrafterWorker.options(num_cpus=0.01).remote(drafter_factory))
    local_target, local_drafter = target_factory(), drafter_factory()
    assert (remote_target.vocab_size, remote_target.max_seq_len) == (
        local_target.vocab_size,
        local_target.max_seq_len,
    )
    assert remote_drafter.block_size == local_drafter.block_size == 8

    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    greedy_batch = SamplingBatch(
        temperature=torch.zeros(2),
        top_k=torch.zeros(2, dtype=torch.int64),
        top_p=torch.ones(2),
        all_greedy=True,
    )
    outputs = []
    for target, drafter in ((remote_target, remote_drafter), (local_target, local_drafter)):
        prefill = target.prefill(PrefillInput([0, 1], prompts, greedy_batch, None))
        contexts = [[ContextSlice(prefill.context, i)] for i in range(2)]
        outputs.append((prefill, drafter.draft(DraftInput([0, 1], prefill.first_tokens, contexts, top_k=4))))
    (remote_prefill, remote_draft), (local_prefill, local_draft) = outputs
    assert isinstance(remote_prefill.context, ray.ObjectRef)  # the coordinator holds a reference
    assert torch.equal(remote_prefill.first_tokens, local_prefill.first_tokens)
    assert torch.equal(remote_draft.ids, local_draft.ids)
    torch.testing.assert_close(remote_draft.logp, local_draft.logp)


def test_a_remote_verify_runs_the_engines_hook_once_and_returns_what_it_would_without(
    cluster: ServeCluster, tiny_model_dirs: TinyModelDirs
) -> None:
    """`RayTarget` is an `AsyncDeviceTarget`: the engine's host work runs once per verify, after
    the call went out, and the verdict is the one a verify without it returns."""
    import torch

    from ddtree_serve.engine.builder import TargetStepFactory
    from ddtree_serve.engine.interfaces import PrefillInput, SamplingBatch, VerifyInput
    from ddtree_serve.serve.workers import RayTarget, TargetWorker
    from ddtree_serve.tree import TreeBatch

    engine_config = EngineConfig.model_validate(cluster.config.engine.model_dump())
    remote_target = RayTarget(TargetWorker.options(num_cpus=0.01).remote(TargetStepFactory(engine_config)))
    greedy = SamplingBatch(
        temperature=torch.zeros(1),
        top_k=torch.zeros(1, dtype=torch.int64),
        top_p=torch.ones(1),
        all_greedy=True,
    )
    bonus_tokens, hooked = [], []
    for slot, hook in ((0, lambda: hooked.append(True)), (1, None)):  # the same prompt twice
        prefill = remote_target.prefill(PrefillInput([slot], [[5, 6, 7, 8]], greedy, None))
        roots = TreeBatch.root_only(prefill.first_tokens.tolist()).verify_batch()
        remote_target.while_verifying = hook
        inputs = VerifyInput([slot], roots, greedy, None, None, return_context=False)
        verdict = remote_target.verify_and_commit(inputs)
        bonus_tokens.append(verdict.bonus_token.tolist())
    assert hooked == [True]
    assert bonus_tokens[0] == bonus_tokens[1]
