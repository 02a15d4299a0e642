"""The training job's configuration: a frozen dataclass of sections, and presets as plain functions.

``TrainConfig`` holds five sections: ``model``, ``optimizer``, ``data``, ``run`` and ``parallel`` (the
``ParallelSpec``, which validates the layout). Each option is declared once, in its section, with
``meshkit.spec.option``: its default, what ``meshkit train --help`` says of it, and what a run fixes by
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
from meshkit.spec import PLATFORM_PRECISION, TASKS, ParallelSpec, PlanError, one_of, option, plans_of
from meshkit.train.task import problem as task_problem


class ConfigError(MeshkitError):
    """A training option is out of range or inconsistent."""


HF_PREFIX = "hf:"
"""How ``--init-from`` names a Hugging Face checkpoint directory."""
TRACKERS = ("jsonl", "tensorboard", "wandb")
"""Where ``--tracker`` sends the metrics (``meshkit.train.metrics``); jsonl (metrics.jsonl) is always on."""
MAX_STEPS = 10**9
"""More optimizer steps than any run takes (a bound, so that nonsense fails before anything is written)."""
SHAPE = "the model's shape"
ROUTING = "the model's routing"
TRAINED = "the trained parameters"
SCHEDULE = "the learning-rate schedule"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelOptions:
    """The model trained: its family, its shape, where its weights start, and LoRA's adapters."""

    model: str = option("gpt", help=f"{registry.summary()}.", fixes="the model", later=True)
    """The decoder trained: a family of ``meshkit.models.registry`` (the GPT, the Llama, the Gemma)."""
    layers: int = option(2, help="Transformer blocks.", fixes=SHAPE)
    width: int = option(128, help="Model width.", fixes=SHAPE)
    """Model width (embedding dimension)."""
    heads: int = option(4, help="Attention heads (must divide --width).", fixes=SHAPE)
    kv_heads: int = option(0, help="Llama: key/value heads (must divide --heads).", shown="as many as --heads",
                           fixes=SHAPE, later=True)  # fmt: skip
    """Grouped-query attention's key/value heads (must divide heads); 0: as many as heads."""
    tie_embeddings: bool = option(False, help="Llama: the output head is the token embedding.", shown="off",
                                  fixes=SHAPE, later=True)  # fmt: skip
    scan_layers: bool = option(False, help="Stack the blocks under lax.scan.")
    """The scanned form: blocks stacked under lax.scan (compile time flat in depth); a resumed run may change it."""
    init_from: str | None = option(None, help="Start from a Hugging Face checkpoint: hf:DIR (config.json + "
                                   "safetensors).", shown="random", fixes="the initialisation", later=True)  # fmt: skip
    """'hf:DIR' (config.json + safetensors) instead of random weights; its shape must be the run's."""
    experts: int = option(0, help=f"Mixture of experts: MLPs per layer (plans {one_of(plans_of('expert'), 'and')} "
                          "split them).", shown="0: a dense MLP", fixes=SHAPE, later=True)  # fmt: skip
    """MLPs per layer (0: a dense MLP; ``ModelShape.experts``)."""
    experts_per_token: int = option(
        2, help="Mixture of experts: experts per token (top-k).", fixes=ROUTING, later=True
    )
    capacity_factor: float = option(1.25, help="Mixture of experts: slots per expert = ceil(factor x T x k / experts); "
                                    "0: dropless (every slot runs).", fixes=ROUTING, later=True)  # fmt: skip
    """An expert takes at most ceil(capacity_factor x T x k / experts) slots of a sequence."""
    lora_rank: int = option(0, help="LoRA: the adapters' rank; the base weights stay frozen.",
                            shown="0: full fine-tuning", fixes=TRAINED, later=True)  # fmt: skip
    """LoRA (``meshkit.models.lora``): the adapters' rank; 0: full fine-tuning."""
    lora_alpha: float | None = option(None, help="LoRA: the update is scaled by alpha / rank.", shown="LoRA's: 16",
                                      fixes=TRAINED, later=True)  # fmt: skip
    """None: ``lora.LoraConfig``'s alpha. Given without a rank, it is refused, never ignored."""
    lora_targets: str | None = option(None, help="LoRA: comma-separated matrices to adapt.", shown="wq,wk,wv,wo",
                                      fixes=TRAINED, later=True)  # fmt: skip
    """Comma-separated keys of the matrices adapted; None: ``lora.DEFAULT_TARGETS``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerOptions:
    """The optimizer and its learning-rate schedule (``meshkit.train.optim``)."""

    optimizer: str = option("adamw", help="adamw or sgd (momentum).", fixes="the optimizer")
    lr: float = option(3e-3, help="Peak learning rate (warmup + cosine).", fixes=SCHEDULE)
    warmup: int | None = option(None, help="Linear warmup steps (below --steps).",
                                shown="a tenth of --steps, rounded down", fixes=SCHEDULE)  # fmt: skip
    """None: a tenth of ``steps`` (rounded down), so any step count works."""
    weight_decay: float = option(0.01, fixes="the optimizer")
    """AdamW's weight decay (a config file or ``--set`` gives it)."""
    momentum: float = option(0.9, fixes="the optimizer")
    """SGD's momentum."""
    clip: float | None = option(1.0, help="Global-norm clipping (0 turns it off).", fixes="the optimizer")
    """Global-norm gradient clipping (None: off)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataOptions:
    """What is trained on, in what order, and how a batch is formed (``meshkit.train.task``)."""

    data: str | None = option(
        None, fixes="the data", shown="Python's reference docs (pydoc_data), per character",
        help="A directory made by 'meshkit data prepare' (BPE token shards), a UTF-8 text file (per character) or a .npy "
        "of token ids; DIR:WEIGHT,DIR:WEIGHT mixes prepared directories of one tokenizer by the weights "
        "(normalised), e.g. web:0.7,code:0.3.",
    )  # fmt: skip
    """A prepared directory, a text file, a .npy of ids, or a mixture of prepared directories
    (:mod:`meshkit.data.mixture`); None: Python's own reference docs (pydoc_data.topics), per character."""
    seq_len: int = option(128, help="Tokens (characters, for text) per sequence.",
                          fixes="the model's shape and the data order")  # fmt: skip
    batch_size: int = option(32, help="Global batch in sequences.", fixes="the data order")
    seed: int = option(
        0, help="Seed of initialisation and data order.", fixes="the initialisation and the data order"
    )
    task: str = option("pretrain", help=f"What is trained: {one_of(TASKS)}.", fixes="the loss and the data stream",
                       later=True)  # fmt: skip
    """'pretrain' (every token) or 'sft' (conversations: the loss on the assistant's tokens only)."""
    document_masks: bool = option(
        False, help="Pretraining: packed documents attend within themselves, positions from 0 in each.", shown="off",
        fixes="the attention and the data stream", later=True,
    )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    """How long the run trains, and what it measures and writes around the training."""

    steps: int = option(400, help="Optimizer steps in total.", fixes=SCHEDULE)
    """A resumed run continues up to this count (the schedule spans it: ``--stop-after`` stops early)."""
    run_dir: str = option(
        "runs/latest", help="Output directory.", shown="a new runs/<time>; with --resume, runs/latest"
    )
    """Where config.json, metrics.jsonl, report.json, plots and checkpoints go (the CLI gives each new run
    its own runs/<time> and points runs/latest at it)."""
    eval_every: int = option(50, help="Evaluate every k steps (0: at the end only).")
    eval_batches: int = option(4)
    """Held-out batches per evaluation."""
    eval_tasks: str | None = option(
        None, shown="none", help="Multiple-choice tasks scored at each evaluation (acc, acc_norm per task, as "
        'lm-evaluation-harness): JSONL files of {"query", "choices", "gold"} rows, comma-separated, or a shipped '
        "task: python_docs.",
    )  # fmt: skip
    checkpoint_every: int = option(100, help="Checkpoint every k steps.")
    """Save a checkpoint every this many steps (and always at the end)."""
    sample_chars: int = option(200, help="Characters to sample at the end.")
    tensorboard: bool = option(
        False, help="Also write TensorBoard event files beside metrics.jsonl.", shown="off"
    )
    plan_reason: str | None = option(None)
    """Why ``--plan auto`` chose the plan (None: the plan was given)."""
    export_hf: bool = option(False, shown="off",
                             help="At the end, write the model as a Hugging Face checkpoint into the run's hf/.")  # fmt: skip
    tracker: str = option(
        "jsonl", help="Where the metrics go, comma-separated: jsonl (always), tensorboard, wandb (offline unless "
        "WANDB_MODE says otherwise; pip install 'meshkit[wandb]').",
    )  # fmt: skip
    peak_tflops: float | None = option(
        None, help="One device's peak TFLOP/s, for MFU in the summary, report.json and metrics.jsonl (default: the "
        "table's figure for the GPU or TPU at the run's precision; none on a CPU).",
    )  # fmt: skip


