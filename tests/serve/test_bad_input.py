"""Bad input over HTTP and gRPC on the real app: each case gets its status and a message naming
what is wrong, none gets a 500 / INTERNAL / UNKNOWN, and a good stream running meanwhile ends
with the same greedy text as alone.

One local Ray cluster and app for the whole table (the tiny random pair from tests/conftest.py).
Bodies with lone surrogates or bad UTF-8 are sent as raw bytes: JSON encoders refuse to write them.
"""

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2

from ddtree_serve.engine.llm import LLM
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.serve.protos import DDTreeServeStub, pb2
from tests.conftest import TinyModelDirs
from tests.serve.conftest import ServeCluster, start_serve_cluster, tiny_serve_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MAX_SEQ_LEN = 1024
BUDGET = 16
CONTEXT_LENGTH = MAX_SEQ_LEN - BUDGET  # positions a request may fill: one padded tree stays free
GOOD_PROMPT = "def add(a, b):"
GOOD_MAX_TOKENS = 200
JSON_TYPE = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs: TinyModelDirs) -> Iterator[ServeCluster]:
    raw = tiny_serve_config(
        tiny_model_dirs,
        engine={"max_seq_len": MAX_SEQ_LEN, "budget": BUDGET, "max_num_seqs": 2, "max_queue_len": 1},
        limits={"max_prompt_chars": 20_000},
        observability={"metrics": False},
    )
    yield from start_serve_cluster(raw)


@dataclass(frozen=True)
class HttpCase:
    name: str
    body: dict[str, Any] | bytes | None  # bytes go out as they are, with JSON_TYPE unless headers say
    status: int
    param: str | None  # the error object's `param`
    fragment: str  # a piece of the message: the field (or what is expected) in words
    route: str = "/v1/completions"
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def raw(text: str) -> bytes:
    """A JSON body written by hand (escapes such as \\ud800 stay escapes)."""
    return text.encode()


