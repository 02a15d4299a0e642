"""``meshkit plan``: rank the parallel layouts of a model on a cluster by predicted step time, or
evaluate one layout; ``--compile K`` compiles the top K on simulated devices beside the prediction.

Thin over ``meshkit.planner`` (the model, the search, the hardware table, the presets)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from meshkit._errors import MeshkitError
from meshkit.cli import _plan_report as report
from meshkit.cli._format import console, print_json
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


# -- the options, one alias each (panel, help) ------------------------------------------------------

_Model = Annotated[
    str | None,
    _opt(
        _M,
        "A preset (gpt2-124m ... gpt-13b, llama-7b ... llama3-8b, mixtral-8x7b, mixtral-8x22b), or "
        "module:function returning a ModelShape or meshkit GPT parameters (with --heads).",
    ),
]
_Layers = Annotated[int | None, _opt(_M, "Transformer blocks.")]
_Width = Annotated[int | None, _opt(_M, "Model width.")]
_Heads = Annotated[int | None, _opt(_M, "Attention heads.")]
_Vocab = Annotated[int | None, _opt(_M, "Vocabulary size.")]
_Seq = Annotated[int | None, _opt(_M, "Sequence length.")]
_Ffn = Annotated[int | None, _opt(_M, "MLP hidden size (default 4 x width).")]
_Gated = Annotated[bool | None, _opt(_M, "SwiGLU MLP (LLaMA-style), no biases.", "--gated/--no-gated")]
_KvHeads = Annotated[int | None, _opt(_M, "Key/value heads (grouped-query attention; default heads).")]
_HeadDim = Annotated[int | None, _opt(_M, "Width of one head (default width / heads).")]
_Experts = Annotated[
    int | None, _opt(_M, "Mixture of experts: MLPs of width --ffn per layer (0: a dense MLP).")
]
_ExpertsPerToken = Annotated[int | None, _opt(_M, "Mixture of experts: experts a token is routed to.")]
_CapacityFactor = Annotated[
    float | None, _opt(_M, "Mixture of experts: expert buffers' slots per routed token (1.25 usual).")
]
_Devices = Annotated[int, _opt(_C, "Devices in the cluster.")]
_DevicesPerHost = Annotated[int | None, _opt(_C, "Devices per host (default: the hardware's node).")]
_Hardware = Annotated[str, _opt(_C, "a100-40gb, a100-80gb, h100, h200, tpu-v4, tpu-v5e, tpu-v5p, or custom.")]
_PeakTflops = Annotated[
    float | None, _opt(_C, "Dense bf16 TFLOP/s per device (custom; overrides a named device's).")
]
_MemoryGb = Annotated[float | None, _opt(_C, "HBM GB per device (custom; overrides).")]
_HbmGbps = Annotated[float | None, _opt(_C, "HBM GB/s (custom; overrides).")]
_IntraGbps = Annotated[
    float | None, _opt(_C, "GB/s per device per direction inside a host (custom; overrides).")
]
_InterGbps = Annotated[
    float | None, _opt(_C, "GB/s per device per direction between hosts (custom; overrides).")
]
_Family = Annotated[str, _opt(_C, "custom: calibrated efficiency of gpu-ampere, gpu-hopper or tpu.")]
_GlobalBatch = Annotated[int, _opt(_J, "Sequences per optimizer step.")]
_Precision = Annotated[
    str,
    _opt(_J, f"{one_of(PRECISIONS)}; bytes per parameter: mixed-precision Adam 2+2+12, fp32 Adam 4+4+8."),
]
_OptimizerBytes = Annotated[
    float | None, _opt(_J, "Optimizer state bytes per parameter (default 12 bf16, 8 fp32).")
]
_FlashAttention = Annotated[
    bool,
    _opt(_J, "Attention without a stored S x S score matrix.", "--flash-attention/--no-flash-attention"),
]
_Runtime = Annotated[str, _opt(_J, "standard (Megatron-style) or meshkit (meshkit's compiled programs).")]
_Stack = Annotated[
    str,
    _opt(
        _J,
        "Software whose efficiency to assume: maxtext-xla (JAX/XLA, what meshkit runs), megatron-te, "
        "torchtitan or deepspeed, each calibrated on its published runs.",
    ),
]
_ContextAttention = Annotated[str, _opt(_J, f"Context parallelism's attention: {one_of(CONTEXT_ATTENTION)}.")]
_Layout = Annotated[
    str | None,
    _opt(
        _L,
        "Evaluate one layout, e.g. dp=24,tp=8,pp=8, or with context / expert degrees dp=4,tp=8,pp=16,cp=16.",
    ),
]
_MicrobatchSize = Annotated[int, _opt(_L, "Sequences per micro-batch per replica.")]
_Schedule = Annotated[str, _opt(_L, f"{one_of(PIPELINE_SCHEDULES)}.")]
_VirtualStages = Annotated[
    int,
    _opt(
        _L,
        "Interleaved: chunks per device.",
        show_default="interleaved: 2 where it divides the layers per stage, else 1",
    ),
]
_Remat = Annotated[
    str, _opt(_L, one_of(REMAT_POLICIES, notes={v: f"= {k}" for k, v in REMAT_ALIASES.items()}) + ".")
]
_Zero = Annotated[int, _opt(_L, "ZeRO stage over the data axis: 0, 1, 2, 3.")]
_ShardGroup = Annotated[
    int,
    _opt(
        _L,
        "ZeRO-3 over groups of N data-parallel devices, replicated across the groups (hybrid sharding).",
        show_default="all of dp",
    ),
]
_Top = Annotated[int, _opt(_O, "Ranked layouts to show.")]
_Json = Annotated[bool, _opt(_O, "Print JSON instead of tables.")]
_Plot = Annotated[Path | None, _opt(_O, "Write the step time vs peak memory plot to FILE (.png).")]
_Out = Annotated[Path | None, _opt(_O, "Write plan.json and plan.png into DIR.")]
_Compile = Annotated[int, _opt(_O, "Compile the top K layouts ahead of time on simulated CPU devices.")]


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
    devices: _Devices = 8,
    devices_per_host: _DevicesPerHost = None,
    hardware: _Hardware = "h100",
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
    runtime: _Runtime = "standard",
    stack: _Stack = "maxtext-xla",
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
    one = (
        None
        if layout is None
        else dict(
            text=layout,
            microbatch_size=microbatch_size,
            schedule=schedule,
            virtual_stages=virtual_stages,
            remat=remat,
            zero=zero,
        )
    )
    preds, result = _predictions(shape, cluster, job, notes, one, shard_group, top)
    _emit(shape, cluster, job, preds, result, notes, compile=compile, out=out, plot=plot, as_json=json)


def _check_counts(devices: int, top: int, compile: int) -> None:
    """The counts the search depends on, each refused in one line naming its flag."""
    from meshkit.analysis import MAX_DEVICES

    if not 1 <= devices <= MAX_DEVICES:  # the search enumerates the divisors of the count: bound it first
        raise MeshkitError(f"--devices {devices:,} is not a device count: give 1 to {MAX_DEVICES:,}")
    if top < 1:
        raise MeshkitError(f"--top {top}: show at least 1 layout")
    if compile < 0:
        raise MeshkitError(f"--compile {compile}: compile 0 or more layouts")


def _predictions(shape, cluster, job, notes: list[str], one: dict | None, shard_group: int, top: int):
    """(the predictions shown, the search or None): the one layout given (``one``: --layout and its
    options), or the top of every layout ranked."""
    from meshkit.planner import Layout, predict

    if one is not None:
        text = one.pop("text")
        one["virtual_stages"] = one["virtual_stages"] or _virtual(one["schedule"], shape.layers, text, notes)
        lay = Layout.parse(text, **one)
        pred = predict(shape, lay, cluster, job, shard_group=shard_group)
        if not pred.valid:
            raise MeshkitError(f"layout {lay.label()} cannot run: {pred.why}")
        preds, result = [pred], None
    else:
        if shard_group:
            raise MeshkitError(
                "--shard-group prices one layout: give --layout too (the search tries hybrid sharding itself)"
            )
        result = _search(shape, cluster, job)
        preds = result.ranked[:top]
    if job.runtime == "meshkit" and any(p.layout.cp > 1 or p.layout.ep > 1 for p in preds):
        notes.append(
            "--runtime meshkit prices layouts with context (cp) or expert (ep) axes with the analytic "
            "model: meshkit's traced layer does not price them yet"
        )
    return preds, result


def _emit(shape, cluster, job, preds, result, notes, *, compile: int, out, plot, as_json: bool) -> None:
    """Compile the top layouts meshkit runs (``compile``), then write plan.json and the plot (``out``,
    ``plot``) and print the tables or the JSON."""
    runnable = [p for p in (preds if result is None else result.ranked) if p.meshkit_plan()]
    measured = _compile(shape, runnable[:compile], cluster, job) if compile else None
    payload = report.payload(shape, cluster, job, preds, result, measured, notes)
    if out is not None:
        (out / "plan.json").write_text(__import__("json").dumps(payload, indent=2, default=str) + "\n")
    if plot is not None:
        report.plot(preds if result is None else result.ranked + result.rejected, preds[0], plot)
    if as_json:
        print_json(payload)
        return
    for note in notes:
        console.print(f"note: {note}", highlight=False, style="dim")
    report.print_report(shape, cluster, job, preds, result, measured, single=result is None)
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
        runtime=runtime,
        stack=stack.strip().lower(),
        context_attention=context_attention.strip().lower(),
    )
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


def register(app: typer.Typer) -> None:
    app.command()(plan)
