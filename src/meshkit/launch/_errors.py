"""The launcher's error: the processes cannot be started as asked (a bad option, no free port, no
place for the job's files)."""

from __future__ import annotations

from meshkit._errors import MeshkitError


class LaunchError(MeshkitError):
    """The processes cannot be started as asked."""
