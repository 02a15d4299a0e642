"""What ``meshkit plan`` prints, writes as JSON and plots: the header (model, cluster, job, stack),
the ranking table, one layout's memory and communication, the search's summary and the compiled
layouts beside their prediction."""

from __future__ import annotations

from pathlib import Path

from meshkit.cli._format import console, fmt_bytes, table


def _stack(job, preds, calibration=None) -> dict:
    """The software stack the prediction assumes, and where its efficiency comes from (``calibration``:
    ``--calibration``'s, else the published runs')."""
    from meshkit.planner.stacks import CALIBRATION, STACKS

    first = preds[0]
    return {
        "name": job.stack,
        "label": STACKS[job.stack].label,
        "efficiency_source": first.efficiency_source,
        "calibration": (calibration or CALIBRATION).to_json(),
    }


def payload(shape, cluster, job, preds, result, measured, notes, target=None, calibration=None) -> dict:
    import dataclasses

    out = {
        "model": dataclasses.asdict(shape),
        "cluster": {
            "hardware": cluster.hardware.to_json(),
            "devices": cluster.devices,
            "devices_per_host": cluster.devices_per_host,
        },
        "job": dataclasses.asdict(job),
        "target": target,
        "stack": _stack(job, preds, calibration),
        "notes": notes,
        "layouts": [p.to_json() for p in preds],
    }
    if result is not None:
        out["considered"] = len(result.ranked) + len(result.rejected)
        out["fitting"] = len(result.ranked)
        out["rejected"] = [{"why": k, "layouts": n} for k, n in result.reasons()]
    if measured is not None:
        key = "predicted" if target else "predicted_meshkit"
        out["compiled"] = [
            {
                **m.to_json(),
                "fits": _fits(m, cluster),
                key: {
                    "peak_bytes": p.peak_bytes,
                    "comm_bytes": p.comm_bytes,
                    "step_time_s": p.step_time_s,
                    "mfu": p.mfu,
                },
            }
            for m, p in measured
        ]
    return out


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def _pct(x: float, total: float) -> str:
    return f"{100 * x / total:.0f}" if total else "-"


def _fits(m, cluster) -> bool | None:
    """Whether a compiled layout fits the device's memory: None where it was not compiled for another
    reason, or compiled on simulated CPU devices (their memory is the host's)."""
    if m.no_fit:
        return False
    if not m.ok or m.platform != "tpu":
        return None
    return m.peak_bytes <= cluster.hardware.memory_bytes


def print_report(shape, cluster, job, preds, result, measured, single: bool, target=None) -> None:
    """The tables of one ``meshkit plan`` run (``single``: one layout given with --layout)."""
    _header(shape, cluster, job, preds)
    _ranking(shape, job, preds, result, single)
    if single:
        _one_layout(cluster, preds[0])
    else:
        summary = ", ".join(f"{n} {k}" for k, n in result.reasons())
        considered = len(result.ranked) + len(result.rejected)
        console.print(
            f"rejected {len(result.rejected)} of {considered} layouts" + (f": {summary}" if summary else ""),
            highlight=False,
        )
        console.print(f"choice: [bold]{preds[0].label()}[/]", highlight=False)
    if measured:
        (_compiled_for_target(measured, cluster, target) if target else _compiled(measured))


def _header(shape, cluster, job, preds) -> None:
    """The model, the cluster and the job in one line; the stack and its efficiency in another."""
    from meshkit.planner.sizes import active_param_count, param_count
    from meshkit.planner.stacks import STACKS

    hw = cluster.hardware
    moe = (
        f" ({_count(active_param_count(shape))} active: {shape.experts} experts, {shape.experts_per_token} a token)"
        if shape.experts
        else ""
    )
    console.print(
        f"[bold]{shape.name}[/]: {_count(param_count(shape))} parameters{moe}, {shape.layers} layers, width "
        f"{shape.width}, {shape.heads} heads, seq {shape.seq}, vocab {shape.vocab} | {cluster.devices} x "
        f"{hw.name} ({cluster.devices_per_host} per host) | global batch {job.global_batch}, {job.precision}",
        highlight=False,
    )
    console.print(
        f"stack {job.stack} ({STACKS[job.stack].label}): matmul efficiency {preds[0].efficiency:.2f} of peak, "
        f"{preds[0].efficiency_source}; --stack to assume another",
        highlight=False,
    )


