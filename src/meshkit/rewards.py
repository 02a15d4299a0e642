"""Rewards for GRPO (``meshkit train --task grpo --reward SPEC``): what each completion of a rollout
scores, as TRL's ``GRPOTrainer`` scores it with its reward functions.

``SPEC`` is comma-separated rewards, summed (TRL sums its reward functions, each weighing 1):

- ``exact``: 1.0 where the completion's text, stripped of surrounding whitespace, is the row's
  ``answer`` (``str()`` of it, stripped); where the answer is a number (an int or float, not a bool, or
  text that reads as one: ``-12``, ``3.5``, ``1,234``) also where the completion's last number is equal
  to it (compared as decimals: ``72.0`` is ``72``; a number is digits with an optional ``-`` that does
  not follow a letter, digit or ``)``, thousands grouped by commas, and a fraction after a dot); else
  0.0. A row with no ``answer`` (or a null one) is refused in one line.
- ``regex:PATTERN``: 1.0 where ``re.search(PATTERN, completion)`` finds a match (Python's ``re``, no
  flags: write ``(?s)`` etc. in the pattern), else 0.0. The pattern is the rest of the spec, commas and
  all, so it comes last (one regex a spec).
- ``MODULE:FUNCTION`` or ``path/to/file.py:FUNCTION``: the user's function, found by meshkit's target
  loader (``meshkit.user_code``, the one ``meshkit verify`` and the ledgers use), called TRL's
  way: ``fn(prompts=[...], completions=[...], **columns)``, each column of the rows a list over the batch
  (the union of the rows' keys but ``prompt`` and ``completion``, as TRL's, None where a row has none), ``completion_ids`` too where
  the caller gives them; a completion is its text, or where the prompt is a list of messages
  ``[{"role": "assistant", "content": text}]`` as TRL gives it. It returns a reward per completion: a
  real number, or None where it does not apply (TRL's ``None``: that function adds nothing to the sum;
  a completion no function applies to scores 0.0, where TRL warns).

Errors are one line (:class:`RewardError`): a function that raises names the function, the exception
and the first completion that raises alone (each is tried alone to find it); one that returns the wrong
number of rewards, a non-number, NaN or an infinity names the function and the completion's index.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np

from meshkit._errors import MeshkitError

NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
"""A number in text (module docstring: ``exact``)."""
EXAMPLE = "exact, regex:PATTERN, or a function MODULE:NAME / path/to/file.py:NAME"
RETRIES = 8
"""Completions a failed reward function is called on alone, to name the first that fails."""


class RewardError(MeshkitError):
    """A reward cannot be loaded, or a reward function fails or returns what is no reward."""


def _decimal(value: Any) -> Decimal | None:
    """``value`` as a decimal where it is a number (module docstring), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return Decimal(str(value)) if math.isfinite(value) else None
    if isinstance(value, str) and NUMBER.fullmatch(value.strip()):
        return Decimal(value.strip().replace(",", ""))
    return None


def last_number(text: str) -> Decimal | None:
    """The last number written in ``text``, None where there is none."""
    found = NUMBER.findall(text)
    try:
        return Decimal(found[-1].replace(",", "")) if found else None
    except InvalidOperation:
        return None


def exact(completions: list[str], answers: list[Any]) -> list[float]:
    """``exact``'s rewards (module docstring)."""
    out = []
    for text, answer in zip(completions, answers, strict=True):
        hit = text.strip() == str(answer).strip()
        if not hit and (want := _decimal(answer)) is not None:
            hit = last_number(text) == want
        out.append(1.0 if hit else 0.0)
    return out


@dataclass(frozen=True, slots=True)
class Term:
    """One reward of a spec: its name, and either a built-in ``(texts, rows) -> rewards`` or a user's
    function called TRL's way."""

    name: str
    builtin: Callable[[list[str], list[dict[str, Any]]], list[float]] | None = None
    fn: Callable[..., Any] | None = None


def _exact(texts: list[str], rows: list[dict[str, Any]]) -> list[float]:
    for i, row in enumerate(rows):
        if row.get("answer") is None:
            raise RewardError(
                f"reward 'exact' needs each row's 'answer', and completion {i}'s row has none (its columns: "
                f"{', '.join(sorted(row)) or 'none'}): prepare prompt rows with an 'answer' column, or use another reward"
            )
    return exact(texts, [row["answer"] for row in rows])


def _regex(part: str) -> Term:
    pattern = part.removeprefix("regex:")
    if not pattern:
        raise RewardError(
            "reward 'regex:' has no pattern: give regex:PATTERN (the rest of --reward, commas and all)"
        )
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise RewardError(
            f"reward 'regex:{pattern}' is no regular expression ({e}): fix the pattern"
        ) from None
    return Term(part, builtin=lambda texts, rows: [1.0 if compiled.search(t) else 0.0 for t in texts])


def _user(part: str) -> Term:
    """The user's function ``part`` names (``meshkit.user_code.resolve``: ``module:name`` or
    ``path/to/file.py:name``)."""
    from meshkit.user_code import resolve

    try:
        fn = resolve(part, what="reward", example="my_rewards.py:correct")
    except MeshkitError as e:
        raise RewardError(f"reward '{part}': {e}") from None
    except Exception as e:  # the user's module failed as it was imported
        raise RewardError(f"loading reward '{part}' raised {type(e).__name__}: {_first(e)}") from None
    if not callable(fn):
        raise RewardError(f"reward '{part}' is a {type(fn).__name__}, not a function: name a function")
    return Term(part, fn=fn)


