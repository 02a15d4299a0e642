"""The training job's configuration: a frozen dataclass of sections, and presets as plain functions.

``TrainConfig`` holds five sections: ``model``, ``optimizer``, ``data``, ``run`` and ``parallel`` (the
``ParallelSpec``, which validates the layout). Each option is declared once, in its section
(:mod:`meshkit.train.options`), with ``meshkit.spec.option``: its default, what ``meshkit train --help`` says of it, and what a run fixes by
it. Everything that lists options follows from those declarations: the command's flags
(``meshkit.cli.train``), a config file's tables (``config_file``: ``[model]``, ``[optimizer]``...),
what ``--resume`` refuses to change and what it may (``resume``), and what a config written before an
option existed ran with.

Every option has one name, used as it is in Python (``cfg.get("lr")``, ``cfg.replace(lr=...)``; or
through its section, ``cfg.optimizer.lr``) and as ``--name-with-dashes`` on the command line.
``config.json`` in a run directory is this config as JSON, one object per section; configs of earlier
releases (every option at the top level) are read too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from meshkit._errors import MeshkitError
from meshkit.models import registry
from meshkit.spec import CONTEXT, PLATFORM_PRECISION, QUANTIZE, ParallelSpec, PlanError, one_of
from meshkit.train.options import DataOptions, ModelOptions, ObjectiveOptions, OptimizerOptions, RunOptions
from meshkit.train.task import problem as task_problem


class ConfigError(MeshkitError):
    """A training option is out of range or inconsistent."""


HF_PREFIX = "hf:"
"""How ``--init-from`` names a Hugging Face checkpoint directory."""
TRACKERS = ("jsonl", "tensorboard", "wandb")
"""Where ``--tracker`` sends the metrics (``meshkit.train.metrics``); jsonl (metrics.jsonl) is always on."""
MAX_STEPS = 10**9
"""More optimizer steps than any run takes (a bound, so that nonsense fails before anything is written)."""
SECTIONS: dict[str, type] = {
    "model": ModelOptions,
    "optimizer": OptimizerOptions,
    "data": DataOptions,
    "objective": ObjectiveOptions,
    "run": RunOptions,
    "parallel": ParallelSpec,
}
"""The sections of a config, by their name (``config.json``'s objects, a config file's tables)."""
FIELDS: dict[str, dataclasses.Field] = {
    f.name: f for cls in SECTIONS.values() for f in dataclasses.fields(cls)
}
"""Every option's declaration, by its one name."""
SECTION_OF: dict[str, str] = {f.name: s for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
OPTIONS = tuple(FIELDS)
"""Every option of ``meshkit train``, by its one name."""
PARALLEL = ParallelSpec.fields()
"""The options the parallel spec holds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Everything ``meshkit train`` needs; ``config.json`` in the run directory is this, as JSON."""

    model: ModelOptions = field(default_factory=ModelOptions)
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    data: DataOptions = field(default_factory=DataOptions)
    objective: ObjectiveOptions = field(default_factory=ObjectiveOptions)
    run: RunOptions = field(default_factory=RunOptions)
    parallel: ParallelSpec = field(default_factory=lambda: ParallelSpec(plan="fsdp"))
    """How the step is laid out over devices: plan, mesh, remat, precision, micro-batches."""

    def get(self, name: str) -> Any:
        """An option by its one name."""
        if name not in SECTION_OF:
            raise ConfigError(f"unknown option {name!r}: the options are {', '.join(OPTIONS)}")
        return getattr(getattr(self, SECTION_OF[name]), name)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with options changed by their one names (the parallel spec's validated by it), or whole
        sections by theirs (``parallel=ParallelSpec(...)``)."""
        sections = {
            k: changes.pop(k) for k in list(changes) if k in SECTIONS and isinstance(changes[k], SECTIONS[k])
        }
        if unknown := sorted(set(changes) - set(OPTIONS)):
            raise ConfigError(f"unknown option(s) {unknown}: the options are {', '.join(OPTIONS)}")
        for section in SECTIONS:
            mine = {k: v for k, v in changes.items() if SECTION_OF[k] == section}
            if mine:
                sections[section] = _replaced(sections.get(section, getattr(self, section)), mine)
        return dataclasses.replace(self, **sections)

    def to_json(self) -> dict[str, Any]:
        return {section: dataclasses.asdict(getattr(self, section)) for section in SECTIONS}

    @classmethod
    def from_json(cls, data: Any, where: str = "config.json") -> TrainConfig:
        """The config a run saved, checked option by option (type, range) with the command line's rules.

        Every option that fixes the run must be present (a missing one is not silently defaulted, but for
        those added after configs were first written: they ran with their default); configs of earlier
        releases (options at the top level, the parallel spec's too) are read as well."""
        if not isinstance(data, dict):
            raise ConfigError(
                f"{where} is not a meshkit config (a JSON object of options): give a run's directory"
            )
        flat = _flatten(data, where)
        if unknown := sorted(set(flat) - set(OPTIONS)):
            raise ConfigError(
                f"{where} has unknown option(s) {unknown}: it was not written by this meshkit, or was edited"
            )
        missing = [
            n for n, f in FIELDS.items() if f.metadata["fixes"] and not f.metadata["later"] and n not in flat
        ]
        if missing:
            raise ConfigError(
                f"{where} lacks {', '.join(map(flag, missing))}, which the run fixed: restore the file"
            )
        for name, value in flat.items():
            check_type(name, value, where)
        if flat.get("lora_alpha") == 16.0 and not flat.get("lora_rank"):
            flat["lora_alpha"] = None  # written as the default by releases where it was 16.0, not None
        try:
            cfg = TrainConfig().replace(**flat)
        except (PlanError, ConfigError) as e:
            raise ConfigError(f"{where}: {e}") from None
        validate(cfg)
        return cfg


def _replaced(section: Any, changes: dict[str, Any]) -> Any:
    try:
        return dataclasses.replace(section, **changes)
    except PlanError as e:
        raise ConfigError(str(e)) from None


_OLD_NAMES = {"schedule": "pipeline_schedule"}
"""Names options had in configs written before the parallel spec."""


def _flatten(data: dict[str, Any], where: str) -> dict[str, Any]:
    """A saved config's options by their one names: one object per section (this release), or options at
    the top level beside a ``parallel`` object (earlier ones) or without one (the earliest)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update(value)
        elif key == "parallel":
            raise ConfigError(f"{where}: 'parallel' must be an object of {', '.join(PARALLEL)}")
        else:
            flat[_OLD_NAMES.get(key, key)] = value
    return flat


def option_types() -> dict[str, Any]:
    """Each option's type, by its one name."""
    hints: dict[str, Any] = {}
    for cls in SECTIONS.values():
        hints |= typing.get_type_hints(cls)
    return hints


def check_type(name: str, value: Any, where: str = "config.json") -> None:
    """``value`` has the type option ``name`` takes (an int is a float; a bool is no number)."""
    want = option_types()[name]
    allowed = typing.get_args(want) or (want,)
    ok = any(
        (t is type(None) and value is None)
        or (t is bool and isinstance(value, bool))
        or (t is int and isinstance(value, int) and not isinstance(value, bool))
        or (t is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (t is str and isinstance(value, str))
        for t in allowed
    )
    if not ok:
        kinds = {
            int: "a whole number",
            float: "a number",
            str: "text",
            bool: "true or false",
            type(None): "null",
        }
        said = " or ".join(kinds[t] for t in allowed)
        raise ConfigError(f"{where}: {flag(name)} must be {said}, got {value!r}")


def default() -> TrainConfig:
    """The embedded default: a character-level GPT on Python's reference docs, FSDP over 8 devices."""
    return TrainConfig()


def tiny() -> TrainConfig:
    """A few-second run for tests and smoke checks."""
    return TrainConfig().replace(
        steps=12,
        batch_size=16,
        seq_len=32,
        layers=1,
        width=32,
        heads=4,
        eval_every=6,
        eval_batches=1,
        checkpoint_every=6,
        sample_chars=20,
    )


PRESETS = {"default": default, "tiny": tiny}

WARMUP_FRACTION = 10
"""With no --warmup, the warmup is ``steps // WARMUP_FRACTION`` steps."""


def flag(name: str) -> str:
    """The command-line option of a config field: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def warmup_steps(cfg: TrainConfig) -> int:
    """The warmup actually used: the given one, or a tenth of the steps."""
    return cfg.run.steps // WARMUP_FRACTION if cfg.optimizer.warmup is None else cfg.optimizer.warmup


def lora_config(cfg: TrainConfig) -> Any:
    """The run's ``meshkit.models.lora.LoraConfig``, or None (``lora_rank`` 0: full fine-tuning)."""
    m = cfg.model
    if not m.lora_rank:
        return None
    from meshkit.models import lora

    given = {"alpha": m.lora_alpha} if m.lora_alpha is not None else {}
    if m.lora_targets is not None:
        given["targets"] = tuple(t.strip() for t in m.lora_targets.split(","))
    return lora.LoraConfig(rank=m.lora_rank, **given)


def by_platform(cfg: TrainConfig, platform: str | None = None) -> TrainConfig:
    """``cfg`` with its precision as given, or else by the platform it trains on (``platform``: JAX's
    default backend): ``spec.PLATFORM_PRECISION``, bf16 compute with float32 master weights on GPUs
    and TPUs, float32 on a CPU. Resolved before anything is built or written, so that config.json
    holds the precision the run computed in (a resumed run keeps it)."""
    if cfg.parallel.precision is not None:
        return cfg
    if platform is None:
        import jax

        platform = jax.default_backend()
    return cfg.replace(precision=PLATFORM_PRECISION.get(platform, PLATFORM_PRECISION["cpu"]))


def validate(cfg: TrainConfig) -> None:
    """Checks that need no data and no devices; each message names the option to change: every number
    within the bounds its declaration gives (``least``, ``above``), then what the options say of each other."""
    for name, f in FIELDS.items():
        if (problem := _out_of_bounds(name, cfg.get(name), f.metadata)) is not None:
            raise ConfigError(problem)
    for check in (_model_problem, _optimizer_problem, _data_problem, _run_problem):
        if (problem := check(cfg)) is not None:
            raise ConfigError(problem)
    lora_config(cfg)  # LoRA's own checks (its alpha, its targets), before anything is read
    if "wandb" in trackers(cfg):
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                "--tracker wandb needs the wandb package: pip install 'meshkit[wandb]' (or drop wandb from --tracker)"
            )


def _out_of_bounds(name: str, value: Any, meta: Any) -> str | None:
    """Why ``value`` is outside option ``name``'s declared bounds (a float must also be finite), or None."""
    least, above, note = meta.get("least"), meta.get("above"), meta.get("note", "")
    if value is None or isinstance(value, bool) or (least is None and above is None):
        return None
    finite = not isinstance(value, float) or math.isfinite(value)
    if above is not None and not (finite and value > above):
        return f"{flag(name)} must be a positive finite number{note}, got {value}"
    if least is not None and not (finite and value >= least):
        kind = "a finite number of at least" if isinstance(value, float) else "at least"
        return f"{flag(name)} must be {kind} {least}{note}, got {value}"
    return None


def _model_problem(cfg: TrainConfig) -> str | None:
    m = cfg.model
    if m.model not in registry.names():
        return f"unknown --model {m.model!r}: use {' or '.join(registry.names())}"
    # from a checkpoint, its head_dim sets the heads' width (checked against its tensors on load)
    if m.init_from is None and m.width % m.heads:
        return f"--heads {m.heads} must divide --width {m.width}"
    if foreign := _foreign_options(cfg):
        return foreign
    if m.kv_heads and m.heads % m.kv_heads:
        return f"--kv-heads {m.kv_heads} must divide --heads {m.heads}"
    if (problem := registry.family(m.model).check(m)) is not None:
        return problem
    if m.init_from is not None and not (
        m.init_from.startswith(HF_PREFIX) and len(m.init_from) > len(HF_PREFIX)
    ):
        return f"--init-from {m.init_from!r}: give hf:DIR, a Hugging Face checkpoint directory"
    if not m.lora_rank and (m.lora_targets, m.lora_alpha) != (None, None):
        return "--lora-alpha and --lora-targets set LoRA's adapters: give their --lora-rank too (e.g. 8)"
    if m.loss_chunk and (problem := _loss_chunk_problem(cfg)):
        return problem
    return _quantize_problem(cfg) if m.quantize != "none" else None


def _loss_chunk_problem(cfg: TrainConfig) -> str | None:
    chunk, plan, name = cfg.model.loss_chunk, cfg.parallel.plan_info, cfg.parallel.plan
    if plan.pipeline:
        return (
            f"--loss-chunk: plan {name}'s last stage takes the loss of whole logits (meshkit.Stages): drop it"
        )
    if plan.uses(CONTEXT):
        return (
            f"--loss-chunk takes pieces along the sequence, which plan {name} splits over the context axis: drop "
            "--loss-chunk, or use a plan without that axis"
        )
    if cfg.data.seq_len % chunk:
        return f"--loss-chunk {chunk} must divide --seq-len {cfg.data.seq_len}: give a divisor of it"
    return None


def _quantize_problem(cfg: TrainConfig) -> str | None:
    from meshkit.models import quantize

    name, plan = cfg.parallel.plan, cfg.parallel.plan_info
    if cfg.model.quantize not in QUANTIZE:
        return f"unknown --quantize {cfg.model.quantize!r}: use {one_of(QUANTIZE)}"
    if plan.pipeline:
        return (
            f"--quantize: plan {name}'s stages (meshkit.Stages) are not quantized yet: drop it, or use a plan "
            "without stages"
        )
    if plan.uses(CONTEXT):
        return (
            f"--quantize {cfg.model.quantize} takes the weight gradient's scales per sequence, which plan {name} "
            "splits over the context axis: use a plan without that axis"
        )
    return quantize.available()


def _optimizer_problem(cfg: TrainConfig) -> str | None:
    o = cfg.optimizer
    if o.optimizer not in ("adamw", "sgd"):
        return f"unknown --optimizer {o.optimizer!r}: use adamw or sgd"
    if not (math.isfinite(o.momentum) and 0 <= o.momentum < 1):
        return f"--momentum must be in [0, 1), got {o.momentum}"
    return None


def _data_problem(cfg: TrainConfig) -> str | None:
    if not 0 <= cfg.data.seed < 2**32:
        return f"--seed must be in [0, 2**32), got {cfg.data.seed}"
    return task_problem(cfg)


def _run_problem(cfg: TrainConfig) -> str | None:
    steps, warmup = cfg.run.steps, warmup_steps(cfg)
    if not 1 <= steps <= MAX_STEPS:
        return f"--steps must be between 1 and {MAX_STEPS:,}, got {steps}"
    if warmup < 0:
        return f"--warmup must be at least 0, got {warmup}"
    if warmup >= steps:
        return f"--warmup {warmup} must be below --steps {steps}: lower --warmup, or leave it out (default: a tenth of --steps)"
    return None


def _foreign_options(cfg: TrainConfig) -> str:
    """Why options of another model family are refused for the run's (``--kv-heads`` without
    ``--model llama``), or ''."""
    family = registry.family(cfg.model.model)
    given = [
        n
        for f in registry.families()
        for n in f.options
        if n not in family.options and cfg.get(n) != FIELDS[n].default
    ]
    if not given:
        return ""
    takers = [f.name for f in registry.families() if set(given) <= set(f.options)] or ["another"]
    said = " and ".join(flag(n) for n in dict.fromkeys(given))
    return f"{said} {'is' if len(given) == 1 else 'are'} for --model {' or '.join(takers)}: add --model {takers[0]}, or drop them"


def trackers(cfg: TrainConfig) -> tuple[str, ...]:
    """The trackers a run writes to (``--tracker``, comma-separated, with ``--tensorboard``), in ``TRACKERS``
    order; jsonl is always one."""
    names = [n.strip() for n in cfg.run.tracker.split(",") if n.strip()]
    if unknown := [n for n in names if n not in TRACKERS]:
        raise ConfigError(
            f"unknown --tracker {unknown[0]!r}: use a comma-separated list of {', '.join(TRACKERS)}"
        )
    chosen = {"jsonl", *names, *(["tensorboard"] if cfg.run.tensorboard else [])}
    return tuple(n for n in TRACKERS if n in chosen)


def dumps(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_json(), indent=2, sort_keys=True)
