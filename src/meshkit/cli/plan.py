"""``meshkit plan``: rank the parallel layouts of a model on a cluster by predicted step time, or
evaluate one layout; ``--compile K`` compiles the top K on simulated devices beside the prediction.

Thin over ``meshkit.planner`` (the model, the search, the hardware table, the presets)."""

from __future__ import annotations

import typer

from meshkit._errors import MeshkitError
from meshkit.cli import _plan_report as report
from meshkit.cli._format import console, print_json
from meshkit.cli._plan_options import (
    _Calibration,
    _CapacityFactor,
    _Compile,
    _ContextAttention,
    _Devices,
    _DevicesPerHost,
    _Experts,
    _ExpertsPerToken,
    _Family,
    _Ffn,
    _FlashAttention,
    _Gated,
    _GlobalBatch,
    _Hardware,
    _HbmGbps,
    _HeadDim,
    _Heads,
    _InterGbps,
    _IntraGbps,
    _Json,
    _KvHeads,
    _Layers,
    _Layout,
    _MemoryGb,
    _MicrobatchSize,
    _Model,
    _OptimizerBytes,
    _Out,
    _PeakTflops,
    _Plot,
    _Precision,
    _Remat,
    _Runtime,
    _Schedule,
    _Seq,
    _SequenceParallel,
    _ShardGroup,
    _Stack,
    _TargetOpt,
    _Top,
    _VirtualStages,
    _Vocab,
    _Width,
    _Zero,
)


def plan(
    model: _Model = None,
    layers: _Layers = None,
    width: _Width = None,
    heads: _Heads = None,
    vocab: _Vocab = None,
    seq: _Seq = None,
    ffn: _Ffn = None,
    gated: _Gated = None,
    kv_heads: _KvHeads = None,
    head_dim: _HeadDim = None,
    experts: _Experts = None,
    experts_per_token: _ExpertsPerToken = None,
    capacity_factor: _CapacityFactor = None,
    devices: _Devices = None,
    devices_per_host: _DevicesPerHost = None,
    hardware: _Hardware = None,
    target: _TargetOpt = None,
    peak_tflops: _PeakTflops = None,
    memory_gb: _MemoryGb = None,
    hbm_gbps: _HbmGbps = None,
    intra_gbps: _IntraGbps = None,
    inter_gbps: _InterGbps = None,
    family: _Family = "gpu-hopper",
    global_batch: _GlobalBatch = 512,
    precision: _Precision = "bf16",
    optimizer_bytes: _OptimizerBytes = None,
    flash_attention: _FlashAttention = True,
    sequence_parallel: _SequenceParallel = True,
    runtime: _Runtime = "standard",
    stack: _Stack = "maxtext-xla",
    calibration: _Calibration = None,
    context_attention: _ContextAttention = "ring",
    layout: _Layout = None,
    microbatch_size: _MicrobatchSize = 1,
    schedule: _Schedule = "1f1b",
    virtual_stages: _VirtualStages = 0,
    remat: _Remat = "none",
    zero: _Zero = 0,
    shard_group: _ShardGroup = 0,
    top: _Top = 10,
    json: _Json = False,
    plot: _Plot = None,
    out: _Out = None,
    compile: _Compile = 0,
) -> None:
    """Choose a parallel layout: predicted memory, communication, bubble, step time and MFU per layout."""
    devices, hardware = _on_target(target, devices, hardware)
    given = dict(locals())  # the options by name, for the helpers that read the model and the cluster
    _check_counts(devices, top, compile)
    from meshkit.planner import ModelShape
    from meshkit.planner.presets import preset

    moe = {"experts": experts, "experts_per_token": experts_per_token, "capacity_factor": capacity_factor}
    shape = _shape(
        model, layers, width, heads, vocab, seq, ffn, gated, kv_heads, head_dim, preset, ModelShape, moe
    )
    cluster, job = _cluster_and_job({k: given[k] for k in FIGURES}, **{k: given[k] for k in CLUSTER_AND_JOB})
    notes: list[str] = []
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        plot = plot or out / "plan.png"
    one = None if layout is None else {"text": layout, **{k: given[k] for k in ONE_LAYOUT}}
    from meshkit.planner import measured

    cal = None if calibration is None else measured.load(calibration)
    preds, result = _predictions(shape, cluster, job, notes, one, shard_group, top, cal)
    emitted = {
        "compile": compile,
        "out": out,
        "plot": plot,
        "as_json": json,
        "target": target,
        "calibration": cal,
    }
    _emit(shape, cluster, job, preds, result, notes, **emitted)


