"""What ``meshkit train --dry-run`` prints: the run's step as compiled, per device, beside the planner's
prediction for those devices (``meshkit.train.dry_run``)."""

from __future__ import annotations

from typing import Any

from meshkit.cli._format import fmt_bytes, table


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def show(result: Any, console: Any) -> None:
    """The header line, the table of compiled against predicted figures, and one line: fits or not."""
    m, p, hw, cfg = result.measured, result.prediction, result.hardware, result.cfg
    where = (
        f"{result.target} ({m.layout.devices} x {hw.name if hw else m.device_kind})"
        if result.target
        else f"this machine's {m.layout.devices} {m.device_kind or 'device'}s"
    )
    console.print(
        f"dry run: {cfg.model.model} ({_count(result.parameters)} parameters), {m.plan} on {m.mesh}, "
        f"{cfg.parallel.precision}, batch {cfg.data.batch_size} x {cfg.data.seq_len}, for {where}",
        soft_wrap=True,
        highlight=False,
    )
    if not m.ok:
        console.print(f"[red]{m.error}[/]" if m.no_fit else m.error, soft_wrap=True, highlight=False)
        return
    rows = [
        ["peak memory", fmt_bytes(m.peak_bytes), fmt_bytes(p.peak_bytes) if p else "-"],
        [
            "  parameters + optimizer state",
            fmt_bytes(m.parts["params"] + m.parts["optimizer"]),
            fmt_bytes(p.memory["parameters"] + p.memory["optimizer"]) if p else "-",
        ],
        ["  batch", fmt_bytes(m.parts["batch"]), "-"],
        ["  temporaries", fmt_bytes(m.temp_bytes), "-"],
    ]
    for axis in sorted(
        set(m.comm_bytes) | set(p.comm_bytes if p else ()), key=lambda a: -m.comm_bytes.get(a, 0)
    ):
        got, want = m.comm_bytes.get(axis, 0.0), (p.comm_bytes.get(axis) if p else None)
        if got >= 1024 or (want or 0) >= 1024:
            rows.append([f"moved over {axis}", fmt_bytes(got), "-" if want is None else fmt_bytes(want)])
    if p is not None:
        step = f"{p.step_time_s:.3f} s" if p.step_time_s >= 1 else f"{p.step_time_s * 1e3:.3g} ms"
        rows.append(["step time", "-", step])
        rows.append(["MFU", "-", f"{100 * p.mfu:.1f}%"])
    compiler = "XLA:TPU" if m.platform == "tpu" else f"XLA:{m.platform.upper()}"
    console.print(
        table(
            f"Per device, compiled by {compiler} in {m.compile_s:.0f} s", ["", "compiled", "predicted"], rows
        )
    )
    if hw is None:
        console.print(
            "no figures for these devices in the planner's hardware table: no fit or time predicted"
        )
    elif result.fits:
        console.print(
            f"fits: {fmt_bytes(m.peak_bytes)} of {fmt_bytes(hw.memory_bytes)} HBM per chip ({hw.name})",
            highlight=False,
        )
    else:
        console.print(
            f"[red]does not fit[/]: {fmt_bytes(m.peak_bytes)} per chip, {fmt_bytes(hw.memory_bytes)} HBM ({hw.name})",
            highlight=False,
        )
