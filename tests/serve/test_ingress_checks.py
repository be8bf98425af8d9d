"""Ingress request checks without a cluster: OpenAI fields the engine cannot honour, gRPC limits."""

import json
from typing import Any

import pytest

from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.serve.chat import ChatFormat
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.errors import ErrorKind, RequestError
from ddtree_serve.serve.grpc_adapter import GrpcAdapter
from ddtree_serve.serve.grpc_decode import decode
from ddtree_serve.serve.openai_api import ChatCompletionRequest, CompletionRequest, parse_body
from ddtree_serve.serve.protocol import GenerationRequest
from ddtree_serve.serve.protos import pb2

DEFAULTS = ServeConfig().engine.default_sampling_params()
JSON = "application/json"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def parse_json(body_class: type[Any], body: dict[str, Any]) -> Any:
    return parse_body(body_class, "application/json", json.dumps(body).encode(), "prompt")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 1.5}, "presence_penalty"),
        ({"frequency_penalty": -0.5}, "frequency_penalty"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"best_of": 3}, "best_of"),
    ],
)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_sampling_fields_the_engine_ignores_are_refused_not_dropped(
    endpoint: str, fields: dict[str, Any], param: str
) -> None:
    body = (
        CompletionRequest(prompt="hi", **fields)
        if endpoint == "completions"
        else ChatCompletionRequest(**CHAT, **fields)
    )
    with pytest.raises(RequestError) as raised:
        body.sampling_params(DEFAULTS)
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT and raised.value.param == param


def test_suffix_is_refused_and_neutral_values_are_accepted() -> None:
    with pytest.raises(RequestError, match="suffix"):
        CompletionRequest(prompt="hi", suffix="}").prompt_input()
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "best_of": 1}
    assert CompletionRequest(prompt="hi", suffix="", **neutral).sampling_params(DEFAULTS) == DEFAULTS
    assert ChatCompletionRequest(**CHAT, logit_bias=None).sampling_params(DEFAULTS).max_tokens == (
        DEFAULTS.max_tokens
    )


class _Context:
    def __init__(self, metadata: list[tuple[str, str]] | None = None) -> None:
        self._metadata = metadata or []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def request_id(self) -> str:
        return "grpc-test"

    def set_trailing_metadata(self, pairs: list[tuple[str, str]]) -> None:
        pass


def test_grpc_chat_messages_obey_the_prompt_character_limit() -> None:
    config = ServeConfig.model_validate({"limits": {"max_prompt_chars": 100}})
    adapter = GrpcAdapter(None, config, ChatFormat.from_config(config))  # type: ignore[arg-type]
    message = pb2.GenerateRequest(messages=[pb2.ChatMessage(role="user", content="a " * 100)])
    with pytest.raises(RequestError) as raised:
        adapter._grpc_request(message, _Context())
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT and raised.value.param == "prompt"


def test_a_seed_beyond_64_bits_is_refused_naming_the_seed() -> None:
    assert CompletionRequest(prompt="hi", seed=2**64 - 1).sampling_params(DEFAULTS).seed == 2**64 - 1
    with pytest.raises(RequestError) as raised:
        parse_json(CompletionRequest, {"prompt": "hi", "seed": 2**64}).sampling_params(DEFAULTS)
    assert raised.value.param == "seed"