ONE_LAYOUT = ("microbatch_size", "schedule", "virtual_stages", "remat", "zero")
"""The options of the one layout ``--layout`` prices (``Layout.parse``'s keywords)."""


def _on_target(target: str | None, devices: int | None, hardware: str | None) -> tuple[int, str]:
    """(devices, hardware): ``--target``'s chips and their row of the hardware table (a slice's chips
    counted by libtpu, as it compiles for them), else the flags' or their defaults (8 x h100)."""
    if target is None:
        return (8 if devices is None else devices), (hardware or "h100")
    from meshkit.planner.hardware import for_device
    from meshkit.targets import target_devices

    chips = target_devices(target)
    hw = for_device(chips[0].device_kind)
    if hw is None:
        raise MeshkitError(
            f"--target {target}: the hardware table has no figures for {chips[0].device_kind!r}: plan it with "
            f"--hardware custom and its figures"
        )
    for flag, value, own in (("--devices", devices, len(chips)), ("--hardware", hardware, hw.name)):
        if value is not None and str(value).strip().lower() != str(own):
            raise MeshkitError(
                f"--target {target} is {len(chips)} x {hw.name}: drop {flag} {value}, or --target"
            )
    return len(chips), hw.name


def _check_counts(devices: int, top: int, compile: int) -> None:
    """The counts the search depends on, each refused in one line naming its flag."""
    from meshkit.analysis import MAX_DEVICES

    if not 1 <= devices <= MAX_DEVICES:  # the search enumerates the divisors of the count: bound it first
        raise MeshkitError(f"--devices {devices:,} is not a device count: give 1 to {MAX_DEVICES:,}")
    if top < 1:
        raise MeshkitError(f"--top {top}: show at least 1 layout")
    if compile < 0:
        raise MeshkitError(f"--compile {compile}: compile 0 or more layouts")


def _predictions(
    shape, cluster, job, notes: list[str], one: dict | None, shard_group: int, top: int, cal=None
):
    """(the predictions shown, the search or None): the one layout given (``one``: --layout and its
    options), or the top of every layout ranked; priced with ``cal`` (``--calibration``) where given."""
    from meshkit.planner import Layout, predict

    if one is not None:
        text = one.pop("text")
        one["virtual_stages"] = one["virtual_stages"] or _virtual(one["schedule"], shape.layers, text, notes)
        lay = Layout.parse(text, **one)
        pred = predict(shape, lay, cluster, job, shard_group=shard_group, calibration=cal)
        if not pred.valid:
            raise MeshkitError(f"layout {lay.label()} cannot run: {pred.why}")
        preds, result = [pred], None
    else:
        if shard_group:
            raise MeshkitError(
                "--shard-group prices one layout: give --layout too (the search tries hybrid sharding itself)"
            )
        result = _search(shape, cluster, job, cal)
        preds = result.ranked[:top]
    if job.runtime == "meshkit" and any(p.layout.cp > 1 or p.layout.ep > 1 for p in preds):
        notes.append(
            "--runtime meshkit prices layouts with context (cp) or expert (ep) axes with the analytic "
            "model: meshkit's traced layer does not price them yet"
        )
    return preds, result


