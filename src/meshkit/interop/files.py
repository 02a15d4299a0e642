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
import os
import stat
from pathlib import Path
from typing import Any

from meshkit.models.family import InteropError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))  # fmt: skip


def _roots(directory: Path) -> list[Path]:
    """Where the directory's files may really lie: the directory, and the blobs of the Hub cache
    repository whose snapshot it is."""
    root = directory.resolve()
    return [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])


def inside(directory: Path, name: Any, named_by: str) -> Path:
    """``directory / name``, refused in one line unless ``name`` is a file name that stays inside the
    directory (links resolved; the Hub cache's blobs allowed: the module docstring). ``named_by`` says who
    names it (``'DIR/model.safetensors.index.json'``)."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise InteropError(f"'{named_by}' names the file {name!r}, which is not a file name: restore it")
    path = directory / name
    try:
        real = path.resolve()
    except (OSError, RuntimeError) as e:  # a loop of links
        raise InteropError(
            f"'{named_by}' names '{name}', which cannot be resolved ({e}): restore it"
        ) from None
    if not any(real != root and real.is_relative_to(root) for root in _roots(directory)):
        raise InteropError(
            f"'{named_by}' names '{name}', which leads outside the checkpoint directory '{directory}' (to "
            f"'{real}'): a checkpoint reads only its own files; copy them into it"
        )
    return path


def regular(path: Path) -> bool:
    """Whether a file is at ``path`` (False: nothing there); anything there but a regular file (through
    links) is refused, naming what it is."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as e:
        raise InteropError(
            f"cannot read '{path}' ({e.strerror or e}): fix its permissions or restore it"
        ) from None
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "no regular file")
        raise InteropError(f"'{path}' is {kind}, not a file: give the checkpoint's own file there")
    return True


def read_json(path: Path, what: str) -> Any:
    """The JSON in ``path`` (a regular file: ``regular``), or None where there is none; one line where it
    is not JSON. ``what`` names the file for the fix ('config.json')."""
    if not regular(path):
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InteropError(f"'{path}' is not JSON ({e}): restore the checkpoint's {what}") from None
