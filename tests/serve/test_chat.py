"""Chat through the ingress pieces, without a cluster: the target's own template renders it.

The chat format is read from the target directory the way `build_app` reads it
(`ChatFormat.from_config`); HTTP bodies go through `parse_body` and the ingress core, gRPC
messages through the adapter's `_grpc_request`, so both protocols are checked on the code that
serves them. Target directories are written by the tests: the bundled pair (ChatML, no template
of its own), a Kimi K2.6-like `kimi_k25` directory (tiktoken tokenizer, template with thinking
on/off, a vision tower in the config) and a Qwen3 directory with a `chat_template.jinja`.
"""

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import struct_pb2

from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.models import bundled_target_dir, load_tokenizer
from ddtree_serve.models.chat_template import CHATML_TEMPLATE, ChatTemplate
from ddtree_serve.serve.chat import ChatFormat, target_has_vision_tower
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.errors import ErrorKind, RequestError
from ddtree_serve.serve.grpc_adapter import GrpcAdapter
from ddtree_serve.serve.openai_api import ChatCompletionRequest, parse_body
from ddtree_serve.serve.protocol import GenerationRequest
from ddtree_serve.serve.protos import pb2
from tests.models.kimi_dirs import (
    KIMI_CHAT_TEMPLATE,
    KIMI_TEXT_CONFIG,
    KIMI_VISION_CONFIG,
    write_kimi_tokenizer,
)

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "world"},
    {"role": "user", "content": "hello world"},
]
IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
# Thinking on unless the request turns it off; a non-boolean `thinking` is the template's refusal.
THINKING_TEMPLATE = (
    "{%- if thinking is defined and thinking is not boolean -%}"
    "{{ raise_exception('thinking must be true or false') }}{%- endif -%}"
    "{%- for message in messages -%}[{{ message['role'] }}]{{ message['content'] }}[/turn]{%- endfor -%}"
    "{%- if add_generation_prompt -%}[assistant]{%- if thinking is not defined or thinking -%}<think>"
    "{%- endif -%}{%- endif -%}"
)


class _Context:
    def invocation_metadata(self) -> list[tuple[str, str]]:
        return []

    def request_id(self) -> str:
        return "grpc-test"

    def set_trailing_metadata(self, pairs: list[tuple[str, str]]) -> None:
        pass


def serve_config(target: Path | None = None) -> ServeConfig:
    engine = {} if target is None else {"target": str(target), "mode": "ar"}
    return ServeConfig.model_validate({"model_name": "served-model", "engine": engine})


def ingress(config: ServeConfig) -> GrpcAdapter:
    """The ingress core as `build_app` wires it; coordinator=None: nothing here starts work."""
    return GrpcAdapter(None, config, ChatFormat.from_config(config))  # type: ignore[arg-type]


def http_chat(core: GrpcAdapter, body: dict[str, Any]) -> tuple[str, SamplingParams]:
    """What the HTTP chat route sends the Coordinator: the rendered prompt and the sampling."""
    request = parse_body(ChatCompletionRequest, "application/json", json.dumps(body).encode(), "messages")
    prompt = core._chat_prompt(request.chat_turns(), request.chat_template_kwargs)
    return prompt, core._chat.with_end_of_turn(request.sampling_params(core._defaults))