def _emit(
    shape,
    cluster,
    job,
    preds,
    result,
    notes,
    *,
    compile: int,
    out,
    plot,
    as_json: bool,
    target=None,
    calibration=None,
) -> None:
    """Compile the top layouts meshkit runs (``compile``; for ``target``'s TPU chips where given), then
    write plan.json and the plot (``out``, ``plot``) and print the tables or the JSON."""
    runnable = [p for p in (preds if result is None else result.ranked) if p.meshkit_plan()]
    measured = (
        _compile(shape, runnable[:compile], cluster, job, target, as_json, calibration) if compile else None
    )
    payload = report.payload(shape, cluster, job, preds, result, measured, notes, target, calibration)
    if out is not None:
        (out / "plan.json").write_text(__import__("json").dumps(payload, indent=2, default=str) + "\n")
    if plot is not None:
        report.plot(preds if result is None else result.ranked + result.rejected, preds[0], plot)
    if as_json:
        print_json(payload)
        return
    for note in notes:
        console.print(f"note: {note}", highlight=False, style="dim")
    report.print_report(shape, cluster, job, preds, result, measured, single=result is None, target=target)
    if plot is not None:
        console.print(f"plot: {plot}")


FIGURES = ("peak_tflops", "memory_gb", "hbm_gbps", "intra_gbps", "inter_gbps")
"""The flags that override a device's figures."""
CLUSTER_AND_JOB = (
    "hardware",
    "devices",
    "devices_per_host",
    "family",
    "global_batch",
    "precision",
    "optimizer_bytes",
    "flash_attention",
    "runtime",
    "stack",
    "context_attention",
    "sequence_parallel",
)


def _cluster_and_job(
    figures,
    hardware,
    devices,
    devices_per_host,
    family,
    global_batch,
    precision,
    optimizer_bytes,
    flash_attention,
    runtime,
    stack,
    context_attention="ring",
    sequence_parallel=True,
):
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
    job = Job(
        global_batch=global_batch,
        precision=precision,
        optimizer_bytes=optimizer_bytes,
        flash_attention=flash_attention,
        sequence_parallel=sequence_parallel,
        runtime=runtime,
        stack=stack.strip().lower(),
        context_attention=context_attention.strip().lower(),
    )
    stack_for(job, hw)
    return cluster, job


def _search(shape, cluster, job, cal=None):
    """Every layout ranked; where none fits, one line saying by how much the closest misses."""
    from meshkit.planner import search

    result = search(shape, cluster, job, cal)
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
        notes.append(
            f"interleaved with 1 virtual stage (plain 1F1B order): {why}, so 2 chunks per device do not "
            "fit; give --virtual-stages to choose"
        )
        return 1
    return 2


def _shape(
    model, layers, width, heads, vocab, seq, ffn, gated, kv_heads, head_dim, preset, ModelShape, moe=None
):
    sizes = {
        "layers": layers,
        "width": width,
        "heads": heads,
        "vocab": vocab,
        "seq": seq,
        "ffn": ffn,
        "gated": gated,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        **(moe or {}),
    }
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
        return ModelShape(
            name=target,
            layers=layers,
            width=width,
            heads=heads,
            vocab=vocab,
            seq=seq or positions,
            ffn=w_in[-1],
        )
    raise TargetError(
        f"{target} returned {type(made).__name__}: return a meshkit.planner.ModelShape, or meshkit's GPT "
        f"parameters (tok_embed, pos_embed, blocks, unembed) with --heads"
    )


def _compile(shape, preds, cluster, job, target=None, quiet: bool = False, cal=None):
    """Measured (compiled on simulated devices, or for ``target``'s TPU chips) for each prediction, with
    the prediction to compare against: on simulated CPU devices meshkit's own runtime's (its step there
    attends with XLA's einsum: an S x S score matrix), for a TPU target the job's (splash attention stores
    none). ``quiet`` (``--json``): no progress bar or lines on stdout, the JSON says it all. ``preds`` are the
    ranked layouts meshkit can run (a layout with no meshkit plan, e.g. ZeRO-1
    with tensor parallelism, is passed over: it could not be compiled)."""
    import dataclasses

    from meshkit.planner import predict
    from meshkit.planner.compile import compile_layouts

    layouts = [p.layout for p in preds]
    got = compile_layouts(shape, layouts, job, progress=not quiet, console=console, target=target)
    mk = job if target else dataclasses.replace(job, runtime="meshkit", flash_attention=False)
    return [
        (m, predict(shape, p.layout, cluster, mk, calibration=cal)) for p, m in zip(preds, got, strict=True)
    ]


def register(app: typer.Typer) -> None:
    app.command()(plan)
