"""User-facing errors: one line that says what was wrong and how to fix it."""

from __future__ import annotations


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