@pytest.mark.parametrize(
    ("body_class", "content_type", "body", "param", "fragment"),
    [
        (CompletionRequest, "text/plain", b'{"prompt": "hi"}', None, "must be JSON"),
        (CompletionRequest, JSON, b"", "prompt", "`prompt`"),
        (ChatCompletionRequest, None, b"  ", "messages", "`messages`"),
        (CompletionRequest, JSON, b"{not json", None, "not valid JSON"),
        (CompletionRequest, JSON, b'{"prompt": "\xff"}', None, "not valid JSON"),
        (CompletionRequest, JSON, b"[1, 2]", None, "JSON object"),
        (CompletionRequest, JSON, b"{\"prompt\": " + b"[" * 5000 + b"]" * 5000 + b"}", None, "nests JSON"),
        (CompletionRequest, JSON, b'{"prompt": "\\ud800"}', "prompt", "Unicode"),
        (CompletionRequest, JSON, b'{"prompt": "hi", "model": "\\udfff"}', "model", "Unicode"),
        (CompletionRequest, JSON, b'{"prompt": "hi", "stop": ["\\ud800"]}', "stop", "Unicode"),
        (CompletionRequest, JSON, b'{"prompt": "hi", "max_tokens": true}', "max_tokens", "integer"),
        (CompletionRequest, JSON, b'{"prompt": "hi", "temperature": Infinity}', "temperature", "[0, 2]"),
        (CompletionRequest, JSON, b'{"prompt": "hi", "temperature": 1e308}', "temperature", "[0, 2]"),
        (CompletionRequest, JSON, b'{"prompt": [1, -2]}', "prompt", ">= 0"),
        (ChatCompletionRequest, JSON, b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
         "messages.0.content", "Unicode"),
        (ChatCompletionRequest, JSON, b'{"messages": [{"role": "user"}]}',
         "messages.0.content", "required"),
        (ChatCompletionRequest, JSON,
         b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}',
         "max_completion_tokens", "max_completion_tokens"),
    ],
)  # fmt: skip
def test_bad_bodies_are_refused_with_a_message_naming_the_field(
    body_class: type[Any], content_type: str | None, body: bytes, param: str | None, fragment: str
) -> None:
    with pytest.raises(RequestError) as raised:
        parse_body(
            body_class, content_type, body, "messages" if body_class is ChatCompletionRequest else "prompt"
        )
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT
    assert raised.value.param == param and fragment in raised.value.message, raised.value.message


def test_token_id_prompts_are_accepted_in_either_openai_shape() -> None:
    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        assert parse_json(CompletionRequest, {"prompt": prompt}).prompt_input() == (5, 6, 7)
    assert parse_json(CompletionRequest, {"prompt": ["one text"]}).prompt_input() == "one text"


def test_chat_sampling_params_leave_the_request_unchanged() -> None:
    body = ChatCompletionRequest(**CHAT, max_tokens=9, max_completion_tokens=5)
    assert body.sampling_params(DEFAULTS).max_tokens == 5  # OpenAI's newer name wins, as in vLLM
    assert (body.max_tokens, body.max_completion_tokens) == (9, 5)
    assert body.requested_max_tokens() == (5, "max_completion_tokens")


def test_max_tokens_past_the_context_is_refused_only_when_the_client_chose_it() -> None:
    sampling = SamplingParams(max_tokens=300)
    GenerationRequest("r", "hi", sampling).check_context_length(20, 256)  # the default: capped later
    with pytest.raises(RequestError) as raised:
        GenerationRequest("r", "hi", sampling, max_tokens_param="max_tokens").check_context_length(20, 256)
    message = raised.value.message
    assert raised.value.param == "max_tokens"
    assert "maximum context length is 256 tokens" in message and "requested 320 tokens" in message
    assert "20 in the prompt, 300 in the completion" in message


def test_every_503_tells_the_client_when_to_retry() -> None:
    assert ErrorKind.OVERLOADED.http_status == 503 and "Retry-After" in ErrorKind.OVERLOADED.http_headers
    assert ErrorKind.INVALID_ARGUMENT.http_headers == {}


def not_utf8(message: Any) -> bytes:
    """`message` encoded with its one "é" (2 bytes) replaced by 2 bytes that are not UTF-8."""
    return bytes(message.SerializeToString().replace("é".encode(), b"\xc3\x28"))


