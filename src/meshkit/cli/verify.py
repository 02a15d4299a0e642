"""``meshkit verify``: a plan beside single-device and float64 runs, and its cost beside the model."""

from __future__ import annotations

from typing import Annotated

import typer

from meshkit.cli._format import console, fmt_bytes, print_json, table
from meshkit.cli.ledger import DevicesOpt, JsonOpt


def verify(
    plan: Annotated[
        str,
        typer.Option(
            help="dp, zero1, zero2, zero3 (fsdp), tp, dp+tp, fsdp+tp; pipelines pp, dp+pp, fsdp+pp, tp+pp, dp+tp+pp, fsdp+tp+pp."
        ),
    ] = "dp",
    model: Annotated[
        str,
        typer.Option(help="linear, mlp, gpt, gpt-scan (the GPT's blocks stacked under lax.scan), or llama."),
    ] = "mlp",
    mesh: Annotated[
        str | None, typer.Option(help="Mesh such as data=8 or data=4,model=2 (default: per plan).")
    ] = None,
    steps: Annotated[int, typer.Option(help="Adam steps to compare.")] = 20,
    accumulate: Annotated[int, typer.Option(help="Micro-batches accumulated per step.")] = 1,
    remat: Annotated[
        str, typer.Option(help="Activation checkpointing per layer: none, layer, dots or regather.")
    ] = "none",
    pipeline_schedule: Annotated[
        str | None,
        typer.Option(
            "--pipeline-schedule",
            "--schedule",
            help="Pipeline plans: gpipe, 1f1b or interleaved (default 1f1b).",
        ),
    ] = None,
    microbatches: Annotated[
        int | None, typer.Option(help="Pipeline plans: micro-batches per step (default: the stages).")
    ] = None,
    virtual_stages: Annotated[
        int, typer.Option(help="Interleaved schedule: chunks of layers per device.")
    ] = 1,
    devices: DevicesOpt = 8,
    json: JsonOpt = False,
) -> None:
    """Certify a plan: parameters vs one device and NumPy float64, measured cost vs model. Exit 1 if a check fails."""
    from meshkit.cli.ledger import _simulate

    _simulate(devices)
    from meshkit.verify import TOL_EXACT, TOL_FLOAT64, TOL_SINGLE
    from meshkit.verify import verify as run_verify

    cert = run_verify(plan, model, mesh=mesh, steps=steps, accumulate=accumulate, remat=remat,
                      microbatches=microbatches, pipeline_schedule=pipeline_schedule, virtual_stages=virtual_stages)  # fmt: skip
    if json:
        print_json(cert.to_json())
    else:
        _print(cert, TOL_SINGLE, TOL_FLOAT64, TOL_EXACT)
    if not cert.ok:
        raise typer.Exit(1)


def _print(cert, tol_single: float, tol_f64: float, tol_exact: float) -> None:
    r = cert.report
    mesh = ",".join(f"{k}={v}" for k, v in r.mesh.items())
    console.print(
        f"plan [bold]{cert.plan}[/] on {cert.model}, mesh {mesh}, {cert.steps} Adam steps, "
        f"accumulate {cert.accumulate}; final loss {cert.final_loss:.6f}"
    )
    from meshkit.verify import NOISE_FACTOR

    bound = tol_single if cert.float32_noise is None else max(tol_single, NOISE_FACTOR * cert.float32_noise)
    rows = [
        ["vs single device (max rel. diff)", f"{cert.vs_single_device:.2e}", f"<= {bound:.2g}"],
        ["bitwise equal to single device", cert.bitwise_vs_single_device, "(informational)"],
        ["vs NumPy float64 (max rel. diff)", "-" if cert.vs_float64 is None else f"{cert.vs_float64:.2e}", f"<= {tol_f64:g}"],
        ["float64 plan vs float64 single device", "-" if cert.exact_vs_single_device is None else f"{cert.exact_vs_single_device:.2e}", f"<= {tol_exact:g}"],
        ["float32 noise floor (single f32 vs f64)", "-" if cert.float32_noise is None else f"{cert.float32_noise:.2e}", "x2 bounds the f32 check"],
        ["bitwise reproducible run to run", cert.reproducible, "True"],
    ]  # fmt: skip
    console.print(table("Equivalence", ["check", "measured", "required"], rows))
    rows = [
        [c.op, c.axes, c.measured_runs, fmt_bytes(c.measured_traffic_bytes), fmt_bytes(c.model_traffic_bytes),
         "-" if c.ratio is None else f"{c.ratio:.4f}", "ok" if c.ok else "FAIL"]
        for c in r.communication
    ]  # fmt: skip
    cols = ["op", "axes", "instr. runs", "measured traffic/device", "model", "ratio", ""]
    console.print(table("Communication per step (ring model, scalars aside)", cols, rows))
    rows = [
        [m.component, fmt_bytes(m.measured_bytes), fmt_bytes(m.formula_bytes), f"{m.ratio:.4f}", "ok" if m.ok else "FAIL"]
        for m in r.memory
    ]  # fmt: skip
    cm = r.compiled_memory
    rows.append(["compiled: arguments", fmt_bytes(cm.argument_bytes), "", "", ""])
    rows.append(["compiled: temporaries", fmt_bytes(cm.temp_bytes), "", "", ""])
    if r.peak is not None:  # arguments + temporaries beside the peak model (meshkit.analysis.peak)
        pk = r.peak
        rows.append(["peak (arguments + temporaries)", fmt_bytes(pk["measured_bytes"]), fmt_bytes(pk["model_bytes"]),
                     f"{pk['ratio']:.4f}", "ok" if pk["ok"] else "see below"])  # fmt: skip
    console.print(table("Per-device memory", ["component", "measured", "formula", "ratio", ""], rows))
    if r.pipeline is not None:
        console.print(r.pipeline.table())
    reasons: dict[str, list[str]] = {}
    for path, why in r.replicated:
        reasons.setdefault(why, []).append(path)
    if r.peak is not None:
        console.print(f"layers: {r.peak['layers']}; remat {r.peak['remat']}", soft_wrap=True, highlight=False)
        if "explanation" in r.peak:
            console.print(
                f"peak beyond 10% of the model: {r.peak['explanation']}", soft_wrap=True, highlight=False
            )
    for why, paths in reasons.items():
        console.print(f"kept whole on the data axis ({why}): {len(paths)} leaves: {', '.join(paths)}")
    verdict = (
        "[bold green]ok[/]"
        if cert.ok
        else "[bold red]FAILED[/]: " + ", ".join(k for k, v in cert.checks.items() if not v)
    )
    console.print(verdict)


def register(app: typer.Typer) -> None:
    app.command()(verify)
