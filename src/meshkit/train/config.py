"""The training job's configuration: one frozen dataclass, and presets as plain functions."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import optax

from meshkit._errors import MeshkitError


class ConfigError(MeshkitError):
    """A training option is out of range or inconsistent."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Everything ``meshkit train`` needs; ``config.json`` in the run directory is this, as JSON."""

    plan: str = "fsdp"
    """Parallel plan: dp, zero1, zero2, zero3 (fsdp), tp, dp+tp, fsdp+tp."""
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
    warmup: int = 40
    """Linear warmup steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    momentum: float = 0.9
    """SGD momentum."""
    accumulate: int = 1
    """Micro-batches accumulated per optimizer step."""
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
    return TrainConfig(steps=12, batch_size=16, seq_len=32, layers=1, width=32, heads=4, warmup=2, eval_every=6,
                       eval_batches=1, checkpoint_every=6, sample_chars=20)  # fmt: skip


PRESETS = {"default": default, "tiny": tiny}

#: Options that define the model, the data order and the optimizer: a resumed run must match them.
RESUME_KEYS = ("batch_size", "seq_len", "layers", "width", "heads", "optimizer", "lr", "warmup", "weight_decay",
               "momentum", "accumulate", "clip", "precision", "seed", "data", "scan_layers")  # fmt: skip


def validate(cfg: TrainConfig) -> None:
    """Range checks that need no data and no devices."""
    checks = [
        (cfg.steps >= 1, f"--steps must be at least 1, got {cfg.steps}"),
        (cfg.batch_size >= 1, f"--batch-size must be at least 1, got {cfg.batch_size}"),
        (cfg.seq_len >= 1, f"--seq-len must be at least 1, got {cfg.seq_len}"),
        (cfg.layers >= 1 and cfg.width >= 1, "--layers and --width must be at least 1"),
        (
            cfg.heads >= 1 and cfg.width % cfg.heads == 0,
            f"--heads {cfg.heads} must divide --width {cfg.width}",
        ),
        (cfg.optimizer in ("adamw", "sgd"), f"unknown --optimizer {cfg.optimizer!r}: use adamw or sgd"),
        (cfg.lr > 0, f"--lr must be positive, got {cfg.lr}"),
        (
            0 <= cfg.warmup < cfg.steps or cfg.steps == 1,
            f"--warmup {cfg.warmup} must be below --steps {cfg.steps}",
        ),
        (cfg.accumulate >= 1, f"--accumulate must be at least 1, got {cfg.accumulate}"),
        (cfg.clip is None or cfg.clip > 0, f"--clip must be positive, got {cfg.clip}"),
        (cfg.precision in ("fp32", "bf16"), f"unknown --precision {cfg.precision!r}: use fp32 or bf16"),
        (
            cfg.remat in ("none", "layer", "dots", "regather"),
            f"unknown --remat {cfg.remat!r}: use none, layer, dots or regather",
        ),
        (cfg.eval_every >= 0 and cfg.eval_batches >= 1, "--eval-every must be >= 0 and --eval-batches >= 1"),
        (cfg.checkpoint_every >= 1, f"--checkpoint-every must be at least 1, got {cfg.checkpoint_every}"),
        (0 <= cfg.seed < 2**32, f"--seed must be in [0, 2**32), got {cfg.seed}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to ``lr``, then cosine decay to lr/10 at the last step."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=max(cfg.warmup, 1), decay_steps=max(cfg.steps, 2),
        end_value=cfg.lr / 10,
    )  # fmt: skip


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW or SGD with momentum, on the warmup + cosine schedule."""
    lr = schedule(cfg)
    if cfg.optimizer == "adamw":
        return optax.adamw(lr, weight_decay=cfg.weight_decay)
    return optax.sgd(lr, momentum=cfg.momentum)


def dumps(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_json(), indent=2, sort_keys=True)
