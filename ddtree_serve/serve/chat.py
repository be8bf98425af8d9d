"""Chat prompts as the target checkpoint renders them: its own template, its end-of-turn stops.

`ChatFormat` is read once when the application is built (`from_config`: the target directory's
chat template and special tokens, the end-of-turn stops in the target's vocabulary, whether the
checkpoint carries a vision tower this deployment does not load) and travels to the ingress
replicas as plain data; the template compiles once per process. HTTP and gRPC both turn their
messages into `ChatTurn`s and call `render`, so both refuse the same things in the same words.
"""

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from ddtree_serve.engine.builder import target_dir
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.models.chat_template import ChatTemplate, ChatTemplateError
from ddtree_serve.models.families import target_family
from ddtree_serve.models.loading import read_config
from ddtree_serve.models.tokenizer import load_tokenizer
from ddtree_serve.serve.config import ServeConfig
from ddtree_serve.serve.errors import invalid

CHAT_ROLES: frozenset[str] = frozenset({"system", "user", "assistant"})
TEXT_PART = "text"
# OpenAI content part types a vision tower would read (Kimi K2.x reads images and video).
_VISION_PARTS = frozenset({"image_url", "video_url"})
# Variables the renderer sets itself; a request's chat_template_kwargs may not replace them.
_RENDERER_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


@dataclass(frozen=True)
class ContentPart:
    type: str  # OpenAI's part type: "text", "image_url", "input_audio", ...
    text: str = ""  # the text of a "text" part; other parts carry nothing the engine reads


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: tuple[ContentPart, ...]  # a plain string content is one text part


def target_has_vision_tower(path: str | Path) -> bool:
    """Whether the target checkpoint is multimodal (kimi_k25): its vision tower is never loaded."""
    config = read_config(path)
    return bool(getattr(target_family(config).parse_config(config), "has_vision_tower", False))


@functools.lru_cache(maxsize=4)
def _compiled(source: str, special_tokens: tuple[tuple[str, str], ...]) -> ChatTemplate:
    return ChatTemplate(source, dict(special_tokens))


@dataclass(frozen=True)
class ChatFormat:
    """How the served target formats a conversation; picklable, so it crosses to the replicas."""

    model_name: str  # the served name, for refusals
    template_source: str
    special_tokens: tuple[tuple[str, str], ...]  # (bos_token, "<s>"), ... as the template sees them
    end_of_turn_token_ids: tuple[int, ...]  # the template's end-of-turn and eos tokens
    end_of_turn_stop: tuple[str, ...]  # the end-of-turn marker when it is not one token
    has_vision_tower: bool

    @classmethod
    def from_config(cls, config: ServeConfig) -> "ChatFormat":
        """Reads the target directory's template (ChatML if it has none) and tokenizer."""
        path = target_dir(config.engine)
        template = ChatTemplate.from_dir(path)
        tokenizer = load_tokenizer(path)
        marker = template.end_of_turn_text()
        marker_is_one_token = bool(marker) and len(tokenizer.encode(marker).ids) == 1
        return cls(
            model_name=config.model_name,
            template_source=template.source,
            special_tokens=tuple(sorted(template.special_tokens.items())),
            end_of_turn_token_ids=template.end_of_turn_token_ids(tokenizer),
            end_of_turn_stop=(marker,) if marker and not marker_is_one_token else (),
            has_vision_tower=target_has_vision_tower(path),
        )

    @property
    def template(self) -> ChatTemplate:
        return _compiled(self.template_source, self.special_tokens)

    def render(self, turns: Sequence[ChatTurn], chat_template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt for `turns`, ending in the assistant's open turn; refusals name the field."""
        messages = [
            {"role": turn.role, "content": self._text(index, turn)} for index, turn in enumerate(turns)
        ]
        if not messages:
            raise invalid("messages must not be empty", "messages")
        kwargs = dict(chat_template_kwargs or {})
        if taken := sorted(set(kwargs) & (_RENDERER_VARIABLES | {name for name, _ in self.special_tokens})):
            raise invalid(f"chat_template_kwargs may not set {', '.join(taken)}", "chat_template_kwargs")
        try:
            return self.template.render(messages, **kwargs)
        except ChatTemplateError as error:
            raise invalid(f"the chat template refused the messages: {error}", "messages") from error
        except jinja2.TemplateError as error:
            raise invalid(f"the chat template failed on the messages: {error}", "messages") from error

    def with_end_of_turn(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` that also stops where the assistant's turn ends.

        `ignore_eos` keeps going past it, as past EOS: the end-of-turn token is the chat's EOS
        (vLLM reads it from `generation_config.json` as one).
        """
        if sampling.ignore_eos:
            return sampling
        return dataclasses.replace(
            sampling,
            stop=(*sampling.stop, *self.end_of_turn_stop),
            stop_token_ids=(*sampling.stop_token_ids, *self.end_of_turn_token_ids),
        )

    def _text(self, index: int, turn: ChatTurn) -> str:
        """The turn's text parts joined by newlines (as vLLM joins them); other parts refused."""
        if turn.role not in CHAT_ROLES:
            raise invalid(
                f"message role must be one of {sorted(CHAT_ROLES)}, got {turn.role!r}",
                f"messages.{index}.role",
            )
        for part_index, part in enumerate(turn.content):
            if part.type != TEXT_PART:
                raise invalid(self._refusal(part.type), f"messages.{index}.content.{part_index}")
        return "\n".join(part.text for part in turn.content)

    def _refusal(self, part_type: str) -> str:
        if part_type in _VISION_PARTS and self.has_vision_tower:
            return (
                f"{part_type} content is not served: the vision tower of {self.model_name} is not "
                "loaded (this deployment serves text only)"
            )
        return f"{part_type} content is not served: this deployment serves text only"
