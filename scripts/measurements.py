"""Regenerate the generated sections of docs/measurements.md (issue 35).

Each generated section sits between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``
and is rebuilt from what is cheap and deterministic: the Makefile's ``make run`` recipe with the
training config's defaults (no training is run: its timings stay a recorded run with its date), and
``meshkit plan`` rankings, which are analytical (a few CPU seconds).

    PYTHONPATH=src python scripts/measurements.py          # rewrite the page
    PYTHONPATH=src python scripts/measurements.py --check  # exit 1 (naming the sections) if stale
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "measurements.md"
MAKEFILE = ROOT / "Makefile"
PLAN_1_3B = ("--model gpt-1.3b --seq 1024 --vocab 32000 --devices 64 --devices-per-host 8 --global-batch 64 "
             "--runtime meshkit --no-flash-attention")  # fmt: skip
"""The compile check at scale: the 1.3 B GPT on 64 h100 (the ranking ``--compile 3`` compiles the top of)."""
RECORDED_RUN = (
    "Recorded run (2026-12-01, commit f5c4497, the README's figures; not re-run by the generator): the "
    "loss fell from 6.97 to 2.72 nats/token, held out 3.73 nats/token = 1.81 bits per byte, in 2 min 4 s "
    "on 2 cores shared with a test run."
)


def _recipe(target: str) -> list[list[str]]:
    """The commands of a Makefile target's recipe, each split into words (``$(BIN)/`` dropped, the
    Makefile's other variables expanded)."""
    lines = MAKEFILE.read_text().splitlines()
    names = dict(m.groups() for line in lines if (m := re.match(r"([A-Z_]+) :?= (.*)$", line)))
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    out = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        command = line.strip().lstrip("@").split("||")[-1].replace("$(BIN)/", "")  # the venv's meshkit
        for name, value in names.items():
            command = command.replace(f"$({name})", value)
        out.append(shlex.split(command))
    return out


def _option(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


def make_run() -> str:
    """What ``make run`` does, read from the Makefile and the training config's defaults."""
    import jax

    from meshkit.models import module_of, num_params
    from meshkit.train import config as C
    from meshkit.train.job import model_config

    commands = _recipe("run")
    prepare = next(c for c in commands if c[:3] == ["meshkit", "data", "prepare"])
    train = next(c for c in commands if c[:2] == ["meshkit", "train"])
    vocab = int(_option(prepare, "--vocab-size"))
    fields = {"model": _option(train, "--model"), "steps": int(_option(train, "--steps"))}
    cfg = C.TrainConfig(**{k: v for k, v in fields.items() if v is not None})
    model = model_config(cfg, vocab)
    shapes = jax.eval_shape(lambda: module_of(model).init(jax.random.key(0), model))
    return _wrap(
        f"Command: `make run` (`{shlex.join(prepare)}` once, then `{shlex.join(train)}`). From the Makefile "
        f"and the training config's defaults: a byte-level BPE of {vocab:,} ids prepared from the embedded "
        f"text (Python's reference docs) into `{_option(prepare, '--out')}`; the {cfg.model} model of "
        f"{cfg.layers} layers, width {cfg.width}, {cfg.heads} heads, {num_params(shapes):,} parameters; "
        f"{cfg.steps} steps of batch {cfg.batch_size} x {cfg.seq_len} tokens, plan {cfg.parallel.plan} on 8 "
        f"simulated CPU devices; held-out loss in nats/token and bits per byte.\n\n{RECORDED_RUN}"
    )


def plan_1_3b() -> str:
    """The top of ``meshkit plan``'s ranking for the 1.3 B GPT on 64 h100, and how many layouts it ranks."""
    argv = [
        sys.executable,
        "-c",
        "import sys; from meshkit.cli import main; sys.exit(main())",
        "plan",
        *PLAN_1_3B.split(),
        "--top",
        "3",
        "--json",
    ]
    out = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT).stdout)
    rows = [
        f"| {i} | {p['label']} | {p['meshkit_plan']} | {p['peak_bytes'] / 1e9:.2f} GB | "
        f"{p['step_time_s'] * 1e3:.1f} ms | {p['tokens_per_s']:,.0f} |"
        for i, p in enumerate(out["layouts"], 1)
    ]
    return "\n".join([
        _wrap(f"Command: `meshkit plan {PLAN_1_3B}` (analytical, a few CPU seconds): it ranks "
              f"{out['considered']:,} layouts, {out['fitting']:,} fit; its top 3 (what `--compile 3` compiles):"),
        "",
        "| # | layout | plan | peak predicted | step | tokens/s |",
        "|---|---|---|---|---|---|",
        *rows,
    ])  # fmt: skip


def _wrap(text: str) -> str:
    """Paragraphs wrapped at 100 columns, as the page's hand-written ones are."""
    return "\n\n".join(
        textwrap.fill(p, 100, break_on_hyphens=False, break_long_words=False) for p in text.split("\n\n")
    )


SECTIONS = {"make-run": make_run, "plan-gpt-1.3b": plan_1_3b}


def render(text: str) -> str:
    """``text`` with every generated section rebuilt; raises where a section's markers are missing."""
    for name, build in SECTIONS.items():
        pattern = re.compile(rf"(<!-- generated: {name} -->\n).*?(<!-- end generated: {name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(
                f"error: {PAGE.name} has no '<!-- generated: {name} -->' section: add its markers"
            )
        body = build()
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page differs from what is generated")
    args = ap.parse_args(argv)
    old = PAGE.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print(f"{PAGE.relative_to(ROOT)} is stale: run scripts/measurements.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
