"""Multiple-choice log-likelihood tasks evaluated in the training loop (``--eval-tasks``), scored as
lm-evaluation-harness scores its ``multiple_choice`` tasks.

A task is a JSONL file, one question per line, in the form the harness's multiple-choice documents take
after ``process_docs`` (its hellaswag ``utils.process_docs`` makes ``query``, ``choices``, ``gold``)::

    {"query": "Question: ...\\nAnswer:", "choices": ["first", "second", "third"], "gold": 1}

``context`` may stand for ``query`` and ``label`` for ``gold`` (an int, or its digits as a string).

Scoring follows the harness (``lm_eval/api/task.py`` and ``lm_eval/api/model.py``, EleutherAI/
lm-evaluation-harness at 4e7e0d47f33b): each choice is the continuation ``TARGET_DELIMITER + choice`` of
the context; trailing whitespace of the context moves onto the continuation, ``context + continuation``
is encoded whole and split at the length of the context's own encoding (``_encode_pair``); the
sequence's last ``seq_len + 1`` tokens are kept (``_loglikelihood_tokens``) and the choice's score is the
sum of its tokens' log-probabilities. ``acc``: the highest score is the gold choice's; ``acc_norm``:
the highest score per character of the choice (``len(choice)``, as the harness divides; the first
choice wins a tie, as ``np.argmax`` picks).

Every (context, choice) of every task is one row of fixed ``(rows, seq_len)`` batches, padded at the end,
so the scoring compiles once for the run, and runs under the run's plan: the jitted function takes the
parameters where they lie, as the held-out loss does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit._errors import MeshkitError
from meshkit.data import global_batch, process_rows
from meshkit.data.readers import lone_surrogate, surrogate_said
from meshkit.train.config import ConfigError

TARGET_DELIMITER = " "
"""Between the context and each choice (the harness's default ``target_delimiter``)."""
SHIPPED = Path(__file__).parent / "eval_tasks"
"""Task files meshkit ships: ``--eval-tasks NAME`` names one by its stem (``python_docs``)."""
FORMAT = '{"query": str, "choices": [str, ...], "gold": int}'


class TaskError(ConfigError):
    """A task file cannot be read, or a question cannot be scored by the run's model."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Question:
    context: str
    choices: tuple[str, ...]
    gold: int
    where: str
    """``file:line``, for messages."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Task:
    name: str
    """The file's stem: the metrics' suffix (``acc/NAME``)."""
    questions: tuple[Question, ...]


# -- reading ------------------------------------------------------------------------------------------
def shipped() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.jsonl"))


def resolve(item: str) -> Path:
    """A task file by path, or a shipped task by name."""
    path = Path(item)
    if path.is_file():
        return path
    if (SHIPPED / f"{item}.jsonl").is_file() and "/" not in item:
        return SHIPPED / f"{item}.jsonl"
    raise TaskError(
        f"--eval-tasks: no file '{item}': give a JSONL file of {FORMAT} rows, or a shipped task "
        f"({', '.join(shipped()) or 'none'})"
    )


def read_tasks(spec: str) -> tuple[Task, ...]:
    """The tasks of ``--eval-tasks FILE[,FILE2...]``."""
    tasks = tuple(read_task(resolve(item.strip())) for item in spec.split(",") if item.strip())
    if not tasks:
        raise TaskError(f"--eval-tasks {spec!r} names no file: give FILE.jsonl[,FILE2.jsonl]")
    names = [t.name for t in tasks]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise TaskError(
            f"--eval-tasks: two files named {twice[0]}.jsonl: their metrics would share a name; rename one"
        )
    return tasks


def read_task(path: Path) -> Task:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(f"--eval-tasks: cannot read '{path}' ({e}): give a UTF-8 JSONL file") from None
    questions = tuple(question(line, f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip())
    if not questions:
        raise TaskError(f"--eval-tasks: '{path}' holds no question: write one {FORMAT} per line")
    return Task(name=path.stem, questions=questions)


def question(line: str, where: str) -> Question:
    """One row of a task file; a bad row raises one line naming ``where`` and the fix."""
    try:
        row = json.loads(line)
    except RecursionError:
        raise TaskError(f"{where}: nested too deeply to read: write one {FORMAT} per line") from None
    except ValueError as e:
        raise TaskError(f"{where}: not JSON ({e.args[0]}): write one {FORMAT} per line") from None
    if not isinstance(row, dict):
        raise TaskError(f"{where}: a JSON {type(row).__name__}, not an object: write one {FORMAT} per line")
    if (bad := lone_surrogate(row)) is not None:  # a \ud800 escape: no text holds it, no tokenizer reads it
        raise TaskError(f"{where}: {surrogate_said(*bad)}")
    context = row.get("query", row.get("context"))
    if not isinstance(context, str) or not context.strip():
        raise TaskError(f'{where}: give the question as a non-empty string "query" (or "context")')
    choices = row.get("choices")
    if not (
        isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) and c for c in choices)
    ):
        raise TaskError(f'{where}: give "choices" as a list of at least two non-empty strings')
    gold = row.get("gold", row.get("label"))
    if isinstance(gold, str) and gold.isdigit():
        gold = int(gold)
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise TaskError(
            f'{where}: give "gold" (or "label") as the index of the right choice, 0 to {len(choices) - 1}; '
            f"got {json.dumps(row.get('gold', row.get('label')))}"
        )
    return Question(context=context, choices=tuple(choices), gold=gold, where=where)


