"""Ingress request checks without a cluster: OpenAI fields the engine cannot honour, gRPC limits."""

from typing import Any

import pytest

from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.errors import ErrorKind, RequestError
from ddtree_serve.serve.grpc_adapter import GrpcAdapter
from ddtree_serve.serve.openai_api import ChatCompletionRequest, CompletionRequest
from ddtree_serve.serve.protos import pb2

DEFAULTS = ServeConfig().engine.default_sampling_params()
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


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
        CompletionRequest(prompt="hi", suffix="}").prompt_text()
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "best_of": 1}
    assert CompletionRequest(prompt="hi", suffix="", **neutral).sampling_params(DEFAULTS) == DEFAULTS
    assert ChatCompletionRequest(**CHAT, logit_bias=None).sampling_params(DEFAULTS).max_tokens == (
        DEFAULTS.max_tokens
    )


class _Context:
    def invocation_metadata(self) -> list[tuple[str, str]]:
        return []

    def request_id(self) -> str:
        return "grpc-test"

    def set_trailing_metadata(self, pairs: list[tuple[str, str]]) -> None:
        pass


def test_grpc_chat_messages_obey_the_prompt_character_limit() -> None:
    config = ServeConfig.model_validate({"limits": {"max_prompt_chars": 100}})
    adapter = GrpcAdapter(coordinator=None, config=config)  # type: ignore[arg-type]
    message = pb2.GenerateRequest(messages=[pb2.ChatMessage(role="user", content="a " * 100)])
    with pytest.raises(RequestError) as raised:
        adapter._grpc_request(message, _Context())
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT and raised.value.param == "prompt"


def test_a_seed_beyond_64_bits_is_refused_naming_the_seed() -> None:
    assert CompletionRequest(prompt="hi", seed=2**64 - 1).sampling_params(DEFAULTS).seed == 2**64 - 1
    with pytest.raises(RequestError) as raised:
        CompletionRequest(prompt="hi", seed=2**64).sampling_params(DEFAULTS)
    assert raised.value.param == "seed"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_draft_budget_extension_reaches_the_sampling_params(endpoint: str) -> None:
    make = (
        (lambda **f: CompletionRequest(prompt="hi", **f))
        if endpoint == "completions"
        else (lambda **f: ChatCompletionRequest(**CHAT, **f))
    )
    assert make(draft_budget=8).sampling_params(DEFAULTS).draft_budget == 8
    assert make().sampling_params(DEFAULTS).draft_budget is None
    with pytest.raises(RequestError, match="draft_budget") as raised:
        make(draft_budget=0).sampling_params(DEFAULTS)
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT


def test_grpc_draft_budget_reaches_the_sampling_params() -> None:
    adapter = GrpcAdapter(coordinator=None, config=ServeConfig())  # type: ignore[arg-type]
    with_budget = pb2.GenerateRequest(prompt="hi", sampling=pb2.SamplingParams(draft_budget=4))
    assert adapter._grpc_request(with_budget, _Context()).sampling.draft_budget == 4
    unset = pb2.GenerateRequest(prompt="hi")
    assert adapter._grpc_request(unset, _Context()).sampling.draft_budget is None
