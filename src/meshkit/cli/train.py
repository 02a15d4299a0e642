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
    AUTO,
    ParallelSpec,
)
from meshkit.train import config as C
from meshkit.train import config_file
from meshkit.train.resume import resumed


def _default(name: str, text: str | None = None) -> str:
    """What --help shows as the default of a config field: the default preset's, and tiny's if it differs."""
    base, tiny = C.default().get(name), C.tiny().get(name)
    shown = text or str(base)
    return shown if base == tiny or text else f"{shown}; tiny: {tiny}"


def _opt(name: str) -> typer.models.OptionInfo:
    """A config option's flag, from its declaration (``meshkit.spec.option``): its help, the default as help
    shows it, its flags (a yes/no option as ``--name/--no-name``)."""
    meta = C.FIELDS[name].metadata
    decls = meta["flags"] or ((f"{C.flag(name)}/--no-{C.flag(name)[2:]}",) if _kind(name) is bool else ())
    return typer.Option(*decls, help=meta["help"], show_default=_default(name, meta["shown"]))


def _kind(name: str) -> type:
    """The type a config field takes on the command line: its type's, None aside (a bool where one is)."""
    want = _TYPES[name]
    kinds = [t for t in typing.get_args(want) or (want,) if t is not type(None)]
    return bool if bool in kinds else kinds[0]


_TYPES = C.option_types()
"""Every config field's type (read once: the fields' types are the same for every option)."""

ORDER = ("parallel", "model", "data", "objective", "optimizer", "run")
"""The sections' order in --help (every one of ``config.SECTIONS``: tests/test_config_file.py holds it)."""
#: ``meshkit train``'s options that are config fields, section by section, each declared with the help it shows
#: (the field's docstring says why it exists; its help, what to type). An option without help is given by a
#: config file or ``--set`` only (``--set optimizer.weight_decay=0.1``).
FIELDS: dict[str, typer.models.OptionInfo] = {
    name: _opt(name)
    for section in ORDER
    for name in C.SECTIONS[section].__dataclass_fields__
    if C.FIELDS[name].metadata["help"]
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
    "dry_run": (
        bool,
        typer.Option(
            "--dry-run",
            help="Compile the run's step without training or writing anything: each device's memory against "
            "its HBM, the bytes a step moves per mesh axis, the predicted step time and MFU.",
        ),
        False,
    ),
    "target": (
        str | None,
        typer.Option(
            help="With --dry-run: compile for a TPU slice with libtpu's compiler, from any machine: v5e-256, "
            "v5p-128, or a topology such as v5e:16x16 (pip install 'meshkit[tpu]').",
            show_default="this machine's devices",
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
        [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=default,
                annotation=kind if option is None else Annotated[kind, option],
            )
            for name, (kind, option, default) in rows
        ]
    )


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
    if o["target"] is not None and not o["dry_run"]:
        raise C.ConfigError(
            f"--target {o['target']} compiles for a TPU slice, it does not train there: add --dry-run"
        )
    platform = "tpu" if o["target"] is not None else None
    cfg = _config(given, preset, run_dir, resume, latest, console, platform=platform, auto=not o["dry_run"])
    if o["dry_run"]:
        from meshkit.cli._dry_run import show
        from meshkit.train.dry_run import dry_run

        result = dry_run(cfg, target=o["target"])
        show(result, console)
        if result.fits is False or not result.measured.ok:  # too large, or not compiled (one line said why)
            raise typer.Exit(1)
        return
    import jax

    from meshkit import distributed

    guard = distributed.fail_fast() if jax.process_count() > 1 else contextlib.nullcontext()
    with guard:  # a lost peer ends every survivor at once, with one line naming it
        code = run(
            cfg,
            console,
            resume=resume,
            stop_after=o["stop_after"],
            latest_link=latest if run_dir is None else None,
            profile=profiled,
        )
    if code:
        raise typer.Exit(code)
    if cfg.run.export_hf and jax.process_index() == 0:
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
    if _deterministic_run(
        options.get("deterministic"), o["config"], o["set_"] or [], o["resume"], options.get("run_dir")
    ):
        from meshkit.devices import prepare_deterministic

        prepare_deterministic()  # before the backend starts (a launched rank's join starts it)
    _simulate(o["devices"])
    import jax
    from rich.console import Console

    from meshkit.cli._format import console

    return Console(file=io.StringIO()) if jax.process_index() != 0 else console


def _config(
    given: dict,
    preset: str | None,
    run_dir: str | None,
    resume: bool,
    latest: Path,
    console,
    *,
    platform: str | None = None,
    auto: bool = True,
) -> C.TrainConfig:
    """The run's config: the resumed run's with what may change, or the preset's with the options given;
    its precision by ``platform`` (default: this process's backend) where none is given; ``--plan auto``
    resolved (where ``auto``)."""
    from meshkit.train.job import saved_config

    if resume:
        where = run_dir or str(latest.resolve())
        cfg, changed = resumed(saved_config(Path(where)), given, where)
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
    cfg = C.by_platform(cfg, platform)
    if cfg.parallel.plan == AUTO and auto:
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
    from meshkit.train.fits import host_available

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
    from meshkit.train.fits import model_shape

    if clash := [C.flag(k) for k in AUTO_SETS if k in given]:
        raise C.ConfigError(
            f"--plan auto chooses {', '.join(clash)} itself: drop {', '.join(clash)}, or name a plan"
        )
    C.validate(cfg)
    shape = model_shape(cfg, registry.family(cfg.model.model), load(cfg.data.data).vocab_size)
    choice = choose_gpt(shape, global_batch=cfg.data.batch_size, precision=cfg.parallel.precision)
    console.print(choice.line(), soft_wrap=True, highlight=False)
    return cfg.replace(parallel=choice.spec, plan_reason=choice.why)


def register(app: typer.Typer) -> None:
    app.command()(train)
