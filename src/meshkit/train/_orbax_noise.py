"""What orbax prints that meshkit's checkpoints report otherwise, dropped (``quiet_orbax_noise``): a failed
background write's traceback (meshkit says it in one line), and the wait for a previous save (meshkit keeps
one save in flight on purpose)."""

from __future__ import annotations

import logging
import os
import sys


class _OrbaxNoise(logging.Filter):
    """orbax logs a failed background write (from its writer, commit and finalize threads) with the
    whole traceback, before it raises the same error to the caller, who reports it in one line: drop
    orbax's error records that carry a traceback. And its "Waiting for previous save to complete took
    N seconds" warning: meshkit waits for the previous background save before the next on purpose (one
    in flight), and on a loaded machine the line landed beside a failed save's one-line error."""

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        if record.levelno >= logging.ERROR and record.exc_info:
            return False
        return not str(record.msg).startswith("Waiting for previous save to complete")


def quiet_orbax_noise() -> None:
    """Installed before reads and writes. After a failed one (1) orbax logs the error with its
    traceback from a background thread, (2) tensorstore's other operations on that step finish
    later and try to wake orbax's event loop, which orbax already closed, and (3) the reads orbax
    started beside the failed one end with their own errors in coroutines nobody awaits any more:
    Python would print each as "Exception ignored in ..." with a traceback when it collects them,
    long after the one-line error (in a test suite, inside whichever test runs then). Drop exactly
    those (every other log record and unraisable exception goes where it went)."""
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxNoise) for f in absl.filters):
        absl.addFilter(_OrbaxNoise())
    previous = sys.unraisablehook
    if getattr(previous, "meshkit_quiet", False):
        return

    def hook(unraisable) -> None:
        e = unraisable.exc_value
        closed = isinstance(e, RuntimeError) and str(e) == "Event loop is closed"
        code = getattr(unraisable.object, "cr_code", None)  # a coroutine of orbax's own code
        if not (closed or (code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename)):
            previous(unraisable)

    hook.meshkit_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