def _ranking(shape, job, preds, result, single: bool) -> None:
    """The layouts' table: peak, step, tokens/s, MFU and the step's split by part."""
    # the context and expert columns where a layout shown has those axes, or the model has experts
    axes = shape.experts > 0 or any(p.layout.cp > 1 or p.layout.ep > 1 for p in preds)
    names = ["compute", "tp", "dp", "pp"] + ["cp", "ep"] * axes + ["bubble"]
    cols = [
        "#",
        "layout",
        *["cp", "ep"] * axes,
        "meshkit plan",
        "peak/device",
        "step",
        "tokens/s",
        "MFU",
        "TFLOP/s",
        "% " + "/".join(names),
    ]
    keys = (
        ["compute", "comm_model", "comm_data", "comm_stage"]
        + ["comm_context", "comm_expert"] * axes
        + ["bubble"]
    )
    rows = []
    for i, p in enumerate(preds, 1):
        s, pa = p.step_time_s, p.parts
        split = "/".join(_pct(pa[k], s) for k in keys)
        rows.append(
            [
                i,
                p.label(),
                *[p.layout.cp, p.layout.ep] * axes,
                p.meshkit_plan() or "-",
                fmt_bytes(p.peak_bytes, decimal=True) + ("" if p.fits else " (no fit)"),
                _seconds(s),
                f"{p.tokens_per_s:,.0f}",
                f"{100 * p.mfu:.1f}%",
                f"{p.hardware_tflops_per_device:.0f}",
                split,
            ]
        )
    title = (
        f"Predicted ({job.stack})"
        if single
        else f"Layouts that fit, fastest first (top {len(preds)} of {len(result.ranked)}; {job.stack})"
    )
    t = table(title, cols, rows, justify_right=5 if axes else 3)
    t.columns[1].no_wrap = True
    console.print(t)
    console.print(
        "MFU: model FLOPs (no recompute) / peak; TFLOP/s: hardware FLOPs per device (with recompute)",
        highlight=False,
        style="dim",
    )


def _one_layout(cluster, p) -> None:
    """One layout's memory by component, communication by axis, and its summary line."""
    hw = cluster.hardware
    mem = [[k, fmt_bytes(v, decimal=True)] for k, v in p.memory.items()]
    mem.append(["peak", fmt_bytes(p.peak_bytes, decimal=True)])
    mem.append([f"usable ({hw.name})", fmt_bytes(p.limit_bytes, decimal=True)])
    console.print(table("Memory per device", ["component", "bytes"], mem))
    comm = [  # every axis the layout uses, as the prediction reports them (hsdp's replicas: data's part)
        [
            axis,
            fmt_bytes(moved, decimal=True),
            "yes" if p.crosses_hosts[axis] else "no",
            f"{p.parts['comm_' + axis]:.3f} s" if "comm_" + axis in p.parts else "(with data)",
        ]
        for axis, moved in p.comm_bytes.items()
    ]
    console.print(
        table("Communication per device per step", ["axis", "bytes", "crosses hosts", "exposed"], comm)
    )
    console.print(
        f"{'fits' if p.fits else '[red]does not fit[/]: ' + str(p.why)} | micro-batches {p.microbatches}, bubble "
        f"{p.bubble:.3f} | step {_seconds(p.step_time_s)}, {p.tokens_per_s:,.0f} tokens/s, MFU {100 * p.mfu:.1f}% "
        f"(model FLOPs), {p.hardware_tflops_per_device:.0f} TFLOP/s per device with recompute "
        f"(efficiency {p.efficiency:.3f} of peak)",
        highlight=False,
    )


