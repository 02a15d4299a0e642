"""The sha256 and size of every file of a checkpoint step, in ``<step>/meshkit-checksums.json``.

Written by the save's writer thread (orbax's finalize, in the background) from the files as they
are on disk, just before the step's directory is renamed into place; checked before a restore, so
that a file changed on disk (flipped bytes that keep its size included) makes the step unreadable
instead of training on garbage. The digests are of the files (orbax's compressed OCDBT data), so
they are computed from the files, read back in large chunks: ``hashlib`` releases the GIL while it
hashes each one, and so does the read, so the training loop's thread is not held up.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from meshkit._errors import gist

#: The step's checksums: ``{"algorithm": "sha256", "files": {"params/d/...": [size, hex digest], ...}}``.
CHECKSUMS = "meshkit-checksums.json"
_PROCESS_FILES = re.compile(r"(?:^|/)ocdbt\.process_(\d+)/")
_CHUNK = 4 << 20  # bytes read and hashed at a time (the GIL is released for each)


class Unreadable(Exception):
    """A step's files cannot be read back (corrupt, partial): the reason, in one line."""


def sha256(path: Path) -> str:
    """The hex sha256 of a file."""
    digest, buffer = hashlib.sha256(), bytearray(_CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while size := f.readinto(buffer):
            digest.update(view[:size])
    return digest.hexdigest()


def write_checksums(step_dir: Path) -> None:
    """Record the size and sha256 of every file of the step's items (``params/``, ``opt_state/``,
    ``meta/``) in ``step_dir/meshkit-checksums.json``. orbax's own step files at the top
    (``_CHECKPOINT_METADATA``, ``commit_success.txt``) are left out: orbax rewrites them on commit."""
    files = {
        str(f.relative_to(step_dir)): [f.stat().st_size, sha256(f)]
        for item in sorted(step_dir.iterdir())
        if item.is_dir()
        for f in sorted(item.rglob("*"))
        if f.is_file()
    }
    # a new file ("x": O_EXCL, never through a link) in the step's temporary directory, renamed with it
    with (step_dir / CHECKSUMS).open("x") as f:
        json.dump({"algorithm": "sha256", "files": files}, f, indent=1)


def _checker(name: str, processes: int) -> int:
    """The process that checks a file: the one that wrote it (``ocdbt.process_<i>/``, folded onto the
    processes present), process 0 for the files every process shares."""
    wrote = _PROCESS_FILES.search(name)
    return int(wrote.group(1)) % processes if wrote else 0


def check_checksums(step_dir: Path, *, process: int = 0, processes: int = 1) -> None:
    """Check the files of ``step_dir`` that ``process`` (of ``processes``) checks against the step's
    checksums; raise :class:`Unreadable` naming the first that differs. Every step meshkit saves has
    its checksums: a step without them (the file deleted, or a step meshkit did not write) is unreadable,
    never read unchecked."""
    try:
        manifest = json.loads((step_dir / CHECKSUMS).read_text())
        files = manifest["files"]
        if manifest.get("algorithm") != "sha256" or not isinstance(files, dict):
            raise ValueError(manifest.get("algorithm"))
    except FileNotFoundError:
        raise Unreadable(f"its {CHECKSUMS} is missing (every step meshkit saves has one)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Unreadable(f"its {CHECKSUMS} is damaged ({gist(e, 80)})") from None
    for name, (size, digest) in sorted(files.items()):
        if _checker(name, processes) != process:
            continue
        path = step_dir / name
        try:
            actual = path.stat().st_size
            if actual != size:
                raise Unreadable(f"{name} is {actual} bytes, {size} when saved")
            if sha256(path) != digest:
                raise Unreadable(f"{name} does not match its sha256: changed on disk since the save")
        except FileNotFoundError:
            raise Unreadable(f"{name} is missing") from None
        except OSError as e:
            raise Unreadable(f"{name} cannot be read ({e.strerror or e})") from None
