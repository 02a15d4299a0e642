"""The ``meshkit`` command: a thin layer over the library; every subcommand calls it."""

from __future__ import annotations

import os
import sys

import typer
from typer.exceptions import TyperException

from meshkit._errors import MeshkitError
from meshkit.cli import launch as _launch
from meshkit.cli import ledger as _ledger
from meshkit.cli import migrate as _migrate
from meshkit.cli import plan as _plan
from meshkit.cli import selftest as _selftest
from meshkit.cli import train as _train
from meshkit.cli import verify as _verify

app = typer.Typer(
    name="meshkit",
    help="Train JAX models across devices and hosts, and prove what it did.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.callback()(_launch.job_options)  # global: --coordinator-bind-address, --mtls-*, --heartbeat-timeout
_ledger.register(app)
_train.register(app)
_migrate.register(app)
_launch.register(app)
_selftest.register(app)
_verify.register(app)
_plan.register(app)


def _command():
    """The click command of ``app``, with a default in --help for every option: an option that
    defaults to None shows ``none`` unless its help, or its own show_default, already says what it is."""
    command = typer.main.get_command(app)
    for sub in [command, *getattr(command, "commands", {}).values()]:  # the global options too
        for p in sub.params:
            if (
                getattr(p, "param_type_name", "") != "option"
                or p.default is not None
                or p.show_default is not True
            ):
                continue
            if not (p.required or p.is_flag or "default" in (p.help or "").lower()):
                p.show_default = "none"
    return command


def main(argv: list[str] | None = None) -> int:
    """Entry point: bad input prints one line and exits 2; nothing else prints a traceback
    unless MESHKIT_DEBUG=1."""
    try:
        result = _command().main(args=argv, prog_name="meshkit", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        print("interrupted", file=sys.stderr)
        return 130
    except TyperException as e:  # usage errors: one line, naming where the help is
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:
            print(ctx.get_help())
            return 0
        where = f"{ctx.command_path} --help" if ctx is not None else "meshkit --help"
        print(f"error: {e.format_message()} (see {where})", file=sys.stderr)
        return e.exit_code
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    except MeshkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("MESHKIT_DEBUG"):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"error: {type(e).__name__}: {first} (set MESHKIT_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1
    return 0


def _entry() -> None:
    sys.exit(main())
