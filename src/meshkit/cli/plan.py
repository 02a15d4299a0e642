"""``meshkit plan``: rank the parallel layouts of a model on a cluster by predicted step time, or
evaluate one layout; ``--compile K`` compiles the top K on simulated devices beside the prediction.

Thin over ``meshkit.planner`` (the model, the search, the hardware table, the presets)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from meshkit._errors import MeshkitError
from meshkit.cli._format import console, fmt_bytes, print_json, table
from meshkit.spec import (
    CONTEXT_ATTENTION,
    PIPELINE_SCHEDULES,
    PRECISIONS,
    REMAT_ALIASES,
    REMAT_POLICIES,
    one_of,
)

_M = "Model"
_C = "Cluster"
_J = "Job"
_L = "One layout (--layout)"
_O = "Output"


def _opt(panel: str, help: str, *decls: str, **kw) -> typer.models.OptionInfo:
    return typer.Option(*decls, help=help, rich_help_panel=panel, **kw)


def plan(
    model: Annotated[
        str | None,
        _opt(
            _M,
            "A preset (gpt2-124m ... gpt-13b, llama-7b ... llama3-8b, mixtral-8x7b, mixtral-8x22b), or "
            "module:function returning a ModelShape or meshkit GPT parameters (with --heads).",
        ),
    ] = None,
    layers: Annotated[int | None, _opt(_M, "Transformer blocks.")] = None,
    width: Annotated[int | None, _opt(_M, "Model width.")] = None,
    heads: Annotated[int | None, _opt(_M, "Attention heads.")] = None,
    vocab: Annotated[int | None, _opt(_M, "Vocabulary size.")] = None,
    seq: Annotated[int | None, _opt(_M, "Sequence length.")] = None,
    ffn: Annotated[int | None, _opt(_M, "MLP hidden size (default 4 x width).")] = None,
    gated: Annotated[
        bool | None, _opt(_M, "SwiGLU MLP (LLaMA-style), no biases.", "--gated/--no-gated")
    ] = None,
    kv_heads: Annotated[
        int | None, _opt(_M, "Key/value heads (grouped-query attention; default heads).")
    ] = None,
    head_dim: Annotated[int | None, _opt(_M, "Width of one head (default width / heads).")] = None,
    experts: Annotated[
        int | None, _opt(_M, "Mixture of experts: MLPs of width --ffn per layer (0: a dense MLP).")
    ] = None,
    experts_per_token: Annotated[
        int | None, _opt(_M, "Mixture of experts: experts a token is routed to.")
    ] = None,
    capacity_factor: Annotated[
        float | None, _opt(_M, "Mixture of experts: expert buffers' slots per routed token (1.25 usual).")
    ] = None,
    devices: Annotated[int, _opt(_C, "Devices in the cluster.")] = 8,
    devices_per_host: Annotated[
        int | None, _opt(_C, "Devices per host (default: the hardware's node).")
    ] = None,
    hardware: Annotated[
        str, _opt(_C, "a100-40gb, a100-80gb, h100, h200, tpu-v4, tpu-v5e, tpu-v5p, or custom.")
    ] = "h100",
    peak_tflops: Annotated[
        float | None, _opt(_C, "Dense bf16 TFLOP/s per device (custom; overrides a named device's).")
    ] = None,
    memory_gb: Annotated[float | None, _opt(_C, "HBM GB per device (custom; overrides).")] = None,
    hbm_gbps: Annotated[float | None, _opt(_C, "HBM GB/s (custom; overrides).")] = None,
    intra_gbps: Annotated[
        float | None, _opt(_C, "GB/s per device per direction inside a host (custom; overrides).")
    ] = None,
    inter_gbps: Annotated[
        float | None, _opt(_C, "GB/s per device per direction between hosts (custom; overrides).")
    ] = None,
    family: Annotated[
        str, _opt(_C, "custom: calibrated efficiency of gpu-ampere, gpu-hopper or tpu.")
    ] = "gpu-hopper",
    global_batch: Annotated[int, _opt(_J, "Sequences per optimizer step.")] = 512,
    precision: Annotated[
        str,
        _opt(_J, f"{one_of(PRECISIONS)}; bytes per parameter: mixed-precision Adam 2+2+12, fp32 Adam 4+4+8."),
    ] = "bf16",
    optimizer_bytes: Annotated[
        float | None, _opt(_J, "Optimizer state bytes per parameter (default 12 bf16, 8 fp32).")
    ] = None,
    flash_attention: Annotated[
        bool,
        _opt(_J, "Attention without a stored S x S score matrix.", "--flash-attention/--no-flash-attention"),
    ] = True,
    runtime: Annotated[
        str, _opt(_J, "standard (Megatron-style) or meshkit (meshkit's compiled programs).")
    ] = "standard",
    stack: Annotated[
        str,
        _opt(
            _J,
            "Software whose efficiency to assume: maxtext-xla (JAX/XLA, what meshkit runs), megatron-te, "
            "torchtitan or deepspeed, each calibrated on its published runs.",
        ),
    ] = "maxtext-xla",
    context_attention: Annotated[
        str, _opt(_J, f"Context parallelism's attention: {one_of(CONTEXT_ATTENTION)}.")
    ] = "ring",
    layout: Annotated[
        str | None,
        _opt(
            _L,
            "Evaluate one layout, e.g. dp=24,tp=8,pp=8, or with context / expert degrees dp=4,tp=8,pp=16,cp=16.",
        ),
    ] = None,
    microbatch_size: Annotated[int, _opt(_L, "Sequences per micro-batch per replica.")] = 1,
    schedule: Annotated[str, _opt(_L, f"{one_of(PIPELINE_SCHEDULES)}.")] = "1f1b",
    virtual_stages: Annotated[
        int,
        _opt(
            _L,
            "Interleaved: chunks per device.",
            show_default="interleaved: 2 where it divides the layers per stage, else 1",
        ),
    ] = 0,
    remat: Annotated[
        str, _opt(_L, one_of(REMAT_POLICIES, notes={v: f"= {k}" for k, v in REMAT_ALIASES.items()}) + ".")
    ] = "none",
    zero: Annotated[int, _opt(_L, "ZeRO stage over the data axis: 0, 1, 2, 3.")] = 0,
    shard_group: Annotated[
        int,
        _opt(
            _L,
            "ZeRO-3 over groups of N data-parallel devices, replicated across the groups (hybrid sharding).",
            show_default="all of dp",
        ),
    ] = 0,
    top: Annotated[int, _opt(_O, "Ranked layouts to show.")] = 10,
    json: Annotated[bool, _opt(_O, "Print JSON instead of tables.")] = False,
    plot: Annotated[Path | None, _opt(_O, "Write the step time vs peak memory plot to FILE (.png).")] = None,
    out: Annotated[Path | None, _opt(_O, "Write plan.json and plan.png into DIR.")] = None,
    compile: Annotated[
        int, _opt(_O, "Compile the top K layouts ahead of time on simulated CPU devices.")
    ] = 0,
) -> None:
    """Choose a parallel layout: predicted memory, communication, bubble, step time and MFU per layout."""
    from meshkit.analysis import MAX_DEVICES

    if not 1 <= devices <= MAX_DEVICES:  # the search enumerates the divisors of the count: bound it first
        raise MeshkitError(f"--devices {devices:,} is not a device count: give 1 to {MAX_DEVICES:,}")
    from meshkit.planner import Layout, ModelShape, predict
    from meshkit.planner.presets import preset

    figures = dict(peak_tflops=peak_tflops, memory_gb=memory_gb, hbm_gbps=hbm_gbps, intra_gbps=intra_gbps,
                   inter_gbps=inter_gbps)  # fmt: skip
    if top < 1:
        raise MeshkitError(f"--top {top}: show at least 1 layout")
    if compile < 0:
        raise MeshkitError(f"--compile {compile}: compile 0 or more layouts")
    moe = {"experts": experts, "experts_per_token": experts_per_token, "capacity_factor": capacity_factor}
    shape = _shape(
        model, layers, width, heads, vocab, seq, ffn, gated, kv_heads, head_dim, preset, ModelShape, moe
    )
    cluster, job = _cluster_and_job(figures, hardware, devices, devices_per_host, family, global_batch, precision,
                                    optimizer_bytes, flash_attention, runtime, stack, context_attention)  # fmt: skip
    notes: list[str] = []
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        plot = plot or out / "plan.png"
    if layout is not None:
        v = virtual_stages or _virtual(schedule, shape.layers, layout, notes)
        one = Layout.parse(layout, microbatch_size=microbatch_size, schedule=schedule, virtual_stages=v,
                           remat=remat, zero=zero)  # fmt: skip
        pred = predict(shape, one, cluster, job, shard_group=shard_group)
        if not pred.valid:
            raise MeshkitError(f"layout {one.label()} cannot run: {pred.why}")
        preds, result = [pred], None
    else:
        if shard_group:
            raise MeshkitError(
                "--shard-group prices one layout: give --layout too (the search tries hybrid sharding itself)"
            )
        result = _search(shape, cluster, job)
        preds = result.ranked[:top]
    if job.runtime == "meshkit" and any(p.layout.cp > 1 or p.layout.ep > 1 for p in preds):
        notes.append("--runtime meshkit prices layouts with context (cp) or expert (ep) axes with the analytic "
                     "model: meshkit's traced layer does not price them yet")  # fmt: skip
    runnable = [p for p in (preds if result is None else result.ranked) if p.meshkit_plan()]
    measured = _compile(shape, runnable[:compile], cluster, job) if compile else None
    payload = _payload(shape, cluster, job, preds, result, measured, notes)
    if out is not None:
        (out / "plan.json").write_text(__import__("json").dumps(payload, indent=2, default=str) + "\n")
    if plot is not None:
        _plot(preds if result is None else result.ranked + result.rejected, preds[0], plot)
    if json:
        print_json(payload)
        return
    for note in notes:
        console.print(f"note: {note}", highlight=False, style="dim")
    _print(shape, cluster, job, preds, result, measured, single=layout is not None)
    if plot is not None:
        console.print(f"plot: {plot}")


def _cluster_and_job(figures, hardware, devices, devices_per_host, family, global_batch, precision, optimizer_bytes,
                     flash_attention, runtime, stack, context_attention="ring"):  # fmt: skip
    """The cluster (a named device, its figures overridden by the flags given, or a custom one) and the
    job, every number checked (finite, positive) with a line naming its flag."""
    from meshkit.planner import Cluster, Job
    from meshkit.planner.hardware import check_number, custom, override
    from meshkit.planner.hardware import hardware as get_hardware
    from meshkit.planner.stacks import stack_for

    for flag, value in figures.items():
        check_number(flag, value)
    check_number("optimizer_bytes", optimizer_bytes, zero=True)
    if hardware.strip().lower() == "custom":
        hw = custom(**figures, devices_per_host=devices_per_host or 8, family=family)
    else:
        hw = override(get_hardware(hardware), **figures)
    cluster = Cluster(hardware=hw, devices=devices, devices_per_host=devices_per_host or 0)
    job = Job(global_batch=global_batch, precision=precision, optimizer_bytes=optimizer_bytes,
              flash_attention=flash_attention, runtime=runtime, stack=stack.strip().lower(),
              context_attention=context_attention.strip().lower())  # fmt: skip
    stack_for(job, hw)
    return cluster, job


def _search(shape, cluster, job):
    """Every layout ranked; where none fits, one line saying by how much the closest misses."""
    from meshkit.planner import search

    result = search(shape, cluster, job)
    if result.best is None:
        close = result.closest()
        if close is None:
            raise MeshkitError(
                f"no layout of {shape.name} runs on {cluster.devices} devices with global batch {job.global_batch}: "
                f"use a global batch that divides over the data-parallel degrees (e.g. a multiple of {cluster.devices})"
            )
        raise MeshkitError(
            f"{shape.name} fits no layout on {cluster.devices} x {cluster.hardware.name}: the best, {close.label()}, "
            f"needs {close.peak_bytes / 1e9:.1f} GB per device of {close.limit_bytes / 1e9:.1f} GB usable "
            f"({close.peak_bytes / close.limit_bytes:.2f}x too large): add devices, or use larger ones"
        )
    return result


def _virtual(schedule: str, layers: int, layout: str, notes: list[str]) -> int:
    """Interleaved without --virtual-stages: 2 chunks per device where they divide its layers, else 1
    (and without a pipeline, where the schedule means nothing), said in ``notes``."""
    if schedule != "interleaved":
        return 1
    pp = dict(p.split("=", 1) for p in layout.replace(" ", "").split(",") if "=" in p).get("pp", "1")
    if not pp.isdigit() or int(pp) <= 1:
        notes.append("--schedule interleaved without a pipeline (pp=1): no schedule applies")
        return 1
    p = int(pp)
    if layers % p or (layers // p) % 2:
        why = (
            f"pp={p} does not divide the {layers} layers"
            if layers % p
            else f"the {layers // p} layers per stage are odd"
        )
        notes.append(f"interleaved with 1 virtual stage (plain 1F1B order): {why}, so 2 chunks per device do not "
                     "fit; give --virtual-stages to choose")  # fmt: skip
        return 1
    return 2


def _shape(
    model, layers, width, heads, vocab, seq, ffn, gated, kv_heads, head_dim, preset, ModelShape, moe=None
):
    sizes = {"layers": layers, "width": width, "heads": heads, "vocab": vocab, "seq": seq, "ffn": ffn,
             "gated": gated, "kv_heads": kv_heads, "head_dim": head_dim, **(moe or {})}  # fmt: skip
    given = {k: v for k, v in sizes.items() if v is not None}
    from meshkit.planner.hardware import check_number

    check_number("capacity_factor", given.get("capacity_factor"))
    if model is not None and ":" in model:
        return _user_shape(model, heads, seq, ModelShape)
    if model is not None:
        base = preset(model)
        if not given:
            return base
        import dataclasses

        if "width" in given and "ffn" not in given and not base.gated:
            given["ffn"] = 0
        if ("width" in given or "heads" in given) and "head_dim" not in given:
            given["head_dim"] = 0
        if "heads" in given and "kv_heads" not in given and base.kv_heads == base.heads:
            given["kv_heads"] = 0  # multi-head attention stays multi-head
        return dataclasses.replace(base, **given)  # a preset with sizes overridden
    missing = [k for k in ("layers", "width", "heads", "vocab", "seq") if k not in given]
    if missing:
        raise MeshkitError(
            f"give --model NAME or the model's sizes: missing {', '.join('--' + k for k in missing)}"
        )
    name = f"gpt L{layers} D{width}"
    return ModelShape(name=name, **{k: v for k, v in given.items() if v is not None})


def _user_shape(target: str, heads, seq, ModelShape):
    """A user's model as ``module:function``: the function returns a ``ModelShape``, or the
    parameters (arrays or ``jax.ShapeDtypeStruct``s) of meshkit's reference GPT, list or scanned
    form, whose sizes give layers, width, MLP width, vocabulary and positions (``--heads`` gives the
    heads, which no parameter shape records; ``--seq`` a sequence shorter than the positions)."""
    from meshkit._errors import TargetError
    from meshkit.cli._target import call, resolve

    fn = resolve(target, what="model target", example="mymodel:shape")
    made = call(target, fn) if callable(fn) else fn
    if isinstance(made, ModelShape):
        return made
    if isinstance(made, dict) and {"tok_embed", "pos_embed", "blocks", "unembed"} <= set(made):
        if heads is None:
            raise TargetError(
                f"{target} returned GPT parameters, which do not record the heads: pass --heads"
            )
        blocks = made["blocks"]
        try:
            if isinstance(blocks, list | tuple):
                layers, w_in = len(blocks), blocks[0]["mlp"]["w_in"].shape
            else:
                layers, w_in = blocks["mlp"]["w_in"].shape[0], blocks["mlp"]["w_in"].shape[1:]
            vocab, width = made["tok_embed"].shape
            positions = made["pos_embed"].shape[0]
        except (KeyError, IndexError, AttributeError, TypeError, ValueError):
            raise TargetError(
                f"{target} returned parameters not shaped as meshkit's GPT: return a meshkit.planner.ModelShape"
            ) from None
        return ModelShape(name=target, layers=layers, width=width, heads=heads, vocab=vocab,
                          seq=seq or positions, ffn=w_in[-1])  # fmt: skip
    raise TargetError(
        f"{target} returned {type(made).__name__}: return a meshkit.planner.ModelShape, or meshkit's GPT "
        f"parameters (tok_embed, pos_embed, blocks, unembed) with --heads"
    )


def _compile(shape, preds, cluster, job):
    """Measured (compiled on simulated devices) for each prediction, with meshkit's own runtime's
    prediction to compare against. ``preds`` are the ranked layouts meshkit can run (a layout with no
    meshkit plan, e.g. ZeRO-1 with tensor parallelism, is passed over: it could not be compiled)."""
    import dataclasses

    from meshkit.planner import predict

    try:
        from meshkit.planner.compile import compile_layouts
    except ImportError:
        raise MeshkitError("--compile needs meshkit.planner.compile, which this install lacks") from None
    layouts = [p.layout for p in preds]
    got = compile_layouts(shape, layouts, job, progress=True, console=console)
    mk = dataclasses.replace(job, runtime="meshkit", flash_attention=False)  # meshkit's GPT stores S x S
    return [(m, predict(shape, p.layout, cluster, mk)) for p, m in zip(preds, got, strict=True)]


def _stack(job, preds) -> dict:
    """The software stack the prediction assumes, and where its efficiency comes from."""
    from meshkit.planner.stacks import CALIBRATION, STACKS

    first = preds[0]
    return {"name": job.stack, "label": STACKS[job.stack].label, "efficiency_source": first.efficiency_source,
            "calibration": CALIBRATION.to_json()}  # fmt: skip


def _payload(shape, cluster, job, preds, result, measured, notes) -> dict:
    import dataclasses

    out = {
        "model": dataclasses.asdict(shape),
        "cluster": {"hardware": cluster.hardware.to_json(), "devices": cluster.devices,
                    "devices_per_host": cluster.devices_per_host},
        "job": dataclasses.asdict(job),
        "stack": _stack(job, preds),
        "notes": notes,
        "layouts": [p.to_json() for p in preds],
    }  # fmt: skip
    if result is not None:
        out["considered"] = len(result.ranked) + len(result.rejected)
        out["fitting"] = len(result.ranked)
        out["rejected"] = [{"why": k, "layouts": n} for k, n in result.reasons()]
    if measured is not None:
        out["compiled"] = [
            {**m.to_json(), "predicted_meshkit": {"peak_bytes": p.peak_bytes, "comm_bytes": p.comm_bytes}}
            for m, p in measured
        ]
    return out


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def _pct(x: float, total: float) -> str:
    return f"{100 * x / total:.0f}" if total else "-"


def _print(shape, cluster, job, preds, result, measured, single: bool) -> None:
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
    # the context and expert columns where a layout shown has those axes, or the model has experts
    axes = shape.experts > 0 or any(p.layout.cp > 1 or p.layout.ep > 1 for p in preds)
    names = ["compute", "tp", "dp", "pp"] + ["cp", "ep"] * axes + ["bubble"]
    cols = ["#", "layout", *["cp", "ep"] * axes, "meshkit plan", "peak/device", "step", "tokens/s", "MFU", "TFLOP/s",
            "% " + "/".join(names)]  # fmt: skip
    keys = (
        ["compute", "comm_model", "comm_data", "comm_stage"]
        + ["comm_context", "comm_expert"] * axes
        + ["bubble"]
    )
    rows = []
    for i, p in enumerate(preds, 1):
        s, pa = p.step_time_s, p.parts
        split = "/".join(_pct(pa[k], s) for k in keys)
        rows.append([i, p.label(), *[p.layout.cp, p.layout.ep] * axes, p.meshkit_plan() or "-",
                     fmt_bytes(p.peak_bytes, decimal=True) + ("" if p.fits else " (no fit)"),
                     _seconds(s), f"{p.tokens_per_s:,.0f}", f"{100 * p.mfu:.1f}%",
                     f"{p.hardware_tflops_per_device:.0f}", split])  # fmt: skip
    title = (
        f"Predicted ({job.stack})"
        if single
        else f"Layouts that fit, fastest first (top {len(preds)} of {len(result.ranked)}; {job.stack})"
    )
    t = table(title, cols, rows, justify_right=5 if axes else 3)
    t.columns[1].no_wrap = True
    console.print(t)
    console.print("MFU: model FLOPs (no recompute) / peak; TFLOP/s: hardware FLOPs per device (with recompute)",
                  highlight=False, style="dim")  # fmt: skip
    if single:
        p = preds[0]
        mem = [[k, fmt_bytes(v, decimal=True)] for k, v in p.memory.items()]
        mem.append(["peak", fmt_bytes(p.peak_bytes, decimal=True)])
        mem.append([f"usable ({hw.name})", fmt_bytes(p.limit_bytes, decimal=True)])
        console.print(table("Memory per device", ["component", "bytes"], mem))
        comm = [[axis, fmt_bytes(p.comm_bytes[axis], decimal=True), "yes" if p.crosses_hosts[axis] else "no",
                 f"{p.parts['comm_' + name]:.3f} s" if axis == name else f"(with {name})"]
                for axis, name in (("model", "model"), ("data", "data"), ("replica", "data"), ("stage", "stage"),
                                   ("context", "context"), ("expert", "expert"))
                if axis in p.comm_bytes]  # fmt: skip
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
    else:
        summary = ", ".join(f"{n} {k}" for k, n in result.reasons())
        considered = len(result.ranked) + len(result.rejected)
        console.print(f"rejected {len(result.rejected)} of {considered} layouts" + (f": {summary}" if summary else ""),
                      highlight=False)  # fmt: skip
        console.print(f"choice: [bold]{preds[0].label()}[/]", highlight=False)
    if measured:
        rows = []
        for m, p in measured:
            if not m.ok:
                rows.append([m.layout.label(), "-", fmt_bytes(p.peak_bytes), "-", "-", "-", m.error])
                continue
            pc, mc = sum(p.comm_bytes.values()), m.total_comm_bytes
            rows.append([m.layout.label(), fmt_bytes(m.peak_bytes), fmt_bytes(p.peak_bytes),
                         f"{m.peak_bytes / p.peak_bytes:.2f}", fmt_bytes(mc), fmt_bytes(pc),
                         f"{mc / pc:.2f}" if pc else "-"])  # fmt: skip
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
        console.print("compiled: the top layouts meshkit runs; XLA:CPU moves bf16 collectives as f32, so in bf16 "
                      "compiled bytes read 2x the accelerator's", highlight=False)  # fmt: skip


def _plot(preds, choice, path: Path) -> None:
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
    ax.scatter([choice.peak_bytes / 1e9], [choice.step_time_s], s=120, marker="*", c="tab:orange", zorder=5,
               label=f"choice: {choice.label()}")  # fmt: skip
    ax.set(xlabel="predicted peak memory per device (GB)", ylabel="predicted step time (s)",
           title="meshkit plan: layouts")  # fmt: skip
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def register(app: typer.Typer) -> None:
    app.command()(plan)