SECTIONS: dict[str, type] = {"model": ModelOptions, "optimizer": OptimizerOptions, "data": DataOptions,
                             "run": RunOptions, "parallel": ParallelSpec}  # fmt: skip
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
    return TrainConfig().replace(steps=12, batch_size=16, seq_len=32, layers=1, width=32, heads=4, eval_every=6,
                                 eval_batches=1, checkpoint_every=6, sample_chars=20)  # fmt: skip


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
    """Range checks that need no data and no devices, section by section; each message names the option
    to change."""
    m, o, d, r = cfg.model, cfg.optimizer, cfg.data, cfg.run
    warmup = warmup_steps(cfg)
    family = registry.family(m.model) if m.model in registry.names() else None
    checks = [
        (lambda: family is not None, lambda: f"unknown --model {m.model!r}: use {' or '.join(registry.names())}"),
        (lambda: m.layers >= 1, lambda: f"--layers must be at least 1, got {m.layers}"),
        (lambda: m.width >= 1, lambda: f"--width must be at least 1, got {m.width}"),
        (lambda: m.heads >= 1, lambda: f"--heads must be at least 1, got {m.heads}"),
        # from a checkpoint, its head_dim sets the heads' width (checked against its tensors on load)
        (lambda: m.init_from is not None or m.width % m.heads == 0, lambda: f"--heads {m.heads} must divide --width {m.width}"),
        (lambda: m.kv_heads >= 0, lambda: f"--kv-heads must be at least 0 (0: as many as --heads), got {m.kv_heads}"),
        (lambda: not _foreign_options(cfg), lambda: _foreign_options(cfg)),
        (lambda: m.kv_heads == 0 or m.heads % m.kv_heads == 0, lambda: f"--kv-heads {m.kv_heads} must divide --heads {m.heads}"),
        (lambda: family.check(m) is None, lambda: family.check(m)),
        (lambda: m.init_from is None or (m.init_from.startswith(HF_PREFIX) and len(m.init_from) > len(HF_PREFIX)),
         lambda: f"--init-from {m.init_from!r}: give hf:DIR, a Hugging Face checkpoint directory"),
        (lambda: m.lora_rank >= 0, lambda: f"--lora-rank must be at least 0 (0: full fine-tuning), got {m.lora_rank}"),
        (lambda: m.lora_rank > 0 or (m.lora_targets, m.lora_alpha) == (None, None),
         lambda: "--lora-alpha and --lora-targets set LoRA's adapters: give their --lora-rank too (e.g. 8)"),
        (lambda: o.optimizer in ("adamw", "sgd"), lambda: f"unknown --optimizer {o.optimizer!r}: use adamw or sgd"),
        (lambda: math.isfinite(o.lr) and o.lr > 0, lambda: f"--lr must be a positive finite number, got {o.lr}"),
        (lambda: math.isfinite(o.weight_decay) and o.weight_decay >= 0,
         lambda: f"--weight-decay must be a finite number of at least 0, got {o.weight_decay}"),
        (lambda: math.isfinite(o.momentum) and 0 <= o.momentum < 1, lambda: f"--momentum must be in [0, 1), got {o.momentum}"),
        (lambda: o.clip is None or (math.isfinite(o.clip) and o.clip > 0),
         lambda: f"--clip must be a positive finite number (0 turns it off), got {o.clip}"),
        (lambda: d.batch_size >= 1, lambda: f"--batch-size must be at least 1, got {d.batch_size}"),
        (lambda: d.seq_len >= 1, lambda: f"--seq-len must be at least 1, got {d.seq_len}"),
        (lambda: 0 <= d.seed < 2**32, lambda: f"--seed must be in [0, 2**32), got {d.seed}"),
        (lambda: task_problem(cfg) is None, lambda: task_problem(cfg)),
        (lambda: 1 <= r.steps <= MAX_STEPS, lambda: f"--steps must be between 1 and {MAX_STEPS:,}, got {r.steps}"),
        (lambda: warmup >= 0, lambda: f"--warmup must be at least 0, got {warmup}"),
        (lambda: warmup < r.steps, lambda: f"--warmup {warmup} must be below --steps {r.steps}: lower --warmup, "
                                           f"or leave it out (default: a tenth of --steps)"),
        (lambda: r.eval_every >= 0, lambda: f"--eval-every must be at least 0 (0: at the end only), got {r.eval_every}"),
        (lambda: r.eval_batches >= 1, lambda: f"--eval-batches must be at least 1, got {r.eval_batches}"),
        (lambda: r.checkpoint_every >= 1, lambda: f"--checkpoint-every must be at least 1, got {r.checkpoint_every}"),
        (lambda: r.sample_chars >= 0, lambda: f"--sample-chars must be at least 0, got {r.sample_chars}"),
        (lambda: r.peak_tflops is None or (math.isfinite(r.peak_tflops) and r.peak_tflops > 0),
         lambda: f"--peak-tflops must be a positive finite number (one device's peak), got {r.peak_tflops}"),
    ]  # fmt: skip
    for ok, message in checks:  # in order: a later check may divide by what an earlier one bounds
        if not ok():
            raise ConfigError(message())
    lora_config(cfg)  # LoRA's own checks (its alpha, its targets), before anything is read
    if "wandb" in trackers(cfg):
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                "--tracker wandb needs the wandb package: pip install 'meshkit[wandb]' (or drop wandb from --tracker)"
            )


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
    return f"{said} {'is' if len(given) == 1 else 'are'} for --model {' or '.join(takers)}: add --model {takers[0]}, or drop them"  # fmt: skip


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
