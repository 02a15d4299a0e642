"""``meshkit train``: the main job. Options map one to one onto ``meshkit.train.config.TrainConfig``.

Every option defaults to None here so that the command knows what the user gave: a new run fills the
rest from ``--preset``, a resumed run from the run's own ``config.json`` (``meshkit.train.config.resumed``
decides what may change). The defaults ``--help`` shows are read from the presets.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import time
import typing
from pathlib import Path
from typing import Annotated, Any

import typer

from meshkit.cli.ledger import DevicesOpt
from meshkit.models import registry
from meshkit.spec import (
    ATTENTION_IMPLEMENTATIONS,
    AUTO,
    CONTEXT_ATTENTION,
    DETERMINISTIC_PLANS,
    PIPELINE_SCHEDULES,
    PLATFORM_PRECISION,
    PRECISIONS,
    REMAT_POLICIES,
    TASKS,
    ParallelSpec,
    describe_plans,
    one_of,
    plans_of,
)
from meshkit.train import config as C
from meshkit.train import config_file


def _default(name: str, text: str | None = None) -> str:
    """What --help shows as the default of a config field: the default preset's, and tiny's if it differs."""
    base, tiny = C.default().get(name), C.tiny().get(name)
    shown = text or str(base)
    return shown if base == tiny or text else f"{shown}; tiny: {tiny}"


def _opt(name: str, help: str, text: str | None = None, *decls: str) -> typer.models.OptionInfo:
    """A config field's option; a yes/no field as ``--name/--no-name``."""
    if not decls and _kind(name) is bool:
        decls = (f"{C.flag(name)}/--no-{C.flag(name)[2:]}",)
    return typer.Option(*decls, help=help, show_default=_default(name, text))


def _kind(name: str) -> type:
    """The type a config field takes on the command line: its type's, None aside (a bool where one is)."""
    want = _TYPES[name]
    kinds = [t for t in typing.get_args(want) or (want,) if t is not type(None)]
    return bool if bool in kinds else kinds[0]


_TYPES = C.option_types()
"""Every config field's type (read once: the fields' types are the same for every option)."""


