"""A model's chat template, read and rendered as transformers' ``apply_chat_template`` renders it.

The template is the Jinja source a tokenizer's directory holds: ``chat_template.jinja`` (as newer
transformers save it) or ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
``{name, template}`` of which ``default`` is used). It renders in the environment transformers builds
(``transformers.utils.chat_template_utils._compile_jinja_template``): jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks`` and ``loopcontrols``, its
``tojson`` filter (``json.dumps``, no HTML escaping), ``raise_exception`` and ``strftime_now``, and the
tokenizer's special tokens as variables (``bos_token``, ``eos_token``, ...) beside ``messages``,
``tools=None``, ``documents=None`` and ``add_generation_prompt``; transformers 5.x's ``dict`` and
``namespace`` (no underscore names), and its reading of the messages: a key whose value is null is
dropped (``"tool_calls": null`` is no tool call), and a message's reasoning (``reasoning_content``,
``thinking`` or ``reasoning``) is passed under the first two names. transformers' ``{% generation %}``
tag renders its body and, in :meth:`ChatTemplate.render_tagged`, records where it is, as its
``AssistantTracker`` does: those characters are the assistant mask (:mod:`meshkit.data.chat`).

A template that fails on a row (``raise_exception``, or a plain Python error such as iterating a
null) is one line naming the template and what failed; the caller names the file and row.
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshkit.data.source import DataError
from meshkit.data.tokenizer_config import CONFIG, SPECIAL_MAP, read_config, read_json

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The special tokens transformers passes to a template by name (``special_tokens_map``)."""
GENERATION = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
"""How transformers tells a template with ``{% generation %}`` tags (``render_jinja_template``)."""
REASONING = ("reasoning_content", "thinking", "reasoning")
"""The names a message's reasoning comes under; transformers 5.x fills the first two from the first set."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatTemplate:
    """A chat template's source and the variables it renders with."""

    source: str
    """The Jinja source."""
    name: str
    """Where it came from, for messages (``DIR/chat_template.jinja``, ``DIR/tokenizer_config.json``)."""
    variables: dict[str, Any] = field(default_factory=dict)
    """The tokenizer's special tokens (``bos_token``, ..., ``additional_special_tokens``)."""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    @property
    def tagged(self) -> bool:
        """Whether the template marks the assistant's text with ``{% generation %}`` tags."""
        return bool(GENERATION.search(self.source))

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
        """The text transformers' ``apply_chat_template(messages, tokenize=False, ...)`` gives."""
        return "".join(self._blocks(messages, add_generation_prompt))

    def render_tagged(self, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The render of ``messages`` and the characters ``[start, end)`` of each ``{% generation %}``
        block, as transformers' ``AssistantTracker`` records them (a block starts where the blocks the
        template has yielded before it end)."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        from meshkit.data.jinja_env import TRACKING

        token = TRACKING.set((blocks, spans))
        try:
            for block in self._blocks(messages, False):
                blocks.append(block)
        finally:
            TRACKING.reset(token)
        return "".join(blocks), spans

    def _blocks(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> Any:
        import jinja2

        template = _compiled(self.source)
        try:
            yield from template.generate(
                **self.variables,
                messages=_as_transformers_reads(messages),
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as e:
            raise DataError(f"chat template '{self.name}': {_first_line(e)}") from None
        except Exception as e:  # a plain Python error inside the template: the row does not fit it
            raise DataError(
                f"chat template '{self.name}' fails on it ({type(e).__name__}: {_first_line(e)}): fix the row to "
                "the shape the template reads, or remove it"
            ) from None


def _as_transformers_reads(messages: list[dict[str, Any]]) -> list[Any]:
    """The messages as transformers 5.x hands them to a template (``_normalize_chat_messages``, then
    ``_alias_reasoning_fields``): keys whose value is null dropped, the reasoning under its names."""
    out: list[Any] = []
    for message in messages:
        if isinstance(message, dict):
            message = {k: v for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in REASONING if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    """The template compiled in transformers' environment (one per source, as transformers caches)."""
    import jinja2

    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(
            f"the chat template does not compile ({_first_line(e)}, line {e.lineno}): fix it in the tokenizer's directory"
        ) from None


@functools.cache
def _environment() -> Any:
    """transformers' environment for chat templates (:mod:`meshkit.data.jinja_env`: imports jinja2, when a
    template is first compiled)."""
    from meshkit.data.jinja_env import environment

    return environment()


def _token(value: Any) -> Any:
    """A special token as transformers passes it to a template: a string (an ``AddedToken``'s content)."""
    if isinstance(value, dict) and "content" in value:
        return value["content"]
    if isinstance(value, list):
        return [_token(v) for v in value]
    return value


def _source(directory: Path, cfg: dict[str, Any]) -> tuple[str, str] | None:
    """(source, name) of the directory's template; None where it has none."""
    jinja = directory / TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    where = str(directory / CONFIG)
    value = cfg.get("chat_template")
    if value is None:
        return None
    if isinstance(value, str):
        return value, where
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"], f"{where} (default)"
        raise DataError(
            f"'{where}': chat_template lists {sorted(map(str, named))} but no 'default': name one 'default'"
        )
    raise DataError(f"'{where}': chat_template is a JSON {type(value).__name__}, not a template: fix it")


def load_template(directory: str | Path) -> ChatTemplate:
    """The chat template of a tokenizer's (or model's) ``directory``, with its special tokens; one line
    naming the fix where it has none."""
    directory = Path(directory)
    if directory.is_file():
        directory = directory.parent
    found = _source(directory, read_json(directory / CONFIG))
    if found is None:
        raise DataError(
            f"'{directory}' has no chat template (neither {TEMPLATE_FILE} nor a chat_template in {CONFIG}): "
            "give --tokenizer a chat model's directory, or rows of plain prompt/completion text"
        )
    return ChatTemplate(source=found[0], name=found[1], variables=special_tokens(directory))


def special_tokens(directory: Path) -> dict[str, Any]:
    """The special tokens a tokenizer's ``directory`` names (``SPECIAL_KEYS`` and the additional ones), as
    transformers' ``special_tokens_map`` gives them to a template: ``special_tokens_map.json`` over
    ``tokenizer_config.json``, the tokenizer class's defaults for its ends where the files name none."""
    cfg, overrides = read_json(directory / CONFIG), read_json(directory / SPECIAL_MAP)
    variables = {k: _token(overrides.get(k, cfg.get(k))) for k in SPECIAL_KEYS}
    named = read_config(directory)
    variables["eos_token"] = variables["eos_token"] or named.eos_token
    variables["bos_token"] = variables["bos_token"] or named.bos_token
    variables["additional_special_tokens"] = _token(
        overrides.get("additional_special_tokens", cfg.get("additional_special_tokens"))
    )
    return {k: v for k, v in variables.items() if v}