def _first(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def load(spec: str) -> Reward:
    """The reward ``spec`` names (module docstring)."""
    terms: list[Term] = []
    rest = spec.strip()
    while rest:
        if rest.startswith("regex:"):  # the pattern is the rest, commas and all
            terms.append(_regex(rest))
            break
        part, _, rest = rest.partition(",")
        part, rest = part.strip(), rest.strip()
        if part == "exact":
            terms.append(Term("exact", builtin=_exact))
        elif ":" in part:
            terms.append(_user(part))
        else:
            raise RewardError(
                f"unknown reward {part!r} in --reward {spec!r}: give {EXAMPLE}, comma-separated"
            )
    if not terms:
        raise RewardError(f"--reward {spec!r} names no reward: give {EXAMPLE}, comma-separated")
    return Reward(tuple(terms))


@dataclass(frozen=True, slots=True)
class Reward:
    """The sum of a spec's rewards (module docstring): ``reward(prompts, completions, rows)``."""

    terms: tuple[Term, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.terms)

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[str],
        rows: Sequence[dict[str, Any]],
        completion_ids: Sequence[Any] | None = None,
    ) -> np.ndarray:
        """Each completion's reward (float64): the sum of the rewards that apply to it."""
        return np.nansum(self.scores(prompts, completions, rows, completion_ids), axis=1)

    def scores(
        self,
        prompts: Sequence[Any],
        completions: Sequence[str],
        rows: Sequence[dict[str, Any]],
        completion_ids: Sequence[Any] | None = None,
    ) -> np.ndarray:
        """Each completion's reward from each function, ``(completions, rewards)`` float64: NaN where a
        function returned None (it does not apply); ``prompts`` as given (strings, or lists of messages),
        ``completions`` the texts, ``rows`` each completion's row (its columns)."""
        n = len(completions)
        if not len(prompts) == n == len(rows) or (completion_ids is not None and len(completion_ids) != n):
            raise RewardError(
                f"a reward is given {len(prompts)} prompts, {n} completions and {len(rows)} rows: give one of each "
                "per completion"
            )
        out = np.zeros((n, len(self.terms)), np.float64)
        for k, term in enumerate(self.terms):
            if term.builtin is not None:
                out[:, k] = term.builtin(list(completions), list(rows))
            else:
                out[:, k] = _checked(term, _call(term, prompts, completions, rows, completion_ids), n)
        return out


def _arguments(
    prompts: Sequence[Any],
    completions: Sequence[str],
    rows: Sequence[dict[str, Any]],
    ids: Sequence[Any] | None,
) -> dict[str, Any]:
    """TRL's arguments of a reward function (module docstring)."""
    said = [
        t if isinstance(p, str) else [{"role": "assistant", "content": t}]
        for p, t in zip(prompts, completions, strict=True)
    ]
    keys = list(dict.fromkeys(k for row in rows for k in row if k not in ("prompt", "completion")))
    kw = {k: [row.get(k) for row in rows] for k in keys}
    kw |= {"prompts": list(prompts), "completions": said}
    if ids is not None:
        kw["completion_ids"] = list(ids)
    return kw


def _call(term: Term, prompts, completions, rows, ids) -> Any:
    """``term``'s function on the batch; where it raises, one line naming the first completion that
    raises alone (of the first ``RETRIES``: a function that fails on every call, a grader that is down,
    is not called once per completion of a large batch)."""
    assert term.fn is not None
    try:
        return term.fn(**_arguments(prompts, completions, rows, ids))
    except Exception as e:  # the user's code: say where it failed, in one line
        at = " (at completion 0)" if len(completions) == 1 else ""
        for i in range(min(len(completions), RETRIES)) if len(completions) > 1 else ():
            one = slice(i, i + 1)
            try:
                term.fn(
                    **_arguments(prompts[one], completions[one], rows[one], None if ids is None else ids[one])
                )
            except Exception:
                at = f" (first alone at completion {i})"
                break
        raise RewardError(f"reward '{term.name}' raised {type(e).__name__}: {_first(e)}{at}") from None


def _checked(term: Term, got: Any, n: int) -> np.ndarray:
    """``got`` as ``n`` rewards (None as NaN), or one line naming the function and the first bad one."""
    if isinstance(got, np.ndarray) and got.ndim == 1:
        got = got.tolist()
    if not isinstance(got, list | tuple):
        raise RewardError(
            f"reward '{term.name}' returned a {type(got).__name__}, not a list of {n} rewards: return a float (or None "
            "where it does not apply) per completion"
        )
    if len(got) != n:
        raise RewardError(
            f"reward '{term.name}' returned {len(got)} rewards for {n} completions: return one per completion"
        )
    out = np.empty(n, np.float64)
    for i, v in enumerate(got):
        if v is None:
            out[i] = np.nan
        elif not isinstance(v, numbers.Real):
            raise RewardError(
                f"reward '{term.name}' returned {v!r:.60} (a {type(v).__name__}) for completion {i}: return a float, "
                "or None where it does not apply"
            )
        elif not math.isfinite(v):
            raise RewardError(
                f"reward '{term.name}' returned {float(v)} for completion {i}: return a finite float, or None where "
                "it does not apply"
            )
        else:
            out[i] = float(v)
    return out
