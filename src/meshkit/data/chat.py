"""Conversations to token ids and a loss mask: the assistant's tokens are learnt, the rest is context.

A row is a conversation (``messages``: a list of ``{role, content}``) or a prompt and its completion
(``prompt`` and ``completion``: two strings, or two lists of messages as TRL's conversational form).
Messages render with the tokenizer's chat template (:mod:`meshkit.data.chat_template`) and the text is
tokenised with special tokens read as such and none added, as transformers' ``apply_chat_template(...,
tokenize=True)`` does, so the ids are those. A string holding a lone UTF-16 surrogate (JSON's
``"\\ud800"``, which is no character) is refused naming the row and the field.

The mask, where the template marks the assistant's text with ``{% generation %}`` tags: the characters
the tags enclose, each id whose characters meet them learnt, exactly transformers 5.x's
``assistant_masks`` (``return_assistant_tokens_mask=True``): what the template's authors chose to train
(SmolLM3's tags take in the assistant header and the newline after the end of turn).

Where it has none, meshkit finds each answer by rendering the conversation's beginnings: assistant
message ``i`` owns the characters from the end of the render of ``messages[:i]`` with the generation
prompt (what the model is given) to the end of the render of ``messages[:i+1]`` (trailing whitespace
left out). That must end with the end of turn, a control token (a special token, or an added token the
template writes), so that the model learns to stop. A template that writes its end of turn only when
another message follows (Qwen1.5's first one: ``<|im_end|>`` after every message but the last) has it
learnt where it follows an answer, provided it is the tokenizer's end-of-text token (where generation
stops); a row's last answer then ends with it as the conversation continued renders it (the row is
that render, cut after the end of turn: the one place meshkit's text is not ``apply_chat_template``'s,
counted in the manifest). A template that ends an answer with no such token, or whose render of a
conversation's beginning is not the beginning of its render (it rewrites earlier turns), is refused in
one line: meshkit cannot tell what it means to learn; ``{% generation %}`` tags say it.

Plain prompt/completion strings need no template: the tokenizer's framing (a BOS where it prepends
one), prompt + completion, and its end of text; the completion and the end of text are learnt.

A preference row (TRL's, for DPO: ``prompt``, ``chosen`` and ``rejected``; or no ``prompt`` and two whole
conversations sharing their first messages, :func:`read_pair`) is two such rows, the prompt with each
of its completions, encoded exactly as those prompt/completion rows are.

A prompt row (TRL's, for GRPO: ``prompt`` alone, a string or a list of messages, :func:`read_prompt`)
is what the model is given to answer: messages the template's render with the generation prompt
(:meth:`Encoder.prompt_ids`), a string the tokenizer's framing (its BOS where it prepends one) and the
text, with no end of text; nothing of it is learnt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from meshkit.data.chat_template import ChatTemplate
from meshkit.data.readers import lone_surrogate, surrogate_said
from meshkit.data.source import DataError
from meshkit.data.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have."""
FIX = "fix or remove the row"
PROBE = {"role": "user", "content": "Go on."}
"""A message after a row's last answer: the template then writes what ends an answer when the
conversation goes on."""


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
    _text(value, key, where)
    return value


def _text(value: Any, key: str, where: str) -> None:
    """Refuses a string of ``value`` (nested in lists and dicts) holding a lone UTF-16 surrogate, which no
    tokenizer can encode (rows given in Python: JSONL lines are refused as they are read)."""
    if (bad := lone_surrogate(value, key)) is not None:
        raise DataError(f"'{where}': {surrogate_said(*bad)}, or {FIX}")


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
        return _checked(Row(messages=_messages(row["messages"], "messages", where)), where)
    if "prompt" in row and "completion" in row:
        return completion_row(row["prompt"], row["completion"], where)
    keys = ", ".join(sorted(map(str, row))[:8]) or "none"
    raise DataError(
        f"'{where}' has neither 'messages' (a list of {{role, content}}) nor 'prompt' and 'completion' "
        f"(its fields: {keys}): {FIX}"
    )


def completion_row(prompt: Any, completion: Any, where: str, key: str = "completion") -> Row:
    """A prompt and its completion (two strings, or two lists of messages), ``key`` naming the
    completion in messages (a preference row's ``chosen`` or ``rejected``)."""
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            raise DataError(f"'{where}': '{key}' is empty: nothing to learn; {FIX}")
        _text(prompt, "prompt", where)
        _text(completion, key, where)
        return Row(prompt=prompt, completion=completion)
    prompt = _messages(prompt, "prompt", where)
    completion = _messages(completion, key, where)
    return _checked(Row(messages=prompt + completion, learn_from=len(prompt)), where)