def _compiled(measured) -> None:
    """The compiled layouts beside meshkit's runtime's prediction: peak and bytes moved."""
    rows = []
    for m, p in measured:
        if not m.ok:
            rows.append([m.layout.label(), "-", fmt_bytes(p.peak_bytes), "-", "-", "-", m.error])
            continue
        pc, mc = sum(p.comm_bytes.values()), m.total_comm_bytes
        rows.append(
            [
                m.layout.label(),
                fmt_bytes(m.peak_bytes),
                fmt_bytes(p.peak_bytes),
                f"{m.peak_bytes / p.peak_bytes:.2f}",
                fmt_bytes(mc),
                fmt_bytes(pc),
                f"{mc / pc:.2f}" if pc else "-",
            ]
        )
    cols = [
        "layout",
        "peak compiled",
        "peak predicted (meshkit)",
        "ratio",
        "comm compiled",
        "comm predicted",
        "ratio",
    ]
    console.print(table("Compiled ahead of time on simulated CPU devices", cols, rows))
    console.print(
        "compiled: the top layouts meshkit runs; XLA:CPU moves bf16 collectives as f32, so in bf16 "
        "compiled bytes read 2x the accelerator's",
        highlight=False,
    )


def _compiled_for_target(measured, cluster, target: str) -> None:
    """The layouts compiled for a TPU slice: per chip, XLA:TPU's peak against the chip's HBM and the
    prediction, the bytes each step moves against the model's, and the predicted step and MFU."""
    hw = cluster.hardware
    rows = []
    for m, p in measured:
        if not m.ok:
            rows.append(
                [
                    m.layout.label(),
                    "no" if m.no_fit else "-",
                    "-",
                    fmt_bytes(p.peak_bytes),
                    "-",
                    "-",
                    "-",
                    "-",
                    _seconds(p.step_time_s),
                    f"{100 * p.mfu:.1f}%",
                    m.error,
                ]
            )
            continue
        pc, mc = sum(p.comm_bytes.values()), m.total_comm_bytes
        fits = _fits(m, cluster)
        rows.append(
            [
                m.layout.label(),
                "yes" if fits else "[red]no[/]",
                fmt_bytes(m.peak_bytes),
                fmt_bytes(p.peak_bytes),
                f"{m.peak_bytes / p.peak_bytes:.2f}",
                _by_axis(m.comm_bytes),
                _by_axis(p.comm_bytes),
                f"{mc / pc:.2f}" if pc else "-",
                _seconds(p.step_time_s),
                f"{100 * p.mfu:.1f}%",
                "",
            ]
        )
    cols = [
        "layout",
        "fits",
        "peak/chip compiled",
        "predicted",
        "ratio",
        "moved/chip compiled",
        "predicted",
        "ratio",
        "step predicted",
        "MFU",
        "why not",
    ]
    title = (
        f"Compiled for {target} ({cluster.devices} x {hw.name}, {fmt_bytes(hw.memory_bytes)} HBM) by XLA:TPU"
    )
    console.print(table(title, cols, rows))
    console.print(
        "compiled: libtpu's compiler for the slice's chips, from abstract shapes (nothing ran); peak: the "
        "compiler's own per-chip peak; moved: bytes each chip sends per step, by mesh axis (meshkit's ledger of "
        "the TPU program)",
        highlight=False,
        style="dim",
    )


def _by_axis(comm: dict[str, float]) -> str:
    """Bytes per mesh axis, largest first (``data 1.2 GB, model 40 MB``); scalars' axes under 1 KB left out."""
    kept = sorted(((k, v) for k, v in comm.items() if v >= 1024), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in kept) or "0"


def plot(preds, choice, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    valid = [p for p in preds if p.valid]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for fits, colour, label in ((True, "tab:blue", "fits"), (False, "tab:gray", "does not fit")):
        xs = [p.peak_bytes / 1e9 for p in valid if p.fits == fits]
        ys = [p.step_time_s for p in valid if p.fits == fits]
        ax.scatter(xs, ys, s=10, c=colour, alpha=0.6, label=f"{label} ({len(xs)})")
    limit = choice.limit_bytes / 1e9
    ax.axvline(limit, color="tab:red", ls="--", lw=1, label=f"usable memory {limit:.0f} GB")
    ax.scatter(
        [choice.peak_bytes / 1e9],
        [choice.step_time_s],
        s=120,
        marker="*",
        c="tab:orange",
        zorder=5,
        label=f"choice: {choice.label()}",
    )
    ax.set(
        xlabel="predicted peak memory per device (GB)",
        ylabel="predicted step time (s)",
        title="meshkit plan: layouts",
    )
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
