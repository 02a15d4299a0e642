"""The training job's configuration: one frozen dataclass, and presets as plain functions."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshkit._errors import MeshkitError

if TYPE_CHECKING:  # optax is imported where it is used: the CLI reads this module to print its --help
    import optax


class ConfigError(MeshkitError):
    """A training option is out of range or inconsistent."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Everything ``meshkit train`` needs; ``config.json`` in the run directory is this, as JSON."""

    plan: str = "fsdp"
    """Parallel plan: dp, zero1, zero2, zero3 (fsdp), tp, dp+tp, fsdp+tp; pipelines pp, dp+pp, fsdp+pp, tp+pp, dp+tp+pp, fsdp+tp+pp;
    or auto (``meshkit train`` replaces it by the planner's choice before the run starts)."""
    plan_reason: str | None = None
    """Why ``--plan auto`` chose the plan (None: the plan was given)."""
    mesh: str | None = None
    """Mesh such as 'data=8' or 'data=4,model=2'; None picks the plan's default over all devices."""
    steps: int = 400
    """Optimizer steps in total (a resumed run continues up to this count)."""
    batch_size: int = 32
    """Global batch, in sequences."""
    seq_len: int = 128
    """Characters (tokens) per sequence."""
    layers: int = 2
    """Transformer blocks."""
    width: int = 128
    """Model width (embedding dimension)."""
    heads: int = 4
    """Attention heads (must divide width)."""
    optimizer: str = "adamw"
    """'adamw' or 'sgd' (with momentum)."""
    lr: float = 3e-3
    """Peak learning rate of the warmup + cosine schedule."""
    warmup: int | None = None
    """Linear warmup steps; None: a tenth of ``steps`` (rounded down), so any step count works."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    momentum: float = 0.9
    """SGD momentum."""
    accumulate: int = 1
    """Micro-batches accumulated per optimizer step."""
    microbatches: int | None = None
    """Pipeline plans (+pp): micro-batches per step; None: one per stage."""
    schedule: str | None = None
    """Pipeline plans: 'gpipe', '1f1b' or 'interleaved'; None: 1f1b."""
    virtual_stages: int = 1
    """Interleaved schedule: chunks of layers per device."""
    clip: float | None = 1.0
    """Global-norm gradient clipping (None: off)."""
    precision: str = "fp32"
    """'fp32', or 'bf16' (bfloat16 compute, float32 master weights and optimizer state)."""
    remat: str = "none"
    """Activation checkpointing per block: 'none', 'layer', 'dots' or 'regather' (zero3/fsdp then
    gathers each block's parameters again in the backward pass)."""
    scan_layers: bool = False
    """The GPT's scanned form: blocks stacked under lax.scan (compile time flat in depth)."""
    seed: int = 0
    """Seed of the parameter initialisation and of the data order."""
    data: str | None = None
    """A UTF-8 text file or a .npy of token ids; None: Python's own reference docs (pydoc_data.topics)."""
    run_dir: str = "runs/latest"
    """Where config.json, metrics.jsonl, report.json, plots and checkpoints go (the CLI gives each new
    run its own runs/<time> and points runs/latest at it)."""
    eval_every: int = 50
    """Evaluate on the held-out split every this many steps (0: only at the end)."""
    eval_batches: int = 4
    """Held-out batches per evaluation."""
    checkpoint_every: int = 100
    """Save a checkpoint every this many steps (and always at the end)."""
    sample_chars: int = 200
    """Characters of text sampled from the model at the end (0: none)."""
    tensorboard: bool = False
    """Also write TensorBoard event files (scalars of metrics.jsonl) into the run directory."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def default() -> TrainConfig:
    """The embedded default: a character-level GPT on Python's reference docs, FSDP over 8 devices."""
    return TrainConfig()


def tiny() -> TrainConfig:
    """A few-second run for tests and smoke checks."""
    return TrainConfig(steps=12, batch_size=16, seq_len=32, layers=1, width=32, heads=4, eval_every=6,
                       eval_batches=1, checkpoint_every=6, sample_chars=20)  # fmt: skip


PRESETS = {"default": default, "tiny": tiny}

WARMUP_FRACTION = 10
"""With no --warmup, the warmup is ``steps // WARMUP_FRACTION`` steps."""


def flag(name: str) -> str:
    """The command-line option of a config field: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def warmup_steps(cfg: TrainConfig) -> int:
    """The warmup actually used: the given one, or a tenth of the steps."""
    return cfg.steps // WARMUP_FRACTION if cfg.warmup is None else cfg.warmup


#: What each option fixed when the run started; a resumed run must keep it to continue the same run
#: (the learning-rate schedule spans ``steps``, so even ``steps`` is fixed: ``--stop-after`` stops early).
FIXED_ON_RESUME = {
    "steps": "the learning-rate schedule",
    "warmup": "the learning-rate schedule",
    "lr": "the learning-rate schedule",
    "optimizer": "the optimizer",
    "weight_decay": "the optimizer",
    "momentum": "the optimizer",
    "clip": "the optimizer",
    "layers": "the model's shape",
    "width": "the model's shape",
    "heads": "the model's shape",
    "seq_len": "the model's shape and the data order",
    "batch_size": "the data order",
    "seed": "the initialisation and the data order",
    "data": "the data",
    "precision": "the arithmetic",
}
#: What a resumed run may change: how the same computation is laid out over devices (the checkpoint is
#: resharded; the results agree to rounding), and what is measured and written around it.
CHANGEABLE_ON_RESUME = ("plan", "plan_reason", "mesh", "accumulate", "eval_every", "eval_batches", "checkpoint_every",
                        "sample_chars", "tensorboard", "remat", "scan_layers", "microbatches", "schedule",
                        "virtual_stages")  # fmt: skip


def _shown(cfg: TrainConfig, key: str) -> Any:
    return warmup_steps(cfg) if key == "warmup" else getattr(cfg, key)


def _text(value: Any) -> str:
    if value is None:
        return "default"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def check_same_run(saved: TrainConfig, cfg: TrainConfig, where: str) -> None:
    """Raise, naming the option, unless ``cfg`` keeps everything ``saved`` fixed."""
    for key, what in FIXED_ON_RESUME.items():
        old, new = _shown(saved, key), _shown(cfg, key)
        if old != new:
            raise ConfigError(
                f"--resume: {flag(key)} was {old!r} in '{where}' and fixes {what}, so it cannot become {new!r}; "
                f"drop {flag(key)}, or start a new run in another --run-dir"
            )


def resumed(saved: TrainConfig, given: dict[str, Any], where: str) -> tuple[TrainConfig, list[str]]:
    """The saved config with the options given again: those that only change the layout or the logging
    are applied (each change is returned as one line), any change of what the run fixed is refused."""
    changes = {k: v for k, v in given.items() if k != "run_dir"}
    cfg = saved.replace(**changes, run_dir=where)
    check_same_run(saved, cfg, where)
    # a --warmup equal to the one the saved run uses (a tenth of its steps) changes nothing
    cfg = cfg.replace(warmup=saved.warmup)
    lines = [
        f"{flag(k)}: {_text(getattr(saved, k))} -> {_text(v)}"
        for k, v in changes.items()
        if k in CHANGEABLE_ON_RESUME and getattr(saved, k) != v
    ]
    validate(cfg)
    return cfg, lines


def validate(cfg: TrainConfig) -> None:
    """Range checks that need no data and no devices; each message names the option to change."""
    warmup = warmup_steps(cfg)
    checks = [
        (cfg.steps >= 1, f"--steps must be at least 1, got {cfg.steps}"),
        (cfg.batch_size >= 1, f"--batch-size must be at least 1, got {cfg.batch_size}"),
        (cfg.seq_len >= 1, f"--seq-len must be at least 1, got {cfg.seq_len}"),
        (cfg.layers >= 1, f"--layers must be at least 1, got {cfg.layers}"),
        (cfg.width >= 1, f"--width must be at least 1, got {cfg.width}"),
        (cfg.heads >= 1, f"--heads must be at least 1, got {cfg.heads}"),
        (cfg.width % cfg.heads == 0, f"--heads {cfg.heads} must divide --width {cfg.width}"),
        (cfg.optimizer in ("adamw", "sgd"), f"unknown --optimizer {cfg.optimizer!r}: use adamw or sgd"),
        (cfg.lr > 0, f"--lr must be positive, got {cfg.lr}"),
        (warmup >= 0, f"--warmup must be at least 0, got {warmup}"),
        (
            warmup < cfg.steps,
            f"--warmup {warmup} must be below --steps {cfg.steps}: lower --warmup, or leave it out "
            f"(default: a tenth of --steps)",
        ),
        (cfg.accumulate >= 1, f"--accumulate must be at least 1, got {cfg.accumulate}"),
        (cfg.clip is None or cfg.clip > 0, f"--clip must be positive (0 turns it off), got {cfg.clip}"),
        (cfg.precision in ("fp32", "bf16"), f"unknown --precision {cfg.precision!r}: use fp32 or bf16"),
        (cfg.eval_every >= 0, f"--eval-every must be at least 0 (0: at the end only), got {cfg.eval_every}"),
        (cfg.eval_batches >= 1, f"--eval-batches must be at least 1, got {cfg.eval_batches}"),
        (
            cfg.remat in ("none", "layer", "dots", "regather"),
            f"unknown --remat {cfg.remat!r}: use none, layer, dots or regather",
        ),
        (cfg.checkpoint_every >= 1, f"--checkpoint-every must be at least 1, got {cfg.checkpoint_every}"),
        (cfg.sample_chars >= 0, f"--sample-chars must be at least 0, got {cfg.sample_chars}"),
        (0 <= cfg.seed < 2**32, f"--seed must be in [0, 2**32), got {cfg.seed}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def check_batch(cfg: TrainConfig, data_axis: int) -> None:
    """The global batch must split evenly over the data axis and then into ``accumulate`` micro-batches."""
    unit = data_axis * cfg.accumulate
    if cfg.batch_size % unit:
        fit = max(unit, cfg.batch_size // unit * unit)
        raise ConfigError(
            f"--batch-size {cfg.batch_size} does not divide over the data axis ({data_axis}) x --accumulate "
            f"{cfg.accumulate}: use --batch-size {fit} (a multiple of {unit})"
            + (" or a smaller --accumulate" if cfg.accumulate > 1 else "")
        )


def check_stop_after(stop_after: int | None, step: int) -> None:
    """``--stop-after`` must be a step still ahead of the run."""
    if stop_after is not None and stop_after <= step:
        where = f"the checkpoint's step {step}" if step else "step 0"
        raise ConfigError(f"--stop-after {stop_after} must be after {where}: give a later step, or drop it")


def schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to ``lr`` (none with warmup 0), then cosine decay to lr/10 at the last step."""
    import optax

    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup_steps(cfg), decay_steps=max(cfg.steps, 2),
        end_value=cfg.lr / 10,
    )  # fmt: skip


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW or SGD with momentum, on the warmup + cosine schedule."""
    import optax

    lr = schedule(cfg)
    if cfg.optimizer == "adamw":
        return optax.adamw(lr, weight_decay=cfg.weight_decay)
    return optax.sgd(lr, momentum=cfg.momentum)


def dumps(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_json(), indent=2, sort_keys=True)
