"""Write src/meshkit/train/eval_tasks/python_docs.jsonl: 40 cloze questions cut from meshkit's default
corpus (Python's ``pydoc_data.topics``, the text ``meshkit data prepare`` and ``meshkit train`` use when
no data is given), so that a model trained on it can answer them.

Each question is a sentence of the docs cut before its last word: the context is the sentence up to
that word (``"Answer:"`` style prompts are not needed: the docs' own prose is the prompt), the gold
choice is the word, and three distractors are the last words of other sentences picked with a fixed
seed. Sentences are taken evenly over the topics (sorted by name, as the corpus orders them); only
prose sentences of 40-200 characters whose last word is 4-12 letters qualify. Every gold continuation
is checked to occur verbatim in the corpus. Run: python scripts/make_python_docs_task.py
"""

import json
import random
import re
from pathlib import Path
from pydoc_data.topics import topics

OUT = Path(__file__).resolve().parents[1] / "src/meshkit/train/eval_tasks/python_docs.jsonl"
QUESTIONS = 40


def sentences(text: str) -> list[tuple[str, str]]:
    """(context, last word) of the prose sentences of ``text`` that qualify."""
    out = []
    for paragraph in text.split("\n\n"):
        if paragraph.startswith(" ") or "\n   " in paragraph:  # code blocks, grammar, tables
            continue
        for s in re.split(r"(?<=\.)\s+", " ".join(paragraph.split())):
            m = re.fullmatch(r"([A-Z][A-Za-z ,'\-]{30,190}) ([a-z]{4,12})\.", s)
            if m:
                out.append((m.group(1), m.group(2)))
    return out


def main() -> None:
    text = "".join(topics[k] for k in sorted(topics))
    pool = [pair for k in sorted(topics) for pair in sentences(topics[k])]
    words = sorted({w for _, w in pool})
    rng = random.Random(0)
    step = len(pool) / QUESTIONS
    rows = []
    for i in range(QUESTIONS):
        context, gold = pool[int(i * step)]
        assert f"{context} {gold}." in " ".join(text.split()), context
        others = rng.sample([w for w in words if w != gold], 3)
        choices = [*others]
        g = rng.randrange(4)
        choices.insert(g, gold)
        rows.append({"query": context, "choices": choices, "gold": g})
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} questions from {len(pool)} sentences to {OUT}")


if __name__ == "__main__":
    main()