def _checked(out: Row, where: str) -> Row:
    """``out`` opens with a system or user message and has an assistant message to learn."""
    assert out.messages is not None
    if out.messages[0]["role"] == "assistant":
        raise DataError(
            f"'{where}' opens with the assistant's message: open with a system or user message, or {FIX}"
        )
    if not any(m["role"] == "assistant" for m in out.messages[out.learn_from :]):
        raise DataError(f"'{where}' has no assistant message to learn: add one, or remove the row")
    return out


PAIR = ("chosen", "rejected")
"""A preference row's two completions (TRL's preference format)."""


def is_pair(row: dict[str, Any]) -> bool:
    """Whether ``row`` is a preference row: it has ``chosen`` or ``rejected`` (a null is none)."""
    return any(row.get(k) is not None for k in PAIR)


def read_pair(row: dict[str, Any], where: str) -> tuple[Row, Row]:
    """A preference row's chosen and rejected rows, each read as the prompt/completion row of its
    completion (TRL's preference format: ``prompt``, ``chosen`` and ``rejected`` three strings or three
    lists of messages; or, with no ``prompt``, two whole conversations whose longest common beginning of
    whole messages is the prompt, as TRL's ``maybe_extract_prompt`` reads them). A pair whose two sides
    read alike teaches nothing, and is refused."""
    have = [k for k in PAIR if row.get(k) is not None]
    if len(have) < 2:
        lack = next(k for k in PAIR if k not in have)
        raise DataError(f"'{where}' has '{have[0]}' but no '{lack}': a preference row needs both; {FIX}")
    other = [k for k in ("messages", "completion") if row.get(k) is not None]
    if other:
        raise DataError(
            f"'{where}' has '{other[0]}' beside 'chosen' and 'rejected': give a preference pair or a "
            f"conversation, not both; {FIX}"
        )
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if prompt is None:
        prompt, chosen, rejected = _implicit_prompt(chosen, rejected, where)
    out = completion_row(prompt, chosen, where, "chosen"), completion_row(prompt, rejected, where, "rejected")
    if out[0] == out[1]:
        raise _same(where)
    return out


ANSWERS = ("messages", "completion", *PAIR)
"""What a prompt row has none of: a row with any of them is a conversation or a preference pair."""


def is_prompt(row: dict[str, Any]) -> bool:
    """Whether ``row`` is a prompt row: it has a ``prompt`` and none of :data:`ANSWERS` (a null is none)."""
    return row.get("prompt") is not None and all(row.get(k) is None for k in ANSWERS)


def read_prompt(row: dict[str, Any], where: str) -> str | list[dict[str, Any]]:
    """A prompt row's prompt as given (TRL's GRPO format): a string, or a list of messages that opens with
    a system or user message and does not end with the assistant's (TRL would continue that answer;
    meshkit gives the model a turn to answer)."""
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"'{where}': 'prompt' is empty: nothing to answer; {FIX}")
        _text(prompt, "prompt", where)
        return prompt
    if not isinstance(prompt, list):
        raise DataError(
            f"'{where}': 'prompt' is a {type(prompt).__name__}, not a string or a list of {{role, content}} "
            f"messages: {FIX}"
        )
    prompt = _messages(prompt, "prompt", where)
    for at, name in ((0, "opens"), (-1, "ends")):
        if prompt[at]["role"] == "assistant":
            raise DataError(
                f"'{where}': 'prompt' {name} with the assistant's message: a prompt gives the model a turn to "
                f"answer, so open with a system or user message and end with another than the assistant's; {FIX}"
            )
    return prompt


def _same(where: str, how: str = "are the same") -> DataError:
    return DataError(f"'{where}': 'chosen' and 'rejected' {how}: the pair teaches nothing; {FIX}")


def _implicit_prompt(chosen: Any, rejected: Any, where: str) -> tuple[list, list, list]:
    """The prompt of a row without one, and its two completions: the messages both conversations open
    with, and what follows them in each."""
    if isinstance(chosen, str) or isinstance(rejected, str):
        raise DataError(
            f"'{where}' has no 'prompt', and 'chosen' and 'rejected' are not both lists of messages (an "
            f"implicit prompt is read from conversations only): give the row its 'prompt', or {FIX}"
        )
    chosen, rejected = _messages(chosen, "chosen", where), _messages(rejected, "rejected", where)
    if chosen == rejected:
        raise _same(where)
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise DataError(
            f"'{where}' has no 'prompt', and 'chosen' and 'rejected' open with different messages (no prompt "
            f"shared): give the row its 'prompt', or {FIX}"
        )
    for key, side in (("chosen", chosen), ("rejected", rejected)):
        if shared == len(side):
            raise DataError(
                f"'{where}': '{key}' ends where the other side's prompt does (all of it is the prompt both share): "
                f"nothing to learn; {FIX}"
            )
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each id whose characters ``[start, end)`` meet one of ``spans``: ``start < span end`` and
    ``end > span start``, transformers 5.x's test (an empty id at a span's first character is not
    learnt); spans as a template's blocks give them, in order and apart."""
    start, end = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), np.uint8)
    for a, b in spans:
        mask |= ((start < b) & (end > a)).astype(np.uint8)
    return mask


