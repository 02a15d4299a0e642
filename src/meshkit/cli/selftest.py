"""``meshkit selftest``: every collective checked against NumPy on this job's devices, timed."""

from __future__ import annotations

from typing import Annotated

import typer

from meshkit.cli._format import console, fmt_bytes, print_json, table
from meshkit.cli.ledger import DevicesOpt, JsonOpt, _simulate

SizesOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--sizes",
        metavar="SIZE[,SIZE]",
        help="S per device, e.g. 64KiB,4MiB (comma-separated or repeated). Default: 64KiB,4MiB.",
    ),
]
RepeatsOpt = Annotated[int, typer.Option("--repeats", help="Timed calls per check (median reported).")]


def selftest(
    sizes: SizesOpt = None, repeats: RepeatsOpt = 5, devices: DevicesOpt = None, json: JsonOpt = False
) -> None:
    """Check psum, pmean, pmax, all_gather, psum_scatter, all_to_all, ppermute against NumPy; exit 1 on failure."""
    _simulate(devices)
    from meshkit.selftest import SIZES
    from meshkit.selftest import selftest as run_selftest

    report = run_selftest(sizes=sizes or SIZES, repeats=repeats)
    if json:
        print_json(report.to_json())
    else:
        _print(report)
    if not report.ok:
        raise typer.Exit(1)


def _print(report) -> None:
    console.print(
        f"platform [bold]{report.platform}[/] | {report.device_count} device(s) on mesh i={report.device_count} | "
        f"process {report.process_index} of {report.process_count} | median of {report.repeats} call(s)"
    )
    rows = [
        [
            r.collective,
            r.op if r.ledger_matches else f"{r.op} (found {', '.join(r.ops) or 'none'})",
            fmt_bytes(r.size_bytes),
            "ok" if r.ok else "[red]FAIL[/]",
            f"{r.max_abs_error:.3g}",
            f"{r.time_s * 1e3:,.3f} ms",
            fmt_bytes(r.traffic_bytes),
            f"{r.bus_gbps:,.2f}",
        ]
        for r in report.rows
    ]
    cols = ["collective", "compiled op", "S", "check", "max |err|", "time", "ring traffic/device", "bus GB/s"]
    console.print(table("Collectives vs NumPy", cols, rows, justify_right=2))
    failed = report.failures()
    if failed:
        names = ", ".join(f"{r.collective}@{fmt_bytes(r.size)}" for r in failed)
        console.print(f"[red]FAILED:[/] {len(failed)} of {len(report.rows)} check(s): {names}")
    else:
        console.print(f"all {len(report.rows)} checks passed")


def register(app: typer.Typer) -> None:
    app.command()(selftest)
