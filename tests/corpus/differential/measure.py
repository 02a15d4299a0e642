"""Recompute the rows of SOURCES: what ``meshkit migrate`` does with each pmap of each file.

    python tests/corpus/differential/measure.py MIRRORS [--check]

MIRRORS holds a git repository per row's repository, as ``OWNER+NAME/repo`` (the layout of a
mirror fetched for this project) or ``OWNER/NAME`` (a plain clone). Each file is read at its
commit with ``git show``, nothing is written; the rows are printed (``--check``: compared with
SOURCES, exit 1 on a difference). The files themselves are not kept in this repository.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from meshkit.migrate import lint_source

HERE = Path(__file__).parent
HEADER = "# repository  commit  date  path  rewritten  left  snippet"


def _git_dir(mirrors: Path, repository: str) -> Path:
    owner, name = repository.split("/")
    for candidate in (mirrors / f"{owner}+{name}" / "repo", mirrors / owner / name / ".git"):
        if candidate.exists():
            return candidate
    raise SystemExit(f"no clone of {repository} under {mirrors}: fetch it first")


def _reason(message: str) -> str:
    """A short tag for why a pmap was left: the reason's first four words, joined by dashes."""
    reason = message.split("not rewritten: ", 1)[-1]
    for stop in (" (", ":", ";"):
        reason = reason.split(stop, 1)[0]
    return "-".join(reason.split()[:4])


def measure(text: str) -> tuple[str, str]:
    """The lines of rewritten pmaps and of pmaps left with a recipe (``LINE:reason``), comma-joined."""
    pmaps = [f for f in lint_source(text) if f.rule == "MK015"]
    rewritten = [str(f.line) for f in pmaps if f.fixable]
    left = [f"{f.line}:{_reason(f.message)}" for f in pmaps if not f.fixable]
    return ",".join(rewritten) or "-", ",".join(left) or "-"


def rows() -> list[list[str]]:
    lines = (HERE / "SOURCES").read_text().splitlines()
    return [line.split() for line in lines if line.strip() and not line.startswith("#")]


def main(argv: list[str]) -> int:
    mirrors, check = Path(argv[0]), "--check" in argv[1:]
    out, differ = [], 0
    for repository, commit, date, path, rewritten, left, snippet in rows():
        git = _git_dir(mirrors, repository)
        show = ["git", f"--git-dir={git}", "show", f"{commit}:{path}"]
        text = subprocess.run(show, capture_output=True, text=True, check=True).stdout
        now = measure(text)
        differ += now != (rewritten, left)
        out.append("  ".join([repository, commit, date, path, *now, snippet]))
    print("\n".join([HEADER, *out]))
    if check and differ:
        print(f"{differ} row(s) differ from SOURCES", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
