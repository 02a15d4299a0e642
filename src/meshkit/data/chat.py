"""Conversations to token ids and a loss mask: the assistant's tokens are learnt, the rest is context.

A row is a conversation (``messages``: a list of ``{role, content}``) or a prompt and its completion
(``prompt`` and ``completion``: two strings, or two lists of messages as TRL's conversational form).
Messages render with the tokenizer's chat template (:mod:`meshkit.data.chat_template`) and the text is
tokenised with special tokens read as such and none added, as transformers' ``apply_chat_template(...,
tokenize=True)`` does, so the ids are those.

The mask: assistant message ``i`` owns the characters from the end of the render of ``messages[:i]``
with the generation prompt to the end of the render of ``messages[:i+1]`` (trailing whitespace left
out): its content and the end-of-turn marker the template writes after it, what transformers'
``{% generation %}`` tags mark. Each id whose characters meet those is learnt. A template whose render
of a conversation's beginning is not the beginning of its render (one that rewrites earlier turns) is
refused, naming it: the mask would be wrong. Plain prompt/completion strings need no template: the
tokenizer's framing (a BOS where it prepends one), prompt + completion, and its end of text; the
completion and the end of text are learnt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from meshkit.data.chat_template import ChatTemplate
from meshkit.data.source import DataError
from meshkit.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have."""
FIX = "fix or remove the row"


