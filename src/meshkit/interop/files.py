"""A checkpoint directory's files, read only as what they claim to be.

A name a checkpoint gives (its index's ``weight_map``, the files meshkit looks for) must stay inside the
directory once every symbolic link on the way is resolved: an index naming ``../../x.safetensors`` or an
absolute path, or a shard that is a link to elsewhere, would train on another directory's files under this
one's name. The one way out that is allowed is the Hugging Face Hub cache's own: a snapshot
(``models--org--name/snapshots/REV/``) holds links into its repository's ``blobs/``.

What is read must be a regular file: a FIFO would block the read forever, a directory or a device fail
somewhere deeper. Each refusal is one line naming the file and what it is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshkit import files
from meshkit.models.family import InteropError


def _roots(directory: Path) -> tuple[Path, ...]:
    """Where the directory's files may lie besides it: the blobs of the Hub cache repository whose
    snapshot it is."""
    root = directory.resolve()
    return (root.parent.parent / "blobs",) if root.parent.name == "snapshots" else ()


def inside(directory: Path, name: Any, named_by: str) -> Path:
    """``directory / name``, refused in one line unless ``name`` is a file name that stays inside the
    directory (``meshkit.files.inside``; the Hub cache's blobs allowed: the module docstring). ``named_by``
    says who names it (``'DIR/model.safetensors.index.json'``)."""
    return files.inside(
        directory,
        name,
        named_by=named_by,
        roots=_roots(directory),
        error=InteropError,
        fix="a checkpoint reads only its own files; copy them into it",
    )


def regular(path: Path) -> bool:
    """Whether a file is at ``path`` (False: nothing there); anything there but a regular file (through
    links) is refused, naming what it is (``meshkit.files.regular``)."""
    return files.regular(path, fix="give the checkpoint's own file there", error=InteropError)


def read_json(path: Path, what: str) -> Any:
    """The JSON in ``path`` (a regular file: ``regular``), or None where there is none; one line where it
    is not JSON. ``what`` names the file for the fix ('config.json')."""
    if not regular(path):
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InteropError(f"'{path}' is not JSON ({e}): restore the checkpoint's {what}") from None