@dataclass(frozen=True, slots=True)
class Ends:
    """What ends an answer, for a template without ``{% generation %}`` tags: the control tokens a
    template's text marks turns with (longest first), and the tokenizer's end-of-text token."""

    controls: tuple[str, ...]
    eos: str | None

    @staticmethod
    def of(tokenizer: Tokenizer, template: ChatTemplate) -> Ends:
        """The tokenizer's special tokens and its other added tokens the template writes (transformers'
        control tokens, ``_get_control_tokens``; whitespace tokens are ordinary text)."""
        found = {
            t
            for t, special in tokenizer.added_tokens()
            if special or (t in template.source and not t.isspace())
        }
        return Ends(tuple(sorted(found, key=len, reverse=True)), tokenizer.eos[0])


def _refuse_rewrite(template: ChatTemplate, i: int) -> DataError:
    return DataError(
        f"chat template '{template.name}' renders the first {i} messages (with the generation prompt) or the "
        f"first {i + 1} otherwise than the whole conversation begins (it rewrites earlier turns), so the "
        "assistant's tokens cannot be told apart: use a template whose render of a conversation's beginning "
        "is the beginning of its render, or one with {% generation %} tags"
    )


def _refuse_end(template: ChatTemplate, i: int, ends: Ends, found: str | None) -> DataError:
    if found is None:
        return DataError(
            f"chat template '{template.name}' ends assistant message {i} with no end-of-turn token (no special "
            "token after the answer), so a model trained on it never learns to stop and meshkit cannot tell what "
            "should end a turn: mark what the assistant learns with {% generation %} tags, or use a template that "
            "ends each answer with its end-of-turn token"
        )
    return DataError(
        f"chat template '{template.name}' ends assistant message {i} with no end-of-turn token, and writes "
        f"{found!r} after it only when another message follows; that is not the tokenizer's end-of-text token "
        f"{ends.eos!r} (where generation stops), so meshkit cannot tell that it ends a turn: give --eos-token "
        f"{found} if it does, or mark what the assistant learns with {{% generation %}} tags"
    )


def assistant_spans(
    template: ChatTemplate, messages: list[dict[str, Any]], ends: Ends, learn_from: int = 0
) -> tuple[str, list[tuple[int, int]], str]:
    """The text of ``messages`` (the template's render), the characters ``[start, end)`` learnt of each
    assistant turn from message ``learn_from`` on, and the end of turn added after the last answer (``""``
    where the render has it): the ``{% generation %}`` tags' spans, else the turns found by rendering
    the conversation's beginnings (module docstring; ``ends`` names the end-of-turn tokens)."""
    if template.tagged:
        text, spans = template.render_tagged(messages)
        if learn_from:  # a prompt's own tagged turns are context, as TRL's completion mask makes them
            prompt = template.render(messages[:learn_from], add_generation_prompt=True)
            if not text.startswith(prompt):
                raise _refuse_rewrite(template, learn_from)
            spans = [(max(a, len(prompt)), b) for a, b in spans if b > len(prompt)]
        spans = [(a, b) for a, b in spans if b > a]
        if not spans:
            raise DataError(
                f"chat template '{template.name}' marks none of this conversation's text with "
                "{% generation %}: nothing to learn; give it assistant turns its tags enclose, or remove it"
            )
        return text, spans, ""
    text = template.render(messages)
    spans, added = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < learn_from:
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        upto = template.render(messages[: i + 1])
        if not (upto.startswith(before) and text.startswith(upto)):
            raise _refuse_rewrite(template, i)
        start, end = len(before), max(len(before), len(upto.rstrip()))
        if not (ends.controls and upto[start:end].endswith(ends.controls)):
            last = i == len(messages) - 1
            goes_on = _render_or_none(template, [*messages, PROBE]) if last else text
            found = _end_of_turn(goes_on, end, ends) if goes_on and goes_on.startswith(upto[:end]) else None
            if found is None or found[1] != ends.eos:
                raise _refuse_end(template, i, ends, found and found[1])
            if last:
                added = goes_on[end : found[0]]
                text = goes_on[: found[0]]
            end = found[0]
        spans.append((start, end))
    return text, spans, added


