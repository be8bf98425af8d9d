"""Chat prompts rendered from the checkpoint's own Jinja template, the way HF `apply_chat_template` does.

The template is `chat_template` in `tokenizer_config.json` (a string, or a list of named templates
of which "default" is used) or a `chat_template.jinja` file; a checkpoint with neither gets ChatML.
Rendering matches transformers: a sandboxed Jinja environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps non-ASCII text,
`raise_exception(message)` and `strftime_now(format)` globals, and the variables `messages`,
`tools`, `add_generation_prompt`, the tokenizer's special tokens (`bos_token`, `eos_token`, ...)
and any extra keyword arguments (an OpenAI request's `chat_template_kwargs`, e.g. Kimi's
`thinking`). Not supported: the `{% generation %}` tag (assistant-mask tracking for training).
"""

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ddtree_serve.models.tokenizer import TiktokenTokenizer

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_PROBE_CONTENT = "\x00ddtree-end-of-turn-probe\x00"


class ChatTemplateError(ValueError):
    """A template raised (`raise_exception`) or does not parse."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _special_token(value: Any) -> str | None:
    """`tokenizer_config.json` stores special tokens as strings or as `{"content": ...}` objects."""
    return value.get("content") if isinstance(value, dict) else value


class ChatTemplate:
    """One compiled chat template plus the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ChatTemplateError(
                f"chat template does not parse: {error.message} (line {error.lineno})"
            ) from error
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_dir(cls, path: str | Path) -> "ChatTemplate":
        """The directory's template (`tokenizer_config.json`, then `chat_template.jinja`), else ChatML."""
        path = Path(path)
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        special = {k: token for k in _SPECIAL_TOKEN_KEYS if (token := _special_token(config.get(k)))}
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            source = {entry["name"]: entry["template"] for entry in source}.get("default")
        if source is None and (path / "chat_template.jinja").exists():
            source = (path / "chat_template.jinja").read_text()
        return cls(source or CHATML_TEMPLATE, special)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **chat_template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages` (OpenAI-style dicts), ending in the assistant's open turn."""
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
            **chat_template_kwargs,
        )

    def end_of_turn_text(self) -> str:
        """What the template writes right after an assistant message's content (e.g. `<|im_end|>`)."""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE_CONTENT}]
        rendered = self.render(probe, add_generation_prompt=False)
        _, found, after = rendered.rpartition(_PROBE_CONTENT)
        return after.strip() if found else ""

    def end_of_turn_token_ids(self, tokenizer: Tokenizer | TiktokenTokenizer) -> tuple[int, ...]:
        """Ids that end an assistant turn: the end-of-turn marker and the eos token, each if one token."""
        ids: list[int] = []
        for text in (self.end_of_turn_text(), self.special_tokens.get("eos_token", "")):
            encoded = tokenizer.encode(text).ids if text else []
            if len(encoded) == 1 and encoded[0] not in ids:
                ids.append(encoded[0])
        return tuple(ids)