def nested_struct_field(levels: int) -> bytes:
    """`chat_template_kwargs` (a `google.protobuf.Struct`) as wire bytes: {"k": [[...[1.0]...]]}
    with `levels` lists, a message deeper than protobuf decodes (built by hand: the library
    refuses to build it too)."""

    def length_delimited(field: int, payload: bytes) -> bytes:
        return _varint(field << 3 | 2) + _varint(len(payload)) + payload

    value = b"\x11" + bytes(8)  # Value.number_value = 0.0
    for _ in range(levels):  # Value.list_value (field 6) = ListValue{values (field 1): [value]}
        value = length_delimited(6, length_delimited(1, value))
    entry = length_delimited(1, b"k") + length_delimited(2, value)  # Struct.fields map entry
    number = pb2.GenerateRequest.DESCRIPTOR.fields_by_name["chat_template_kwargs"].number
    return length_delimited(number, length_delimited(1, entry))


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def grpc_adapter() -> GrpcAdapter:
    config = ServeConfig()
    return GrpcAdapter(None, config, ChatFormat.from_config(config))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "param", "fragment"),
    [
        (not_utf8(pb2.GenerateRequest(prompt="hé")), "prompt", "UTF-8"),
        (not_utf8(pb2.GenerateRequest(messages=[pb2.ChatMessage(role="user", content="é")])),
         "messages[0].content", "UTF-8"),
        (pb2.GenerateRequest(prompt="hello").SerializeToString()[:-2], "prompt", "truncated"),
        (b"\x00\x01", None, "field number 0"),
        (pb2.GenerateRequest(prompt="hi", request_id="r" * 100_000).SerializeToString(), "request_id", "256"),
        (pb2.GenerateRequest(prompt="hi", sampling=pb2.SamplingParams(temperature=float("inf")))
         .SerializeToString(), "sampling.temperature", "[0, 2]"),
        (pb2.GenerateRequest(prompt="hi", sampling=pb2.SamplingParams(top_p=float("nan")))
         .SerializeToString(), "sampling.top_p", "(0, 1]"),
        (pb2.GenerateRequest(prompt="hi", sampling=pb2.SamplingParams(stop=[""])).SerializeToString(),
         "sampling.stop", "non-empty"),
        (pb2.GenerateRequest(prompt="hi", prompt_token_ids=[1]).SerializeToString(), "prompt_token_ids",
         "exactly one"),
        (pb2.GenerateRequest(prompt_token_ids=[1, -1]).SerializeToString(), "prompt_token_ids", ">= 0"),
        (pb2.GenerateRequest(prompt="hi").SerializeToString() + nested_struct_field(300),
         "chat_template_kwargs", "nests messages more than 100 deep"),
    ],
)  # fmt: skip
def test_grpc_requests_are_decoded_and_checked_before_any_work(
    raw: bytes, param: str | None, fragment: str
) -> None:
    # coordinator=None: any attempt to start work would fail with AttributeError, not RequestError.
    with pytest.raises(RequestError) as raised:
        grpc_adapter()._grpc_request(raw, _Context())
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT
    assert raised.value.param == param and fragment in raised.value.message, raised.value.message


def test_a_field_number_0_is_refused_in_a_message_without_fields() -> None:
    assert decode(pb2.ModelInfoRequest, b"") == pb2.ModelInfoRequest()
    assert isinstance(decode(pb2.ModelInfoRequest, b"\x08\x01"), pb2.ModelInfoRequest)  # an unknown field
    with pytest.raises(RequestError, match="field number 0") as raised:
        decode(pb2.ModelInfoRequest, b"\x00\x01")
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT


def test_an_empty_grpc_request_id_header_is_no_request_id() -> None:
    context = _Context([("x-request-id", "")])
    assert grpc_adapter()._grpc_request(pb2.GenerateRequest(prompt="hi"), context).request_id == "grpc-test"
    context = _Context([("x-request-id", "mine")])
    assert grpc_adapter()._grpc_request(pb2.GenerateRequest(prompt="hi"), context).request_id == "mine"


def test_grpc_token_id_prompt_and_explicit_max_tokens_reach_the_generation_request() -> None:
    raw = pb2.GenerateRequest(prompt_token_ids=[3, 4], sampling=pb2.SamplingParams(max_tokens=7))
    request = grpc_adapter()._grpc_request(raw.SerializeToString(), _Context())
    assert request.prompt == (3, 4) and request.sampling.max_tokens == 7
    assert request.max_tokens_param == "sampling.max_tokens"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_draft_budget_extension_reaches_the_sampling_params(endpoint: str) -> None:
    def body(**fields: Any) -> CompletionRequest | ChatCompletionRequest:
        if endpoint == "completions":
            return CompletionRequest(prompt="hi", **fields)
        return ChatCompletionRequest(**CHAT, **fields)

    assert body(draft_budget=8).sampling_params(DEFAULTS).draft_budget == 8
    assert body().sampling_params(DEFAULTS).draft_budget is None


def test_grpc_draft_budget_reaches_the_sampling_params_and_is_checked() -> None:
    with_budget = pb2.GenerateRequest(prompt="hi", sampling=pb2.SamplingParams(draft_budget=4))
    assert (
        grpc_adapter()._grpc_request(with_budget.SerializeToString(), _Context()).sampling.draft_budget == 4
    )
    unset = pb2.GenerateRequest(prompt="hi")
    assert grpc_adapter()._grpc_request(unset.SerializeToString(), _Context()).sampling.draft_budget is None
    zero = pb2.GenerateRequest(prompt="hi", sampling=pb2.SamplingParams(draft_budget=0))
    with pytest.raises(RequestError) as raised:
        grpc_adapter()._grpc_request(zero.SerializeToString(), _Context())
    assert raised.value.param == "sampling.draft_budget"