def grpc_chat(core: GrpcAdapter, messages: list[dict[str, Any]], **fields: Any) -> GenerationRequest:
    chat = [pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
    raw = pb2.GenerateRequest(messages=chat, **fields).SerializeToString()
    return core._grpc_request(raw, _Context())


def kwargs_struct(values: dict[str, Any]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(values)
    return struct


def refusal(call: Any) -> RequestError:
    with pytest.raises(RequestError) as raised:
        call()
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT
    return raised.value


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `kimi_k25` target directory as Moonshot ships it, less the weights (not read here)."""
    path = write_kimi_tokenizer(tmp_path_factory.mktemp("kimi"))
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {**KIMI_TEXT_CONFIG, "model_type": "kimi_k2"},
        "vision_config": KIMI_VISION_CONFIG,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled Qwen3 target's config and tokenizer with a `chat_template.jinja` of its own."""
    path = tmp_path_factory.mktemp("thinking")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_target_dir() / name, path / name)
    (path / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return path


# ------------------------------------------------------------------------------ bundled pair


def test_bundled_chat_over_http_and_grpc_renders_what_the_chat_template_renders() -> None:
    core = ingress(serve_config())
    template = ChatTemplate.from_dir(bundled_target_dir())
    assert template.source == CHATML_TEMPLATE  # the bundled target ships no template of its own
    expected = template.render(CONVERSATION)
    prompt, sampling = http_chat(core, {"messages": CONVERSATION, "max_tokens": 5})
    request = grpc_chat(core, CONVERSATION)
    assert prompt == request.prompt == expected
    assert expected.endswith("<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n")
    # <|im_end|> is several tokens of the bundled BPE: a stop string; its eos token is a stop id.
    eos_id = load_tokenizer(bundled_target_dir()).token_to_id("<|endoftext|>")
    for params in (sampling, request.sampling):
        assert params.stop == ("<|im_end|>",) and params.stop_token_ids == (eos_id,)


def test_text_content_parts_join_as_one_message() -> None:
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    prompt, _ = http_chat(ingress(serve_config()), {"messages": [{"role": "user", "content": parts}]})
    assert prompt == ChatTemplate(CHATML_TEMPLATE).render([{"role": "user", "content": "hello\nworld"}])


def test_a_chat_stop_of_the_client_comes_first_and_ignore_eos_drops_the_end_of_turn() -> None:
    core = ingress(serve_config())
    _, sampling = http_chat(core, {"messages": CONVERSATION, "stop": ["\n\n"]})
    assert sampling.stop == ("\n\n", "<|im_end|>")
    _, ignoring = http_chat(core, {"messages": CONVERSATION, "stop": ["\n\n"], "ignore_eos": True})
    assert ignoring.stop == ("\n\n",) and ignoring.stop_token_ids == ()


def test_images_are_refused_on_a_text_only_target_over_http_and_grpc() -> None:
    core = ingress(serve_config())
    content = [{"type": "text", "text": "what is this?"}, IMAGE_PART]
    http = refusal(lambda: http_chat(core, {"messages": [{"role": "user", "content": content}]}))
    parts = [pb2.ContentPart(type="text", text="what is this?"), pb2.ContentPart(type="image_url")]
    raw = pb2.GenerateRequest(messages=[pb2.ChatMessage(role="user", content_parts=parts)])
    grpc = refusal(lambda: core._grpc_request(raw.SerializeToString(), _Context()))
    for error in (http, grpc):
        assert error.param == "messages.0.content.1"
        assert "this deployment serves text only" in error.message and "vision tower" not in error.message


def test_the_readme_chat_examples_render_on_the_bundled_pair() -> None:
    root = Path(__file__).resolve().parents[2]
    docs = (root / "README.md").read_text() + (root / "deployments" / "README.md").read_text()
    bodies = re.findall(r"/v1/chat/completions .*?-d '(.*?)'", docs, flags=re.DOTALL)
    assert len(bodies) >= 3  # README, deployments/README's streaming and chat_template_kwargs ones
    core = ingress(serve_config())
    for body in map(json.loads, bodies):
        prompt, _ = http_chat(core, body)
        assert prompt == ChatTemplate(CHATML_TEMPLATE).render(body["messages"])


# ------------------------------------------------------------------------ Kimi-like target


def test_kimi_chat_renders_with_its_template_and_honours_thinking_off(kimi_dir: Path) -> None:
    core = ingress(serve_config(kimi_dir))
    template = ChatTemplate(KIMI_CHAT_TEMPLATE, {"bos_token": "[BOS]", "eos_token": "[EOS]"})
    thinking, _ = http_chat(core, {"messages": CONVERSATION})
    assert thinking == template.render(CONVERSATION)
    assert thinking.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    body = {"messages": CONVERSATION, "chat_template_kwargs": {"thinking": False}}
    no_thinking, sampling = http_chat(core, body)
    request = grpc_chat(core, CONVERSATION, chat_template_kwargs=kwargs_struct({"thinking": False}))
    assert no_thinking == request.prompt == template.render(CONVERSATION, thinking=False)
    assert no_thinking.endswith("<|im_middle|><think></think>")
    # <|im_end|> and [EOS] are single special tokens of the tiktoken vocabulary: stop ids only.
    tokenizer = load_tokenizer(kimi_dir)
    end_ids = tuple(tokenizer.encode(token).ids[0] for token in ("<|im_end|>", "[EOS]"))
    assert sampling.stop == request.sampling.stop == ()
    assert sampling.stop_token_ids == request.sampling.stop_token_ids == end_ids


def test_kimi_images_are_refused_naming_the_vision_tower(kimi_dir: Path) -> None:
    core = ingress(serve_config(kimi_dir))
    assert core._chat.has_vision_tower and target_has_vision_tower(kimi_dir)
    assert not target_has_vision_tower(bundled_target_dir())
    messages = [{"role": "user", "content": [IMAGE_PART, {"type": "text", "text": "what is this?"}]}]
    error = refusal(lambda: http_chat(core, {"messages": messages}))
    assert error.param == "messages.0.content.0"
    assert "the vision tower of served-model is not loaded" in error.message
    assert "serves text only" in error.message


# ------------------------------------------------------------ a custom template, bad kwargs


def test_a_custom_template_file_renders_and_its_refusal_names_the_messages(thinking_dir: Path) -> None:
    core = ingress(serve_config(thinking_dir))
    on, _ = http_chat(core, {"messages": CONVERSATION[1:2]})
    off, sampling = http_chat(
        core, {"messages": CONVERSATION[1:2], "chat_template_kwargs": {"thinking": False}}
    )
    assert (on, off) == ("[user]hello[/turn][assistant]<think>", "[user]hello[/turn][assistant]")
    assert sampling.stop == ("[/turn]",)  # the template's own end of turn, not ChatML's
    # Struct numbers are doubles: 1 arrives as 1.0, which is no boolean either.
    bad_http = {"messages": CONVERSATION[1:2], "chat_template_kwargs": {"thinking": "maybe"}}
    bad_grpc = kwargs_struct({"thinking": 1})
    for error in (
        refusal(lambda: http_chat(core, bad_http)),
        refusal(lambda: grpc_chat(core, CONVERSATION[1:2], chat_template_kwargs=bad_grpc)),
    ):
        assert error.param == "messages" and "thinking must be true or false" in error.message


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [("thinking", "valid dictionary"), ([1], "valid dictionary"), ({"messages": []}, "may not set messages"),
     ({"add_generation_prompt": False, "eos_token": "x"}, "add_generation_prompt, eos_token")],
)  # fmt: skip
def test_bad_chat_template_kwargs_are_refused_naming_the_field(kwargs: Any, fragment: str) -> None:
    core = ingress(serve_config())
    body = {"messages": CONVERSATION, "chat_template_kwargs": kwargs}
    error = refusal(lambda: http_chat(core, body))
    assert error.param == "chat_template_kwargs" and fragment in error.message, error.message


def test_grpc_chat_template_kwargs_apply_to_messages_only() -> None:
    raw = pb2.GenerateRequest(prompt="hi", chat_template_kwargs=kwargs_struct({"thinking": False}))
    error = refusal(lambda: ingress(serve_config())._grpc_request(raw.SerializeToString(), _Context()))
    assert error.param == "chat_template_kwargs" and "messages only" in error.message


@pytest.mark.parametrize(
    ("content", "fragment"),
    [([], "non-empty list"), (5, "string or a non-empty list"), ([{"text": "x"}], "string `type`"),
     ([{"type": "text", "text": 3}], "string `text`")],
)  # fmt: skip
def test_malformed_content_is_refused_naming_the_message(content: Any, fragment: str) -> None:
    body = {"messages": [{"role": "user", "content": content}]}
    error = refusal(lambda: http_chat(ingress(serve_config()), body))
    assert error.param == "messages.0.content" and fragment in error.message, error.message
