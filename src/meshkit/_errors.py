"""User-facing errors: one line that says what was wrong and how to fix it."""

from __future__ import annotations

import re


class MeshkitError(Exception):
    """Base of every error meshkit raises for bad input.

    The message is a single line naming the problem and the fix; the CLI prints it as
    ``error: <message>`` and exits with status 2, never with a traceback.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class DeviceSetupError(MeshkitError):
    """Devices cannot be set up as asked (e.g. the backend already started)."""


class MeshSpecError(MeshkitError):
    """A mesh specification is malformed or does not match the devices."""


class HloParseError(MeshkitError):
    """Text given as HLO could not be read."""


class TargetError(MeshkitError):
    """A ``module:function`` target for the CLI could not be loaded or used."""


def gist(e: BaseException, limit: int = 200) -> str:
    """The first line of an error, shortened: tensorstore's run to kilobytes, status first and the
    cause last ("OUT_OF_RANGE: Error writing ... file 4: File too large"), so keep those two."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    line = line.split(" [tensorstore_spec=")[0].split(" See full TensorStore details")[0]
    line = re.sub(r"\s*\[os_error_code='?\d+'?\]", "", line)
    status = re.match(r"([A-Z][A-Z_]+): (.+)", line)
    if status and ": " in status.group(2):
        line = f"{status.group(1)}: {status.group(2).rpartition(': ')[2]}"
    return line if len(line) <= limit else line[: limit - 3] + "..."