# -- tokens -------------------------------------------------------------------------------------------
def split_pair(encode: Callable[[str], Any], context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The harness's ``_encode_pair`` for a causal model: the context's trailing whitespace moved onto the
    continuation, ``context + continuation`` encoded whole, split at the length of the context's encoding."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = [int(i) for i in encode(context + continuation)]
    context_ids = [int(i) for i in encode(context)]
    return context_ids, whole[len(context_ids) :]


@dataclass(frozen=True, kw_only=True, slots=True)
class Requests:
    """Every (question, choice) of the tasks as one row, question after question: inputs, next tokens
    and the mask of the choice's tokens, each ``(N, seq_len)``."""

    tokens: np.ndarray
    targets: np.ndarray
    mask: np.ndarray


def requests(tasks: tuple[Task, ...], encode: Callable[[str], Any], seq_len: int) -> Requests:
    """The rows to score; raises ``TaskError`` naming the row where a choice has no token of its own or
    more than ``seq_len``, or the run's tokens cannot spell it."""
    rows: list[tuple[list[int], int]] = []
    for q in (q for t in tasks for q in t.questions):
        for c, choice in enumerate(q.choices):
            try:
                context_ids, choice_ids = split_pair(encode, q.context, TARGET_DELIMITER + choice)
            except MeshkitError as e:  # the data's DataError: bare ids, characters outside the vocabulary
                raise TaskError(f"{q.where}: {str(e).splitlines()[0]}") from None
            if not context_ids or not choice_ids or len(choice_ids) > seq_len:
                raise TaskError(
                    f"{q.where}: choice {c} is {len(choice_ids)} token(s) after a context of {len(context_ids)}: "
                    f"each needs at least one, and a choice at most --seq-len {seq_len}; shorten or rephrase it"
                )
            rows.append((context_ids + choice_ids, len(choice_ids)))
    tokens = np.zeros((len(rows), seq_len), np.int32)
    targets, mask = np.zeros_like(tokens), np.zeros((len(rows), seq_len), np.float32)
    for i, (ids, n) in enumerate(rows):
        kept = ids[-(seq_len + 1) :]  # the harness's left truncation
        tokens[i, : len(kept) - 1], targets[i, : len(kept) - 1] = kept[:-1], kept[1:]
        mask[i, len(kept) - 1 - n : len(kept) - 1] = 1.0
    return Requests(tokens=tokens, targets=targets, mask=mask)


# -- metrics ------------------------------------------------------------------------------------------
def accuracy(task: Task, scores: list[np.ndarray]) -> dict[str, float]:
    """``acc`` and ``acc_norm`` of ``task`` from each question's choice scores, as the harness counts them."""
    acc = norm = 0
    for q, lls in zip(task.questions, scores, strict=True):
        lengths = np.array([float(len(c)) for c in q.choices])
        acc += int(np.argmax(lls)) == q.gold
        norm += int(np.argmax(lls / lengths)) == q.gold
    n = len(task.questions)
    return {f"acc/{task.name}": acc / n, f"acc_norm/{task.name}": norm / n}


def line(row: dict[str, Any]) -> str | None:
    """The console line of an evaluation row's task metrics (None: none)."""
    names = [k.split("/", 1)[1] for k in row if k.startswith("acc/")]
    if not names:
        return None
    parts = [f"{n} acc {row[f'acc/{n}']:.3f} acc_norm {row[f'acc_norm/{n}']:.3f}" for n in names]
    return f"step {row['step']} tasks: " + "; ".join(parts)


def summary(row: dict[str, Any]) -> dict[str, dict[str, float]]:
    """An evaluation row's task metrics by task (report.json's ``tasks``)."""
    names = [k.split("/", 1)[1] for k in row if k.startswith("acc/")]
    return {n: {"acc": row[f"acc/{n}"], "acc_norm": row[f"acc_norm/{n}"]} for n in names}


# -- scoring under the run's plan ------------------------------------------------------------------
def _sums(
    apply: Callable, params: Any, tokens_bt: jax.Array, targets_bt: jax.Array, mask_bt: jax.Array
) -> jax.Array:
    """Each row's sum of the log-probabilities of its masked next tokens."""
    logp_bt = -optax.softmax_cross_entropy_with_integer_labels(apply(params, tokens_bt), targets_bt)
    return (logp_bt * mask_bt.astype(logp_bt.dtype)).sum(-1)


class TaskEval:
    """The run's tasks, encoded once, and their scoring: one jitted function of fixed ``(rows, seq_len)``
    batches placed as the training batches are (``sharding``), the parameters where they lie."""

    def __init__(
        self, tasks: tuple[Task, ...], reqs: Requests, *, apply: Callable, rows: int, sharding: NamedSharding
    ) -> None:
        self.tasks, self.requests, self.rows, self.sharding = tasks, reqs, rows, sharding
        whole = NamedSharding(sharding.mesh, P())  # every process reads every score
        self.score_rows = jax.jit(lambda p, *batch: _sums(apply, p, *batch), out_shardings=whole)

    def scores(self, params: Any) -> np.ndarray:
        """Every request's log-likelihood, float64 on the host."""
        r, b = self.requests, self.rows
        first, stop = process_rows(self.sharding, b)
        out = []
        for start in range(0, len(r.tokens), b):
            chunk = [a[start : start + b] for a in (r.tokens, r.targets, r.mask)]
            local = tuple(np.pad(a, ((0, b - len(a)), (0, 0)))[first:stop] for a in chunk)
            out.append(
                np.asarray(self.score_rows(params, *global_batch(self.sharding, local, b)), np.float64)
            )
        return np.concatenate(out)[: len(r.tokens)]

    def __call__(self, params: Any) -> dict[str, float]:
        """``acc/NAME`` and ``acc_norm/NAME`` of every task."""
        return {
            k: v
            for task, lls in zip(self.tasks, self.by_question(self.scores(params)), strict=True)
            for k, v in accuracy(task, lls).items()
        }

    def by_question(self, lls: np.ndarray) -> list[list[np.ndarray]]:
        """Request scores ``lls`` cut into each task's questions' choice scores."""
        out = []
        for task in self.tasks:
            cuts = np.cumsum([len(q.choices) for q in task.questions])
            out.append(np.split(lls[: cuts[-1]], cuts[:-1]))
            lls = lls[cuts[-1] :]
        return out


def build(
    spec: str | None,
    encode: Callable[[str], Any],
    family: Any,
    model: Any,
    *,
    seq_len: int,
    rows: int,
    sharding: NamedSharding,
    params_of: Callable[[Any], Any] = lambda p: p,
) -> TaskEval | None:
    """The tasks of ``--eval-tasks`` (None: none) for the run's model, data and batch layout; raises
    ``TaskError`` before anything runs where a file or a row is bad. ``family``: the model's
    (``models.family.Family``). ``params_of``: the run's parameters
    as the family's own, applied inside the jitted scoring (a LoRA run's adapters merged as the
    scoring's temporaries, not a merged copy kept beside the training state)."""
    if spec is None:
        return None
    tasks = read_tasks(spec)
    module = family.module
    return TaskEval(
        tasks,
        requests(tasks, encode, seq_len),
        rows=rows,
        sharding=sharding,
        apply=lambda params, tokens_bt: module.apply(params_of(params), tokens_bt, model),
    )
