"""The ``meshkit`` command: a thin layer over the library; every subcommand calls it."""

from __future__ import annotations

import json
import os
import sys

import typer
from typer.exceptions import TyperException

from meshkit import compile_cache
from meshkit._errors import MeshkitError
from meshkit.cli import data as _data
from meshkit.cli import export as _export
from meshkit.cli import generate as _generate
from meshkit.cli import launch as _launch
from meshkit.cli import ledger as _ledger
from meshkit.cli import migrate as _migrate
from meshkit.cli import plan as _plan
from meshkit.cli import selftest as _selftest
from meshkit.cli import train as _train
from meshkit.cli import verify as _verify
from meshkit.targets import quiet_libtpu

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
_export.register(app)
_generate.register(app)
_data.register(app)


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


def _wants_json(argv: list[str], command) -> bool:
    """Whether the command line asks a command of its own for ``--json`` (not ``meshkit launch``,
    whose ``--json`` after the command belongs to the processes it starts)."""
    mine = argv[: argv.index("--")] if "--" in argv else argv
    names = set(getattr(command, "commands", {}))
    command = next((a for a in mine if a in names), None)
    return "--json" in mine and command not in (None, "launch")


def _fail(message: str, code: int, as_json: bool) -> int:
    """One ``error:`` line on stderr, or with ``--json`` one JSON object ``{"error": ...}`` on stdout
    (where a program reading the output looks), and the exit status."""
    if as_json:
        sys.stdout.write(json.dumps({"error": message}) + "\n")
        sys.stdout.flush()
    else:
        print(f"error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point: bad input prints one line (with ``--json``, a JSON object on stdout) and exits
    2; nothing else prints a traceback unless MESHKIT_DEBUG=1. JAX's persistent compilation cache
    is set up first (:mod:`meshkit.compile_cache`)."""
    command = _command()
    as_json = _wants_json(list(sys.argv[1:] if argv is None else argv), command)
    try:
        quiet_libtpu()  # before JAX starts: libtpu on a machine without a TPU would print to stderr
        compile_cache.configure()  # before anything compiles; train's --compile-cache may change it
        result = command.main(args=argv, prog_name="meshkit", standalone_mode=False)
        return result if isinstance(result, int) else 0
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        return _fail("interrupted", 130, as_json)
    except TyperException as e:  # usage errors: one line, naming where the help is
        ctx = getattr(e, "ctx", None)
        if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:
            print(ctx.get_help())
            return 0
        where = f"{ctx.command_path} --help" if ctx is not None else "meshkit --help"
        return _fail(f"{e.format_message()} (see {where})", e.exit_code, as_json)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    except MeshkitError as e:
        return _fail(str(e), 2, as_json)
    except KeyboardInterrupt:
        return _fail("interrupted", 130, as_json)
    except Exception as e:
        if os.environ.get("MESHKIT_DEBUG"):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        return _fail(f"{type(e).__name__}: {first} (set MESHKIT_DEBUG=1 for the traceback)", 1, as_json)
    return 0


def _entry() -> None:
    sys.exit(main())