LONG_PROMPT = "a " * 3000  # > MAX_SEQ_LEN tokens, < max_prompt_chars
CHAT = "/v1/chat/completions"
HTTP_CASES = [
    # the body itself
    HttpCase("not json", b"{not json", 400, None, "JSON"),
    HttpCase("json array", [1, 2], 400, None, "JSON object"),  # type: ignore[arg-type]
    HttpCase("empty body", b"", 400, "prompt", "prompt"),
    HttpCase("empty chat body", b"", 400, "messages", "messages", route=CHAT),
    HttpCase("text/plain body", b'{"prompt": "hi"}', 400, None, "JSON",
             headers={"content-type": "text/plain"}),
    HttpCase("form body (curl -d without -H)", b"prompt=hi", 400, None, "application/json",
             headers={"content-type": "application/x-www-form-urlencoded"}),
    HttpCase("body not UTF-8", b'{"prompt": "\xff\xfe"}', 400, None, "JSON"),
    # the prompt
    HttpCase("missing prompt", {"max_tokens": 4}, 400, "prompt", "prompt"),
    HttpCase("empty prompt", {"prompt": ""}, 400, "prompt", "prompt"),
    HttpCase("prompt not text", {"prompt": 42}, 400, "prompt", "prompt"),
    HttpCase("two prompts", {"prompt": ["a", "b"]}, 400, "prompt", "one prompt"),
    HttpCase("lone surrogate prompt", raw('{"prompt": "\\ud800"}'), 400, "prompt", "Unicode"),
    HttpCase("lone surrogate streamed prompt", raw('{"prompt": "x\\udc00", "stream": true}'), 400, "prompt",
             "Unicode"),
    HttpCase("lone surrogate in a prompt list", raw('{"prompt": ["\\ud800"]}'), 400, "prompt", "Unicode"),
    HttpCase("over-long prompt (tokens)", {"prompt": LONG_PROMPT}, 400, "prompt", "tokens"),
    HttpCase("over-long prompt (characters)", {"prompt": "x" * 20_001}, 400, "prompt", "characters"),
    HttpCase("token id beyond the vocabulary", {"prompt": [1, 2, 10**6]}, 400, "prompt", "token ids"),
    HttpCase("negative token id", {"prompt": [1, -2]}, 400, "prompt", "token ids"),
    HttpCase("boolean token id", {"prompt": [1, True]}, 400, "prompt", "token ids"),
    HttpCase("empty token list", {"prompt": []}, 400, "prompt", "prompt"),
    # max_tokens and the context
    HttpCase("max_tokens 0", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    HttpCase("max_tokens text", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
    HttpCase("max_tokens true", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens", "max_tokens"),
    HttpCase("max_tokens 4.5", {"prompt": "hi", "max_tokens": 4.5}, 400, "max_tokens", "max_tokens"),
    HttpCase("max_tokens past the context", {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens",
             f"maximum context length is {CONTEXT_LENGTH} tokens"),
    HttpCase("max_completion_tokens -3", chat(max_completion_tokens=-3), 400, "max_completion_tokens",
             "max_completion_tokens", route=CHAT),
    HttpCase("max_completion_tokens past the context", chat(max_completion_tokens=5000), 400,
             "max_completion_tokens", "in the completion", route=CHAT),
    # sampling
    HttpCase("negative temperature", {"prompt": "hi", "temperature": -1}, 400, "temperature", "[0, 2]"),
    HttpCase("temperature Infinity", raw('{"prompt": "hi", "temperature": Infinity}'), 400, "temperature",
             "finite"),
    HttpCase("temperature NaN", raw('{"prompt": "hi", "temperature": NaN}'), 400, "temperature", "finite"),
    HttpCase("temperature 1e308", {"prompt": "hi", "temperature": 1e308}, 400, "temperature", "[0, 2]"),
    HttpCase("temperature text", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "temperature"),
    HttpCase("top_p 0", {"prompt": "hi", "top_p": 0}, 400, "top_p", "(0, 1]"),
    HttpCase("top_p above 1", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    HttpCase("negative top_k", {"prompt": "hi", "top_k": -3}, 400, "top_k", "top_k"),
    HttpCase("top_k true", {"prompt": "hi", "top_k": True}, 400, "top_k", "top_k"),
    HttpCase("negative seed", {"prompt": "hi", "seed": -1}, 400, "seed", "seed"),
    HttpCase("seed past 64 bits", {"prompt": "hi", "seed": 2**64}, 400, "seed", "seed"),
    HttpCase("empty stop string", {"prompt": "hi", "stop": [""]}, 400, "stop", "stop"),
    HttpCase("stop not text", {"prompt": "hi", "stop": 5}, 400, "stop", "stop"),
    HttpCase("lone surrogate stop", raw('{"prompt": "hi", "stop": "\\ud800"}'), 400, "stop", "Unicode"),
    HttpCase("stream text", {"prompt": "hi", "stream": "yes"}, 400, "stream", "stream"),
    HttpCase("n = 2", {"prompt": "hi", "n": 2}, 400, "n", "n=1"),
    HttpCase("logprobs", {"prompt": "hi", "logprobs": 5}, 400, "logprobs", "logprobs"),
    HttpCase("presence_penalty", {"prompt": "hi", "presence_penalty": 1}, 400, "presence_penalty",
             "presence_penalty"),
    HttpCase("echo", {"prompt": "hi", "echo": True}, 400, "echo", "echo"),
    HttpCase("suffix", {"prompt": "hi", "suffix": "}"}, 400, "suffix", "suffix"),
    # the model
    HttpCase("unknown model", {"prompt": "hi", "model": "gpt-9"}, 404, "model", "gpt-9"),
    HttpCase("lone surrogate model", raw('{"prompt": "hi", "model": "\\ud800"}'), 400, "model", "Unicode"),
    HttpCase("chat unknown model", chat(model="x"), 404, "model", "does not exist", route=CHAT),
    # chat messages
    HttpCase("chat without messages", {"messages": []}, 400, "messages", "messages", route=CHAT),
    HttpCase("chat messages not a list", {"messages": "hi"}, 400, "messages", "messages", route=CHAT),
    HttpCase("chat bad role", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role",
             "role", route=CHAT),
    HttpCase("chat missing content", {"messages": [{"role": "user"}]}, 400, "messages.0.content",
             "messages.0.content", route=CHAT),
    HttpCase("chat lone surrogate content", raw('{"messages": [{"role": "user", "content": "\\ud800"}]}'),
             400, "messages.0.content", "Unicode", route=CHAT),
    HttpCase("chat lone surrogate role", raw('{"messages": [{"role": "\\udfff", "content": "x"}]}'),
             400, "messages.0.role", "Unicode", route=CHAT),
    # routes and methods
    HttpCase("unknown route", {"prompt": "hi"}, 404, None, "Invalid URL (POST /v1/complete)",
             route="/v1/complete"),
    HttpCase("unknown version", None, 404, None, "/v1/completions", route="/v2/models", method="GET"),
    HttpCase("GET on a POST route", None, 405, None, "allowed: POST", method="GET"),
    HttpCase("POST on a GET route", {}, 405, None, "allowed: GET", route="/v1/models"),
]  # fmt: skip


@dataclass(frozen=True)
class GrpcCase:
    name: str
    request: bytes  # the serialized request, possibly not a valid one
    code: grpc.StatusCode
    fragment: str  # in the status details: the field at fault
    method: str = "/ddtree_serve.v1.DDTreeServe/Complete"


def encoded(**fields: Any) -> bytes:
    return bytes(pb2.GenerateRequest(**fields).SerializeToString())


def not_utf8(message: Any) -> bytes:
    """`message` serialized with its one "é" (2 bytes) replaced by 2 bytes that are not UTF-8."""
    return bytes(message.SerializeToString().replace("é".encode(), b"\xc3\x28"))


def sampling(**fields: Any) -> Any:
    return pb2.SamplingParams(**fields)


INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
GRPC_CASES = [
    GrpcCase("bad UTF-8 prompt", not_utf8(pb2.GenerateRequest(prompt="é")), INVALID, "`prompt`"),
    GrpcCase("bad UTF-8 chat content", not_utf8(pb2.GenerateRequest(
        messages=[pb2.ChatMessage(role="user", content="é")])), INVALID, "messages[0].content"),
    GrpcCase("bad UTF-8 model", not_utf8(pb2.GenerateRequest(model="é", prompt="x")), INVALID, "`model`"),
    GrpcCase("bad UTF-8 stop", not_utf8(pb2.GenerateRequest(prompt="x", sampling=sampling(stop=["é"]))),
             INVALID, "sampling.stop[0]"),
    GrpcCase("truncated", encoded(prompt="hello")[:-2], INVALID, "truncated (in field `prompt`)"),
    GrpcCase("field number 0", b"\x00\x01" + encoded(prompt="x"), INVALID, "field number 0"),
    GrpcCase("health Check bad UTF-8", not_utf8(health_pb2.HealthCheckRequest(service="é")), INVALID,
             "`service`", method=HEALTH_CHECK),
    GrpcCase("health Check field 0", b"\x00\x01", INVALID, "field number 0", method=HEALTH_CHECK),
    GrpcCase("ModelInfo truncated", b"\x0a\x05ab", INVALID, "truncated",
             method="/ddtree_serve.v1.DDTreeServe/ModelInfo"),
    GrpcCase("100 KB request_id", encoded(prompt="x", request_id="r" * 100_000), INVALID, "request_id"),
    GrpcCase("empty prompt", encoded(), INVALID, "prompt"),
    GrpcCase("prompt and messages", encoded(prompt="x", messages=[pb2.ChatMessage(role="user", content="x")]),
             INVALID, "messages"),
    GrpcCase("prompt and token ids", encoded(prompt="x", prompt_token_ids=[1]), INVALID, "prompt_token_ids"),
    GrpcCase("bad role", encoded(messages=[pb2.ChatMessage(role="robot", content="x")]), INVALID, "role"),
    GrpcCase("token id beyond the vocabulary", encoded(prompt_token_ids=[1, 10**6]), INVALID, "token ids"),
    GrpcCase("negative token id", encoded(prompt_token_ids=[-1]), INVALID, "prompt_token_ids"),
    GrpcCase("max_tokens 0", encoded(prompt="x", sampling=sampling(max_tokens=0)), INVALID,
             "sampling.max_tokens"),
    GrpcCase("max_tokens past the context", encoded(prompt="x", sampling=sampling(max_tokens=10**6)),
             INVALID, f"maximum context length is {CONTEXT_LENGTH} tokens"),
    GrpcCase("temperature inf", encoded(prompt="x", sampling=sampling(temperature=float("inf"))), INVALID,
             "sampling.temperature"),
    GrpcCase("temperature NaN", encoded(prompt="x", sampling=sampling(temperature=float("nan"))), INVALID,
             "temperature must be a finite number"),
    GrpcCase("top_p above 1", encoded(prompt="x", sampling=sampling(top_p=2.0)), INVALID, "top_p"),
    GrpcCase("negative top_k", encoded(prompt="x", sampling=sampling(top_k=-1)), INVALID, "sampling.top_k"),
    GrpcCase("empty stop string", encoded(prompt="x", sampling=sampling(stop=[""])), INVALID, "stop"),
    GrpcCase("over-long prompt", encoded(prompt=LONG_PROMPT), INVALID, "prompt"),
    GrpcCase("unknown model", encoded(prompt="x", model="gpt-9"), NOT_FOUND, "gpt-9"),
]  # fmt: skip


def http_failure(client: httpx.Client, case: HttpCase) -> str | None:
    """What is wrong with the answer to `case`, or None when it is the documented refusal."""
    if isinstance(case.body, bytes):
        request: dict[str, Any] = {"content": case.body, "headers": {**JSON_TYPE, **case.headers}}
    elif case.body is None:
        request = {"headers": case.headers}
    else:
        request = {"json": case.body, "headers": case.headers}
    response = client.request(case.method, case.route, **request)
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code}, not an OpenAI error object: {response.text[:200]}"
    if (
        response.status_code != case.status
        or error.get("param") != case.param
        or case.fragment not in error.get("message", "")
        or error.get("code") != str(case.status)
    ):
        return f"{response.status_code} {error}"
    return None


def grpc_failure(channel: grpc.Channel, case: GrpcCase) -> list[str]:
    """The unary and (for Generate's request) the streaming call must both refuse alike."""
    failures = []
    methods = [case.method]
    if case.method.endswith("/Complete"):
        methods.append(case.method.replace("/Complete", "/Generate"))
    for method in methods:
        streaming = method.endswith("/Generate")
        call = (channel.unary_stream if streaming else channel.unary_unary)(method)  # bytes in, bytes out
        try:
            response = call(case.request, timeout=60)
            if streaming:
                list(response)  # a stream reports its status when drained
            failures.append(f"{method}: OK")
        except grpc.RpcError as error:
            if error.code() != case.code or case.fragment not in (error.details() or ""):
                failures.append(f"{method}: {error.code()} {error.details()!r}")
    return failures


def health(cluster: ServeCluster) -> dict[str, Any]:
    return httpx.get(f"{cluster.http_url}/health", timeout=10).json()


def wait_for(predicate: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    pytest.fail("condition not reached in time")


def test_the_tables_are_big_enough() -> None:
    assert len(HTTP_CASES) >= 40 and len(GRPC_CASES) >= 15
    assert len({case.name for case in HTTP_CASES}) == len(HTTP_CASES)


def test_every_bad_input_is_refused_as_documented_while_a_good_stream_completes(
    cluster: ServeCluster, reference: LLM
) -> None:
    good_params = SamplingParams(max_tokens=GOOD_MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = reference.generate(GOOD_PROMPT, good_params)[0]
    good: dict[str, Any] = {}

    def run_good_stream() -> None:
        body = {"prompt": GOOD_PROMPT, "max_tokens": GOOD_MAX_TOKENS, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{cluster.http_url}/v1/completions", json=body, timeout=240) as response:
            good["status"] = response.status_code
            good["lines"] = [line for line in response.iter_lines() if line.startswith("data: ")]

    worker = threading.Thread(target=run_good_stream)
    worker.start()
    wait_for(lambda: health(cluster)["running"] >= 1)
    failures: dict[str, Any] = {}
    with httpx.Client(base_url=cluster.http_url, timeout=60) as client:
        for case in HTTP_CASES:
            if problem := http_failure(client, case):
                failures[f"HTTP {case.name}"] = problem
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        for grpc_case in GRPC_CASES:
            if problems := grpc_failure(channel, grpc_case):
                failures[f"gRPC {grpc_case.name}"] = problems
    worker.join(timeout=240)
    assert failures == {}

    assert good["status"] == 200
    events = [json.loads(line[6:]) for line in good["lines"] if line != "data: [DONE]"]
    assert not any("error" in event for event in events)
    assert "".join(event["choices"][0]["text"] for event in events) == want.text
    assert events[0]["id"].startswith("cmpl-")


def test_token_id_prompts_generate_what_the_engine_generates_for_those_ids(
    cluster: ServeCluster, reference: LLM, stub_channel: grpc.Channel
) -> None:
    prompt_ids = reference.engine.tokenizer.encode(GOOD_PROMPT).ids
    want = reference.generate([prompt_ids], SamplingParams(max_tokens=12, temperature=0.0))[0]
    response = httpx.post(
        f"{cluster.http_url}/v1/completions", json={"prompt": prompt_ids, "max_tokens": 12}, timeout=60
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == want.text and body["id"].startswith("cmpl-")
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    chat_reply = httpx.post(f"{cluster.http_url}/v1/chat/completions", json=chat(max_tokens=4), timeout=60)
    assert chat_reply.json()["id"].startswith("chatcmpl-")
    unary = DDTreeServeStub(stub_channel).Complete(
        pb2.GenerateRequest(prompt_token_ids=prompt_ids, sampling=pb2.SamplingParams(max_tokens=12))
    )
    assert list(unary.token_ids) == want.token_ids


@pytest.fixture(scope="module")
def stub_channel(cluster: ServeCluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(cluster.grpc_target) as channel:
        yield channel


def test_a_full_queue_answers_503_with_retry_after(cluster: ServeCluster, stub_channel: grpc.Channel) -> None:
    """Two slots and a queue of one: three long streams leave no room for a fourth request."""
    stub = DDTreeServeStub(stub_channel)
    long = pb2.GenerateRequest(prompt="hi", sampling=pb2.SamplingParams(max_tokens=900, ignore_eos=True))
    held = [stub.Generate(long)]
    try:
        wait_for(lambda: health(cluster)["running"] == 1)
        held.append(stub.Generate(long))
        wait_for(lambda: health(cluster)["running"] == 2)
        held.append(stub.Generate(long))
        wait_for(lambda: health(cluster)["waiting"] == 1)
        refused = httpx.post(
            f"{cluster.http_url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60
        )
        assert refused.status_code == 503, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "overloaded_error"
    finally:
        for call in held:
            call.cancel()
    wait_for(lambda: (s := health(cluster))["running"] == 0 and s["waiting"] == 0)