#: ``meshkit train``'s options that are config fields, in --help's order, each with the help text it
#: shows (the field's docstring says why it exists; this, what to type).
FIELDS: dict[str, typer.models.OptionInfo] = {
    "plan": _opt(
        "plan",
        f"{describe_plans()}; auto: the planner's fastest predicted layout for this GPT on the devices present.",
    ),
    "mesh": _opt("mesh", "e.g. data=8 or data=4,model=2.", "the plan's, over all devices"),
    "steps": _opt("steps", "Optimizer steps in total."),
    "batch_size": _opt("batch_size", "Global batch in sequences."),
    "seq_len": _opt("seq_len", "Tokens (characters, for text) per sequence."),
    "model": _opt("model", f"{registry.summary()}."),
    "kv_heads": _opt("kv_heads", "Llama: key/value heads (must divide --heads).", "as many as --heads"),
    "experts": _opt(
        "experts",
        f"Mixture of experts: MLPs per layer (plans {one_of(plans_of('expert'), 'and')} split them).",
        "0: a dense MLP",
    ),
    "experts_per_token": _opt("experts_per_token", "Mixture of experts: experts per token (top-k).", "2"),
    "capacity_factor": _opt(
        "capacity_factor",
        "Mixture of experts: slots per expert = ceil(factor x T x k / experts); 0: dropless (every slot runs).",
        "1.25",
    ),
    "tie_embeddings": _opt("tie_embeddings", "Llama: the output head is the token embedding.", "off"),
    "init_from": _opt(
        "init_from", "Start from a Hugging Face checkpoint: hf:DIR (config.json + safetensors).", "random"
    ),
    "lora_rank": _opt(
        "lora_rank", "LoRA: the adapters' rank; the base weights stay frozen.", "0: full fine-tuning"
    ),
    "lora_alpha": _opt("lora_alpha", "LoRA: the update is scaled by alpha / rank.", "16"),
    "lora_targets": _opt("lora_targets", "LoRA: comma-separated matrices to adapt.", "wq,wk,wv,wo"),
    "export_hf": _opt(
        "export_hf", "At the end, write the model as a Hugging Face checkpoint into the run's hf/.", "off"
    ),
    "layers": _opt("layers", "Transformer blocks."),
    "width": _opt("width", "Model width."),
    "heads": _opt("heads", "Attention heads (must divide --width)."),
    "optimizer": _opt("optimizer", "adamw or sgd (momentum)."),
    "lr": _opt("lr", "Peak learning rate (warmup + cosine)."),
    "warmup": _opt("warmup", "Linear warmup steps (below --steps).", "a tenth of --steps, rounded down"),
    "accumulate": _opt("accumulate", "Micro-batches per step (must divide the batch per data shard)."),
    "deterministic": typer.Option(
        "--deterministic",
        help="The same bits on 1, 2, 4 or 8 devices: the batch cut into 8 micro-shards (--set deterministic=N for N, "
        f"a power of two) whose gradients are summed in one fixed tree; plans {one_of(DETERMINISTIC_PLANS, 'and')}. "
        "Its price in bytes is in the report.",
        show_default="off",
    ),
    "microbatches": _opt("microbatches", "Pipeline plans: micro-batches per step.", "one per stage"),
    "pipeline_schedule": _opt(
        "pipeline_schedule",
        f"Pipeline plans: {one_of(PIPELINE_SCHEDULES)}.",
        "1f1b",
        "--pipeline-schedule",
        "--schedule",
    ),
    "virtual_stages": _opt("virtual_stages", "Interleaved: chunks of layers per device."),
    "context_attention": _opt("context_attention", f"Context plans: {one_of(CONTEXT_ATTENTION)}."),
    "clip": _opt("clip", "Global-norm clipping (0 turns it off)."),
    "precision": _opt(
        "precision",
        one_of(PRECISIONS, notes={"bf16": "bf16 compute, fp32 master weights"}) + ".",
        "by platform: " + ", ".join(f"{p} {v}" for p, v in PLATFORM_PRECISION.items()),
    ),
    "attention": _opt(
        "attention",
        f"How each device attends: {one_of(ATTENTION_IMPLEMENTATIONS)}; report.json names the kernels.",
    ),
    "seed": _opt("seed", "Seed of initialisation and data order."),
    "remat": _opt("remat", f"Activation checkpointing per block: {one_of(REMAT_POLICIES)}."),
    "scan_layers": _opt("scan_layers", "Stack the blocks under lax.scan.", None),
    "data": _opt(
        "data",
        "A directory made by 'meshkit data prepare' (BPE token shards), a UTF-8 text file (per character) or a .npy of token ids; "
        "DIR:WEIGHT,DIR:WEIGHT mixes prepared directories of one tokenizer by the weights (normalised), e.g. web:0.7,code:0.3.",
        "Python's reference docs (pydoc_data), per character",
    ),
    "task": _opt("task", f"What is trained: {one_of(TASKS)}."),
    "document_masks": _opt(
        "document_masks",
        "Pretraining: packed documents attend within themselves, positions from 0 in each.",
        "off",
    ),
    "run_dir": typer.Option(
        help="Output directory.", show_default="a new runs/<time>; with --resume, runs/latest"
    ),
    "eval_every": _opt("eval_every", "Evaluate every k steps (0: at the end only)."),
    "eval_tasks": _opt(
        "eval_tasks",
        "Multiple-choice tasks scored at each evaluation (acc, acc_norm per task, as lm-evaluation-harness): "
        'JSONL files of {"query", "choices", "gold"} rows, comma-separated, or a shipped task: python_docs.',
        "none",
    ),
    "checkpoint_every": _opt("checkpoint_every", "Checkpoint every k steps."),
    "sample_chars": _opt("sample_chars", "Characters to sample at the end."),
    "tensorboard": _opt("tensorboard", "Also write TensorBoard event files beside metrics.jsonl.", "off"),
    "tracker": _opt(
        "tracker",
        "Where the metrics go, comma-separated: jsonl (always), tensorboard, wandb (offline unless WANDB_MODE says otherwise; pip install 'meshkit[wandb]').",
    ),
    "peak_tflops": _opt(
        "peak_tflops",
        "One device's peak TFLOP/s, for MFU in the summary, report.json and metrics.jsonl (default: the "
        "table's figure for the GPU or TPU at the run's precision; none on a CPU).",
    ),
}
#: The options that are no config field: how the command runs (before and after the fields in --help).
BEFORE = {
    "preset": (
        str | None,
        typer.Option(
            help="Starting point: default or tiny; options below override it.", show_default="default"
        ),
        None,
    )
}
AFTER = {
    "profile": (
        str | None,
        typer.Option(
            help="Trace these steps with jax.profiler (e.g. 5 or 5-7) into the run's profile/ (TensorBoard, Perfetto) and report where their time went: compute, each collective, exposed communication.",
            show_default="off",
        ),
        None,
    ),
    "resume": (
        bool,
        typer.Option(
            "--resume",
            help="Continue the run in --run-dir from its latest checkpoint, with its config.json; options given again may change the plan, mesh, accumulation, evaluation, checkpoints and logging only.",
        ),
        False,
    ),
    "stop_after": (
        int | None,
        typer.Option(
            help="Stop (with a checkpoint) after this step; --resume continues.", show_default="off"
        ),
        None,
    ),
    "config": (
        str | None,
        typer.Option(
            help="A TOML file of options: top-level keys or [model], [optimizer], [data], [run], [parallel] tables, and preset; --set and plain flags win over it.",
            show_default="none",
        ),
        None,
    ),
    "set_": (
        list[str] | None,
        typer.Option(
            "--set",
            help="section.key=value or key=value (e.g. optimizer.lr=1e-3), over --config; plain flags win.",
            show_default="none",
        ),
        None,
    ),
    "devices": (DevicesOpt, None, 8),
    "compile_cache": (
        str | None,
        typer.Option(
            help="JAX's persistent compilation cache: a directory, or off (also MESHKIT_COMPILE_CACHE).",
            show_default="JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/meshkit/jax (~/.cache/meshkit/jax)",
        ),
        None,
    ),
}