def _render_or_none(template: ChatTemplate, messages: list[dict[str, Any]]) -> str | None:
    try:
        return template.render(messages)
    except DataError:  # a template that takes no message after an answer: no end of turn to be found
        return None


def _end_of_turn(text: str, at: int, ends: Ends) -> tuple[int, str] | None:
    """(end, token) of the control token that ``text`` writes at ``at`` after only whitespace, if any."""
    rest = text[at:]
    stripped = rest.lstrip()
    token = next((t for t in ends.controls if stripped.startswith(t)), None)
    if token is None:
        return None
    return at + len(rest) - len(stripped) + len(token), token


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
        self.ends = None if template is None else Ends.of(tokenizer, template)
        self.added: dict[str, int] = {}
        """How many rows' last answer was given each end of turn (:func:`assistant_spans`)."""

    def _plan(self, row: Row) -> _Plan:
        if row.messages is None:
            text = row.prompt + row.completion
            return _Plan(text, [(len(row.prompt), len(text))], chat=False)
        if self.template is None:
            raise DataError(
                "rows of messages need a chat template: give --tokenizer a chat model's directory "
                "(its tokenizer_config.json's chat_template, or chat_template.jinja)"
            )
        assert self.ends is not None
        text, spans, added = assistant_spans(self.template, row.messages, self.ends, row.learn_from)
        if added:
            self.added[added] = self.added.get(added, 0) + 1
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

    def _plans(self, rows: list[tuple[Row, str]]) -> list[_Plan]:
        plans = []
        for row, where in rows:
            try:
                plans.append(self._plan(row))
            except DataError as e:
                raise DataError(f"'{where}': {e}") from None
        return plans

    def encode_rows(self, rows: list[tuple[dict[str, Any], str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Raw rows' ids and masks (each with ``where`` it is, which a bad row or a template error names)."""
        return self._many(self._plans([(read_row(row, where), where) for row, where in rows]))

    def encode_pairs(self, rows: list[tuple[dict[str, Any], str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Preference rows' ids and masks (:func:`read_pair`): two documents a row, its chosen one then its
        rejected one; a pair whose two sides encode to the same ids and mask is refused, as one whose
        rows read alike is."""
        docs = [(side, where) for row, where in rows for side in read_pair(row, where)]
        out = self._many(self._plans(docs))
        for k, (_, where) in enumerate(rows):
            (a, ma), (b, mb) = out[2 * k], out[2 * k + 1]
            if np.array_equal(a, b) and np.array_equal(ma, mb):
                raise _same(where, "encode to the same ids (the template renders them alike)")
        return out

    def encode_row(self, row: dict[str, Any], where: str) -> tuple[np.ndarray, np.ndarray]:
        """A raw row's ids and mask."""
        return self.encode_rows([(row, where)])[0]

    def encode_prompts(self, rows: list[tuple[dict[str, Any], str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Prompt rows' ids and masks (all 0: nothing is learnt), batched on the tokenizer's threads: a
        list of messages exactly :meth:`prompt_ids`, a string the tokenizer's framing and its text."""
        texts: list[tuple[str, bool]] = []
        for row, where in rows:
            prompt = read_prompt(row, where)
            if isinstance(prompt, str):
                texts.append((prompt, False))
                continue
            try:
                texts.append((self._render_prompt(prompt), True))
            except DataError as e:
                raise DataError(f"'{where}': {e}") from None
        out: list[Any] = [None] * len(texts)
        pre = np.asarray(self.tokenizer.prefix, np.int32)
        for chat in (True, False):
            at = [i for i, (_, c) in enumerate(texts) if c == chat]
            encoded = (
                self.tokenizer.encode_offsets_batch([texts[i][0] for i in at], special=chat) if at else []
            )
            for i, (ids, _) in zip(at, encoded, strict=True):
                ids = ids if chat else np.concatenate([pre, ids])
                out[i] = ids, np.zeros(len(ids), np.uint8)
        return out

    def _render_prompt(self, messages: list[dict[str, Any]]) -> str:
        if self.template is None:
            raise DataError(
                "a prompt of messages needs a chat template: give --tokenizer a chat model's directory "
                "(its tokenizer_config.json's chat_template, or chat_template.jinja)"
            )
        return self.template.render(messages, add_generation_prompt=True)

    def prompt_ids(self, messages: list[dict[str, Any]]) -> np.ndarray:
        """The ids of ``messages`` with the template's generation prompt (to sample the answer from)."""
        if self.template is None:
            raise DataError("a chat prompt needs a chat template: give a chat model's tokenizer directory")
        text = self.template.render(_messages(messages, "messages", "prompt"), add_generation_prompt=True)
        return self.tokenizer.encode_offsets(text, special=True)[0]
