"""Chat templates render exactly as transformers' `apply_chat_template` does for the same template."""

import json
from pathlib import Path

import pytest
import transformers

from ddtree_serve.models.chat_template import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError
from ddtree_serve.models.tokenizer import load_tokenizer
from tests.conftest import tiny_tokenizer
from tests.models.kimi_dirs import KIMI_CHAT_TEMPLATE, KIMI_NUM_BASE_TOKENS, write_kimi_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "北京"}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": "You answer in haiku."},
        {"role": "user", "content": "Describe the sea."},
        {"role": "assistant", "content": "Grey waves", "reasoning_content": "short poem"},
        {"role": "user", "content": "Now the sky, 请."},
    ],
]
# (template, extra kwargs as an OpenAI request's chat_template_kwargs, tools)
CASES = {
    "kimi_thinking": (KIMI_CHAT_TEMPLATE, {}, None),
    "kimi_no_thinking": (KIMI_CHAT_TEMPLATE, {"thinking": False}, None),
    "kimi_tools": (KIMI_CHAT_TEMPLATE, {"thinking": True}, TOOLS),
    "chatml": (CHATML_TEMPLATE, {}, None),
}


@pytest.fixture(scope="module")
def hf_tokenizer() -> transformers.PreTrainedTokenizerFast:
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer(), bos_token="[BOS]", eos_token="[EOS]"
    )


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_apply_chat_template(
    hf_tokenizer: transformers.PreTrainedTokenizerFast,
    case: str,
    conversation: int,
    add_generation_prompt: bool,
) -> None:
    source, kwargs, tools = CASES[case]
    messages = CONVERSATIONS[conversation]
    expected = hf_tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=source,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    template = ChatTemplate(source, {"bos_token": "[BOS]", "eos_token": "[EOS]"})
    assert (
        template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
        == expected
    )


def test_thinking_switch_changes_the_open_turn() -> None:
    template = ChatTemplate(KIMI_CHAT_TEMPLATE)
    assert template.render(CONVERSATIONS[0]).endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert template.render(CONVERSATIONS[0], thinking=False).endswith("<|im_middle|><think></think>")


def test_checkpoint_template_and_end_of_turn_ids(tmp_path: Path) -> None:
    directory = write_kimi_tokenizer(tmp_path)
    template = ChatTemplate.from_dir(directory)
    assert template.source == KIMI_CHAT_TEMPLATE
    assert template.end_of_turn_text() == "<|im_end|>"
    im_end, eos = KIMI_NUM_BASE_TOKENS + 2, KIMI_NUM_BASE_TOKENS + 1
    assert template.end_of_turn_token_ids(load_tokenizer(directory)) == (im_end, eos)


def test_template_file_and_chatml_fallback(tmp_path: Path) -> None:
    assert ChatTemplate.from_dir(tmp_path).source == CHATML_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert ChatTemplate.from_dir(tmp_path).render(CONVERSATIONS[0]) == "hello!"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert ChatTemplate.from_dir(tmp_path).render(CONVERSATIONS[0]) == "D"


def test_template_errors_are_one_line() -> None:
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        ChatTemplate(KIMI_CHAT_TEMPLATE).render([{"role": "tool", "content": "42"}])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