def _signature() -> inspect.Signature:
    """The command's parameters, as typer reads them: the fields' typed from the config."""
    rows = [*BEFORE.items(), *((k, (_kind(k) | None, o, None)) for k, o in FIELDS.items()), *AFTER.items()]
    return inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                           annotation=kind if option is None else Annotated[kind, option])
         for name, (kind, option, default) in rows]
    )  # fmt: skip


def train(**options: Any) -> None:
    """Train a model of any family (--model: GPT, Llama, Gemma) under a plan (on BPE token shards, text per character, or ids); write
    metrics, checkpoints, report and plots."""
    o = {k: options.get(k, default) for k, (_, _, default) in {**BEFORE, **AFTER}.items()}
    run_dir, resume = options.get("run_dir"), o["resume"]
    from meshkit.train.profile import parse_steps

    profiled = None if o["profile"] is None else parse_steps(o["profile"])
    console = _start(options, o)
    from meshkit.train.job import resume_on_restart
    from meshkit.train.loop import run

    given = {k: v for k in FIELDS if k != "run_dir" and (v := options.get(k)) is not None}
    if "clip" in given:
        given["clip"] = config_file.user_value("clip", given["clip"])
    written = config_file.written_options(o["config"], o["set_"] or [])
    preset = o["preset"] or written.pop("preset", None)
    written.pop("preset", None)
    run_dir = run_dir or written.pop("run_dir", None)
    given = {**{k: v for k, v in written.items() if k != "run_dir"}, **given}
    latest = Path("runs") / "latest"
    if not resume and resume_on_restart(run_dir):  # meshkit launch --max-restarts, SLURM --requeue
        console.print(
            f"restart: resuming {run_dir} from its latest checkpoint", soft_wrap=True, highlight=False
        )
        resume = True
    cfg = _config(given, preset, run_dir, resume, latest, console)
    import jax

    from meshkit import distributed

    guard = distributed.fail_fast() if jax.process_count() > 1 else contextlib.nullcontext()
    with guard:  # a lost peer ends every survivor at once, with one line naming it
        code = run(cfg, console, resume=resume, stop_after=o["stop_after"],
                   latest_link=latest if run_dir is None else None, profile=profiled)  # fmt: skip
    if code:
        raise typer.Exit(code)
    if cfg.export_hf and jax.process_index() == 0:
        _export_at_end(run_dir, latest, console)


train.__signature__ = _signature()


def _start(options: dict[str, Any], o: dict[str, Any]) -> Any:
    """Before JAX's backend starts: the compile cache, the devices simulated, deterministic mode; then
    the console of this process (one voice per job: the others train quietly, errors still print)."""
    from meshkit.cli.ledger import _simulate

    if o["compile_cache"] is not None:
        from meshkit import compile_cache as cache

        cache.configure(o["compile_cache"])
    _check_devices(o["devices"])
    if _deterministic_run(options.get("deterministic"), o["config"], o["set_"] or [], o["resume"], options.get("run_dir")):  # fmt: skip
        from meshkit.devices import prepare_deterministic

        prepare_deterministic()  # before the backend starts (a launched rank's join starts it)
    _simulate(o["devices"])
    import jax
    from rich.console import Console

    from meshkit.cli._format import console

    return Console(file=io.StringIO()) if jax.process_index() != 0 else console