def _messages(value: Any, key: str, where: str) -> list[dict[str, Any]]:
    """``value`` checked as a list of ``{role, content}`` messages (content: a string)."""
    if not isinstance(value, list) or not value:
        said = "empty" if value == [] else f"a {type(value).__name__}"
        raise DataError(f"'{where}': '{key}' is {said}, not a list of {{role, content}} messages: {FIX}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DataError(f"'{where}': {key}[{i}] is not a message with a 'role' (a string): {FIX}")
        if m["role"] not in ROLES:
            raise DataError(
                f"'{where}': {key}[{i}] has the role '{m['role']}', not one of {', '.join(ROLES)}: rename it, or {FIX}"
            )
        if not isinstance(m.get("content"), str):
            raise DataError(f"'{where}': {key}[{i}] ({m['role']}) has no 'content' string: {FIX}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """A row read: messages to render (``learn_from``: the first message whose assistant turns are
    learnt), or plain ``prompt`` and ``completion`` text."""

    messages: list[dict[str, Any]] | None = None
    learn_from: int = 0
    prompt: str = ""
    completion: str = ""


def read_row(row: dict[str, Any], where: str) -> Row:
    """The conversation of a row (``where``: its file and line or row, for messages)."""
    if "messages" in row and row["messages"] is not None:
        messages = _messages(row["messages"], "messages", where)
        out = Row(messages=messages)
    elif "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion:
                raise DataError(f"'{where}': 'completion' is empty: nothing to learn; {FIX}")
            return Row(prompt=prompt, completion=completion)
        prompt = _messages(prompt, "prompt", where)
        completion = _messages(completion, "completion", where)
        out = Row(messages=prompt + completion, learn_from=len(prompt))
    else:
        keys = ", ".join(sorted(map(str, row))[:8]) or "none"
        raise DataError(
            f"'{where}' has neither 'messages' (a list of {{role, content}}) nor 'prompt' and 'completion' "
            f"(its fields: {keys}): {FIX}"
        )
    assert out.messages is not None
    if out.messages[0]["role"] == "assistant":
        raise DataError(
            f"'{where}' opens with the assistant's message: open with a system or user message, or {FIX}"
        )
    if not any(m["role"] == "assistant" for m in out.messages[out.learn_from :]):
        raise DataError(f"'{where}' has no assistant message to learn: add one, or remove the row")
    return out


def _mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each id whose characters ``[start, end)`` meet one of ``spans``."""
    start, end = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)
    mask = np.zeros(len(offsets), np.uint8)
    for a, b in spans:
        mask |= ((start < b) & (end > a)).astype(np.uint8)
    return mask


def assistant_spans(
    template: ChatTemplate, messages: list[dict[str, Any]], learn_from: int = 0
) -> tuple[str, list[tuple[int, int]]]:
    """The render of ``messages`` and the characters ``[start, end)`` of each assistant turn from
    message ``learn_from`` on (module docstring); refuses a template whose prefixes differ."""
    text = template.render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < learn_from:
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        upto = template.render(messages[: i + 1])
        if not (upto.startswith(before) and text.startswith(upto)):
            raise DataError(
                f"chat template '{template.name}' renders the first {i} messages (with the generation prompt) or the "
                f"first {i + 1} otherwise than the whole conversation begins (it rewrites earlier turns), so the "
                "assistant's tokens cannot be told apart: use a template whose render of a conversation's beginning "
                "is the beginning of its render"
            )
        spans.append((len(before), max(len(before), len(upto.rstrip()))))
    return text, spans


@dataclass(frozen=True, slots=True)
class _Plan:
    """A row rendered: its text, the characters learnt, and whether it is a template's render (special
    tokens read as such) or plain text framed as a document (BOS where the tokenizer prepends one, then
    the end of text, learnt)."""

    text: str
    spans: list[tuple[int, int]]
    chat: bool


class Encoder:
    """Rows to ``(ids, mask)`` with ``tokenizer`` and (for messages) ``template``."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None) -> None:
        self.tokenizer, self.template = tokenizer, template

    def _plan(self, row: Row) -> _Plan:
        if row.messages is None:
            text = row.prompt + row.completion
            return _Plan(text, [(len(row.prompt), len(text))], chat=False)
        if self.template is None:
            raise DataError(
                "rows of messages need a chat template: give --tokenizer a chat model's directory "
                "(its tokenizer_config.json's chat_template, or chat_template.jinja)"
            )
        text, spans = assistant_spans(self.template, row.messages, row.learn_from)
        return _Plan(text, spans, chat=True)

    def _finish(self, plan: _Plan, ids: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mask = _mask(offsets, plan.spans)
        if plan.chat:
            return ids, mask
        pre, suf = np.asarray(self.tokenizer.prefix, np.int32), np.asarray(self.tokenizer.suffix, np.int32)
        return np.concatenate([pre, ids, suf]), np.concatenate(
            [np.zeros(len(pre), np.uint8), mask, np.ones(len(suf), np.uint8)]
        )

    def _many(self, plans: list[_Plan]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The plans' ids and masks, encoded in batches on the tokenizer's own threads."""
        out: list[Any] = [None] * len(plans)
        for chat in (True, False):
            at = [i for i, p in enumerate(plans) if p.chat == chat]
            if at:
                encoded = self.tokenizer.encode_offsets_batch([plans[i].text for i in at], special=chat)
                for i, (ids, offsets) in zip(at, encoded, strict=True):
                    out[i] = self._finish(plans[i], ids, offsets)
        return out

    def encode(self, row: Row) -> tuple[np.ndarray, np.ndarray]:
        """The row's ids (int32) and mask (uint8: 1 where the id is learnt)."""
        return self._many([self._plan(row)])[0]

    def encode_rows(self, rows: list[tuple[dict[str, Any], str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Raw rows' ids and masks (each with ``where`` it is, which a bad row or a template error names)."""
        plans = []
        for row, where in rows:
            parsed = read_row(row, where)
            try:
                plans.append(self._plan(parsed))
            except DataError as e:
                raise DataError(f"'{where}': {e}") from None
        return self._many(plans)

    def encode_row(self, row: dict[str, Any], where: str) -> tuple[np.ndarray, np.ndarray]:
        """A raw row's ids and mask."""
        return self.encode_rows([(row, where)])[0]

    def prompt_ids(self, messages: list[dict[str, Any]]) -> np.ndarray:
        """The ids of ``messages`` with the template's generation prompt (to sample the answer from)."""
        if self.template is None:
            raise DataError("a chat prompt needs a chat template: give a chat model's tokenizer directory")
        text = self.template.render(_messages(messages, "messages", "prompt"), add_generation_prompt=True)
        return self.tokenizer.encode_offsets(text, special=True)[0]