def _config(
    given: dict, preset: str | None, run_dir: str | None, resume: bool, latest: Path, console
) -> C.TrainConfig:
    """The run's config: the resumed run's with what may change, or the preset's with the options given;
    ``--plan auto`` resolved."""
    from meshkit.train.job import saved_config

    if resume:
        where = run_dir or str(latest.resolve())
        cfg, changed = C.resumed(saved_config(Path(where)), given, where)
        if preset is not None:
            console.print(
                f"--preset {preset} is not used with --resume: the run's settings come from its config.json"
            )
        for line in changed:
            console.print(f"resume: {line}", soft_wrap=True, highlight=False)
    else:
        preset = preset or "default"
        if preset not in C.PRESETS:
            raise C.ConfigError(f"unknown --preset {preset!r}: use {' or '.join(C.PRESETS)}")
        new_dir = run_dir or str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        cfg = C.PRESETS[preset]().replace(**given, run_dir=new_dir)
    cfg = C.by_platform(cfg)
    if cfg.parallel.plan == AUTO:
        return _auto(cfg, given, console)
    if "plan" in given:  # a plan named again on resume: the reason auto gave no longer applies
        return cfg.replace(plan_reason=None)
    return cfg


def _export_at_end(run_dir: str | None, latest: Path, console) -> None:
    """``--export-hf``: the finished run's model as a Hugging Face checkpoint in its ``hf/``."""
    from meshkit.train.outputs import export_run

    where = Path(run_dir) if run_dir is not None else latest.resolve()
    out = where / "hf"
    if out.exists():  # a resumed run exports its newer weights: the previous export is replaced
        import shutil

        shutil.rmtree(out)
    run = export_run(where, out)
    console.print(
        f"exported step {run.step} as a Hugging Face checkpoint: {out}", soft_wrap=True, highlight=False
    )


#: Host memory one simulated CPU device holds while a run starts and trains (measured: 4096
#: devices take 1.4 GiB before anything trains; a training step adds its buffers per device).
DEVICE_HOST_BYTES = 4 * 2**20


def _deterministic_run(given: Any, config: Any, set_: list, resume: bool, run_dir: str | None) -> bool:
    """Whether this run trains in deterministic mode: asked on the command line or in its config, or the
    run it resumes did (read from its config.json as text: building the config would start JAX's
    backend, which a restarted rank must not before it joins its job)."""
    import json

    from meshkit.distributed import restart_attempt

    if given or config_file.written_options(config, set_).get("deterministic"):
        return True
    if resume or (run_dir and restart_attempt() > 0):  # (listing its checkpoints would start the backend)
        saved = Path(run_dir or Path("runs") / "latest") / "config.json"
        try:
            return json.loads(saved.read_text()).get("parallel", {}).get("deterministic") is not None
        except (OSError, ValueError, AttributeError):
            return False  # said again, in one line, where the run is resumed
    return False


def _check_devices(n: int | None) -> None:
    """``--devices`` at most what the host's available memory can simulate (100000 devices ended in a
    segfault, exit 139, before any line)."""
    from meshkit.train.job import host_available

    if n is None or not isinstance(n, int) or n < 1:
        return  # simulate_devices says what a count must be
    available = host_available()
    if available is not None and n * DEVICE_HOST_BYTES > available:
        most = max(1, int(available // DEVICE_HOST_BYTES))
        raise C.ConfigError(
            f"--devices {n}: simulating a CPU device takes about {DEVICE_HOST_BYTES >> 20} MiB of host memory and "
            f"this host has {available / 2**30:.1f} GiB available: use --devices {most} or fewer"
        )


AUTO_SETS = tuple(k for k in ParallelSpec.fields() if k not in ("plan", "precision"))
"""What ``--plan auto`` chooses with the plan."""


def _auto(cfg: C.TrainConfig, given: dict, console) -> C.TrainConfig:
    """``--plan auto``: the planner's choice for this GPT, its batch and precision on these devices."""
    from meshkit.data import load
    from meshkit.planner.auto import choose_gpt
    from meshkit.train.job import model_shape

    if clash := [C.flag(k) for k in AUTO_SETS if k in given]:
        raise C.ConfigError(
            f"--plan auto chooses {', '.join(clash)} itself: drop {', '.join(clash)}, or name a plan"
        )
    C.validate(cfg)
    shape = model_shape(cfg, load(cfg.data).vocab_size)
    choice = choose_gpt(shape, global_batch=cfg.batch_size, precision=cfg.parallel.precision)
    console.print(choice.line(), soft_wrap=True, highlight=False)
    return cfg.replace(parallel=choice.spec, plan_reason=choice.why)


def register(app: typer.Typer) -> None:
    app.command()(train)
