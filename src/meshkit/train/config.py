"""The training job's configuration: one frozen dataclass holding the parallel spec, and presets as
plain functions.

Every option has one name, used as it is in Python and as ``--name-with-dashes`` on the command
line: the job's own fields here, and the layout's (``plan``, ``mesh``, ``remat``, ``precision``,
``accumulate``, ``microbatches``, ``pipeline_schedule``, ``virtual_stages``) in the
``ParallelSpec`` it holds (``meshkit.spec``), which validates them. ``config.json`` in a run
directory is this config as JSON, checked on ``--resume`` with the same rules and messages.
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
from meshkit.spec import PLATFORM_PRECISION, ParallelSpec, PlanError
from meshkit.train.task import problem as task_problem


class ConfigError(MeshkitError):
    """A training option is out of range or inconsistent."""


HF_PREFIX = "hf:"
"""How ``--init-from`` names a Hugging Face checkpoint directory."""
TRACKERS = ("jsonl", "tensorboard", "wandb")
"""Where ``--tracker`` sends the metrics (``meshkit.train.metrics``); jsonl (metrics.jsonl) is always on."""
MODEL_DEFAULTS = {"model": "gpt", "kv_heads": 0, "tie_embeddings": False, "init_from": None, "experts": 0,
                  "experts_per_token": 2, "capacity_factor": 1.25, "lora_rank": 0, "lora_alpha": 16.0,
                  "lora_targets": None, "task": "pretrain", "document_masks": False}  # fmt: skip
"""What a config written before these options trained: the GPT from random weights."""

MAX_STEPS = 10**9
"""More optimizer steps than any run takes (a bound, so that nonsense fails before anything is written)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Everything ``meshkit train`` needs; ``config.json`` in the run directory is this, as JSON."""

    parallel: ParallelSpec = field(default_factory=lambda: ParallelSpec(plan="fsdp"))
    """How the step is laid out over devices: plan, mesh, remat, precision, micro-batches."""
    plan_reason: str | None = None
    """Why ``--plan auto`` chose the plan (None: the plan was given)."""
    steps: int = 400
    """Optimizer steps in total (a resumed run continues up to this count)."""
    batch_size: int = 32
    """Global batch, in sequences."""
    seq_len: int = 128
    """Characters (tokens) per sequence."""
    model: str = "gpt"
    """The decoder trained: 'gpt' (learned positions, LayerNorm, GELU) or 'llama' (rotary, RMSNorm,
    SwiGLU, grouped-query attention): a family of ``meshkit.models.registry``."""
    kv_heads: int = 0
    """Llama: key/value heads (grouped-query attention; must divide heads); 0: as many as heads."""
    tie_embeddings: bool = False
    """Llama: the output head is the token embedding, transposed."""
    experts: int = 0
    """Mixture of experts: MLPs per layer (0: a dense MLP; ``ModelShape.experts``)."""
    experts_per_token: int = 2
    """Mixture of experts: the experts each token is routed to (top-k)."""
    capacity_factor: float = 1.25
    """Mixture of experts: an expert takes at most ceil(capacity_factor x T x k / experts) slots of a sequence."""
    init_from: str | None = None
    """Start from a Hugging Face checkpoint instead of random weights: 'hf:DIR' (config.json +
    safetensors); its shape must be the run's."""
    lora_rank: int = 0
    """LoRA: the adapters' rank (``meshkit.models.lora``; the base weights frozen); 0: full fine-tuning."""
    lora_alpha: float = 16.0
    """LoRA: the update is scaled by lora_alpha / lora_rank."""
    lora_targets: str | None = None
    """LoRA: comma-separated keys of the matrices adapted; None: ``lora.DEFAULT_TARGETS``."""
    export_hf: bool = False
    """At the end, write the trained model as a Hugging Face checkpoint into the run's hf/."""
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
    clip: float | None = 1.0
    """Global-norm gradient clipping (None: off)."""
    scan_layers: bool = False
    """The GPT's scanned form: blocks stacked under lax.scan (compile time flat in depth)."""
    seed: int = 0
    """Seed of the parameter initialisation and of the data order."""
    task: str = "pretrain"
    """What is trained (``spec.TASKS``, ``train.task``): 'pretrain' (every token) or 'sft' (conversations:
    the loss on the assistant's tokens only, packed with a mask per document)."""
    document_masks: bool = False
    """Pretraining: documents packed in a window attend within themselves, their positions from 0."""
    data: str | None = None
    """A directory made by ``meshkit data prepare`` (BPE token shards), a UTF-8 text file (characters are the
    tokens) or a .npy of token ids; None: Python's own reference docs (pydoc_data.topics), per character.
    ``DIR:WEIGHT,DIR:WEIGHT,...``: a mixture of prepared directories sharing one tokenizer, each global batch's
    rows drawn from them by the weights (normalised; :mod:`meshkit.data.mixture`)."""
    run_dir: str = "runs/latest"
    """Where config.json, metrics.jsonl, report.json, plots and checkpoints go (the CLI gives each new
    run its own runs/<time> and points runs/latest at it)."""
    eval_every: int = 50
    """Evaluate on the held-out split every this many steps (0: only at the end)."""
    eval_batches: int = 4
    """Held-out batches per evaluation."""
    eval_tasks: str | None = None
    """Multiple-choice log-likelihood tasks scored at each evaluation (acc, acc_norm as lm-evaluation-harness
    counts them): JSONL files, comma-separated, or the names of shipped ones (``meshkit.train.evals``)."""
    checkpoint_every: int = 100
    """Save a checkpoint every this many steps (and always at the end)."""
    sample_chars: int = 200
    """Characters of text sampled from the model at the end (0: none)."""
    tensorboard: bool = False
    """Also write TensorBoard event files (scalars of metrics.jsonl) into the run directory."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device, for MFU; None: the table's figure for the device kind at the run's
    precision (``planner.hardware``: H100, H200, B200, A100, TPU v4/v5e/v5p/v6e), none on a CPU."""
    tracker: str = "jsonl"
    """Where the metrics go, comma-separated (``TRACKERS``): jsonl (always), tensorboard, wandb (a Weights &
    Biases run in the run's wandb/, offline unless WANDB_MODE says otherwise)."""

    def get(self, name: str) -> Any:
        """An option by its one name: the job's own fields, or the parallel spec's."""
        if name in PARALLEL:
            return getattr(self.parallel, name)
        return getattr(self, name)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with options changed by name (the parallel spec's among them, validated by it)."""
        unknown = sorted(set(changes) - set(OPTIONS) - {"parallel"})
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown}: the options are {', '.join(OPTIONS)}")
        mine = {k: v for k, v in changes.items() if k not in PARALLEL}
        layout = {k: v for k, v in changes.items() if k in PARALLEL}
        if layout:
            mine["parallel"] = _spec(mine.get("parallel", self.parallel), layout)
        return dataclasses.replace(self, **mine)

    def to_json(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in OWN}, "parallel": self.parallel.to_json()}

    @classmethod
    def from_json(cls, data: Any, where: str = "config.json") -> TrainConfig:
        """The config a run saved, checked field by field (type, range) with the command line's rules.

        Every option that fixes the run must be present (a missing one is not silently defaulted);
        a config of a meshkit release before the parallel spec (its options at the top level) is read
        too."""
        if not isinstance(data, dict):
            raise ConfigError(
                f"{where} is not a meshkit config (a JSON object of options): give a run's directory"
            )
        data = {**MODEL_DEFAULTS, **data}
        layout = data.pop("parallel", None)
        if layout is None:  # the layout's options at the top level, as written before the parallel spec
            layout = {
                PARALLEL_OLD.get(k, k): data.pop(k) for k in list(data) if PARALLEL_OLD.get(k, k) in PARALLEL
            }
        if not isinstance(layout, dict):
            raise ConfigError(f"{where}: 'parallel' must be an object of {', '.join(PARALLEL)}")
        unknown = sorted((set(data) - set(OWN)) | (set(layout) - set(PARALLEL)))
        if unknown:
            raise ConfigError(
                f"{where} has unknown option(s) {unknown}: it was not written by this meshkit, or was edited"
            )
        if missing := [k for k in FIXED_ON_RESUME if k not in data and k not in layout]:
            raise ConfigError(
                f"{where} lacks {', '.join(map(flag, missing))}, which the run fixed: restore the file"
            )
        for name, value in [*data.items(), *layout.items()]:
            check_type(name, value, where)
        try:
            cfg = cls(parallel=ParallelSpec(**layout), **data)
        except PlanError as e:
            raise ConfigError(f"{where}: {e}") from None
        validate(cfg)
        return cfg


PARALLEL = ParallelSpec.fields()
"""The options the parallel spec holds."""
PARALLEL_OLD = {"schedule": "pipeline_schedule"}
"""Names the parallel options had in configs written before the spec."""
OWN = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name != "parallel")
OPTIONS = (*PARALLEL, *OWN)
"""Every option of ``meshkit train``, by its one name."""


def _spec(spec: ParallelSpec, changes: dict[str, Any]) -> ParallelSpec:
    try:
        return spec.replace(**changes)
    except PlanError as e:
        raise ConfigError(str(e)) from None


def option_types() -> dict[str, Any]:
    """Each option's type, by its one name (the job's fields and the parallel spec's)."""
    hints = typing.get_type_hints(TrainConfig) | typing.get_type_hints(ParallelSpec)
    return {k: v for k, v in hints.items() if k != "parallel"}


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
    "model": "the model",
    "kv_heads": "the model's shape",
    "tie_embeddings": "the model's shape",
    "experts": "the model's shape",
    "experts_per_token": "the model's routing",
    "capacity_factor": "the model's routing",
    "init_from": "the initialisation",
    "lora_rank": "the trained parameters",
    "lora_alpha": "the trained parameters",
    "lora_targets": "the trained parameters",
    "layers": "the model's shape",
    "width": "the model's shape",
    "heads": "the model's shape",
    "seq_len": "the model's shape and the data order",
    "batch_size": "the data order",
    "seed": "the initialisation and the data order",
    "data": "the data",
    "task": "the loss and the data stream",
    "document_masks": "the attention and the data stream",
    "precision": "the arithmetic",
    "deterministic": "the order the gradients are summed in",
}
#: What a resumed run may change: how the same computation is laid out over devices (the checkpoint is
#: resharded; the results agree to rounding), and what is measured and written around it.
CHANGEABLE_ON_RESUME = ("plan", "plan_reason", "mesh", "accumulate", "eval_every", "eval_batches", "eval_tasks", "checkpoint_every",
                        "sample_chars", "tensorboard", "remat", "scan_layers", "microbatches", "pipeline_schedule",
                        "virtual_stages", "context_attention", "attention", "export_hf", "tracker", "peak_tflops")  # fmt: skip
PIPELINE_OPTIONS = ("microbatches", "pipeline_schedule", "virtual_stages")


def lora_config(cfg: TrainConfig) -> Any:
    """The run's ``meshkit.models.lora.LoraConfig``, or None (``lora_rank`` 0: full fine-tuning)."""
    if not cfg.lora_rank:
        return None
    from meshkit.models import lora

    targets = lora.DEFAULT_TARGETS if cfg.lora_targets is None else tuple(cfg.lora_targets.split(","))
    return lora.LoraConfig(
        rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=tuple(t.strip() for t in targets)
    )


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


def effective(cfg: TrainConfig, key: str) -> Any:
    return warmup_steps(cfg) if key == "warmup" else cfg.get(key)


def _text(value: Any) -> str:
    if value is None:
        return "default"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def check_same_run(saved: TrainConfig, cfg: TrainConfig, where: str) -> None:
    """Raise, naming the option, unless ``cfg`` keeps everything ``saved`` fixed."""
    for key, what in FIXED_ON_RESUME.items():
        old, new = effective(saved, key), effective(cfg, key)
        if old != new:
            raise ConfigError(
                f"--resume: {flag(key)} was {old!r} in '{where}' and fixes {what}, so it cannot become {new!r}; "
                f"drop {flag(key)}, or start a new run in another --run-dir"
            )


def resumed(saved: TrainConfig, given: dict[str, Any], where: str) -> tuple[TrainConfig, list[str]]:
    """The saved config with the options given again: those that only change the layout or the logging
    are applied (each change is returned as one line), any change of what the run fixed is refused.
    A plan without a pipeline drops the saved pipeline options (said in a line)."""
    changes = {k: v for k, v in given.items() if k != "run_dir"}
    if "plan" in changes and not _is_pipeline(changes["plan"]):
        defaults = ParallelSpec.defaults()
        changes |= {k: defaults[k] for k in PIPELINE_OPTIONS if k not in given}
    cfg = saved.replace(**changes, run_dir=where)
    check_same_run(saved, cfg, where)
    # a --warmup equal to the one the saved run uses (a tenth of its steps) changes nothing
    cfg = cfg.replace(warmup=saved.warmup)
    lines = [
        f"{flag(k)}: {_text(saved.get(k))} -> {_text(v)}"
        for k, v in changes.items()
        if k in CHANGEABLE_ON_RESUME and saved.get(k) != v
    ]
    validate(cfg)
    return cfg, lines


def _is_pipeline(plan: str) -> bool:
    from meshkit.spec import PLANS

    return plan in PLANS and PLANS[plan].pipeline


def validate(cfg: TrainConfig) -> None:
    """Range checks that need no data and no devices; each message names the option to change."""
    warmup = warmup_steps(cfg)
    checks = [
        (lambda: 1 <= cfg.steps <= MAX_STEPS, lambda: f"--steps must be between 1 and {MAX_STEPS:,}, got {cfg.steps}"),
        (lambda: cfg.batch_size >= 1, lambda: f"--batch-size must be at least 1, got {cfg.batch_size}"),
        (lambda: cfg.seq_len >= 1, lambda: f"--seq-len must be at least 1, got {cfg.seq_len}"),
        (lambda: cfg.layers >= 1, lambda: f"--layers must be at least 1, got {cfg.layers}"),
        (lambda: cfg.width >= 1, lambda: f"--width must be at least 1, got {cfg.width}"),
        (lambda: cfg.heads >= 1, lambda: f"--heads must be at least 1, got {cfg.heads}"),
        # from a checkpoint, its head_dim sets the heads' width (checked against its tensors on load)
        (lambda: cfg.init_from is not None or cfg.width % cfg.heads == 0,
         lambda: f"--heads {cfg.heads} must divide --width {cfg.width}"),
        (lambda: cfg.model in registry.names(),
         lambda: f"unknown --model {cfg.model!r}: use {' or '.join(registry.names())}"),
        (lambda: cfg.kv_heads >= 0, lambda: f"--kv-heads must be at least 0 (0: as many as --heads), got {cfg.kv_heads}"),
        (lambda: not _foreign_options(cfg), lambda: _foreign_options(cfg)),
        (lambda: cfg.kv_heads == 0 or cfg.heads % cfg.kv_heads == 0,
         lambda: f"--kv-heads {cfg.kv_heads} must divide --heads {cfg.heads}"),
        (lambda: registry.family(cfg.model).check(cfg) is None, lambda: registry.family(cfg.model).check(cfg)),
        (lambda: cfg.init_from is None or (cfg.init_from.startswith(HF_PREFIX) and len(cfg.init_from) > len(HF_PREFIX)),
         lambda: f"--init-from {cfg.init_from!r}: give hf:DIR, a Hugging Face checkpoint directory"),
        (lambda: cfg.lora_rank >= 0, lambda: f"--lora-rank must be at least 0 (0: full fine-tuning), got {cfg.lora_rank}"),
        (lambda: cfg.lora_rank > 0 or (cfg.lora_targets, cfg.lora_alpha) == (None, 16.0),
         lambda: "--lora-alpha and --lora-targets set LoRA's adapters: give their --lora-rank too (e.g. 8)"),
        (lambda: cfg.optimizer in ("adamw", "sgd"), lambda: f"unknown --optimizer {cfg.optimizer!r}: use adamw or sgd"),
        (lambda: math.isfinite(cfg.lr) and cfg.lr > 0, lambda: f"--lr must be a positive finite number, got {cfg.lr}"),
        (lambda: math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0,
         lambda: f"--weight-decay must be a finite number of at least 0, got {cfg.weight_decay}"),
        (lambda: math.isfinite(cfg.momentum) and 0 <= cfg.momentum < 1,
         lambda: f"--momentum must be in [0, 1), got {cfg.momentum}"),
        (lambda: warmup >= 0, lambda: f"--warmup must be at least 0, got {warmup}"),
        (lambda: warmup < cfg.steps, lambda: f"--warmup {warmup} must be below --steps {cfg.steps}: lower --warmup, "
                                             f"or leave it out (default: a tenth of --steps)"),
        (lambda: cfg.clip is None or (math.isfinite(cfg.clip) and cfg.clip > 0),
         lambda: f"--clip must be a positive finite number (0 turns it off), got {cfg.clip}"),
        (lambda: cfg.eval_every >= 0, lambda: f"--eval-every must be at least 0 (0: at the end only), got {cfg.eval_every}"),
        (lambda: cfg.eval_batches >= 1, lambda: f"--eval-batches must be at least 1, got {cfg.eval_batches}"),
        (lambda: cfg.checkpoint_every >= 1, lambda: f"--checkpoint-every must be at least 1, got {cfg.checkpoint_every}"),
        (lambda: cfg.sample_chars >= 0, lambda: f"--sample-chars must be at least 0, got {cfg.sample_chars}"),
        (lambda: 0 <= cfg.seed < 2**32, lambda: f"--seed must be in [0, 2**32), got {cfg.seed}"),
        (lambda: task_problem(cfg) is None, lambda: task_problem(cfg)),
        (lambda: cfg.peak_tflops is None or (math.isfinite(cfg.peak_tflops) and cfg.peak_tflops > 0),
         lambda: f"--peak-tflops must be a positive finite number (one device's peak), got {cfg.peak_tflops}"),
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
    family, defaults = registry.family(cfg.model), default()
    given = [
        n
        for f in registry.families()
        for n in f.options
        if n not in family.options and cfg.get(n) != defaults.get(n)
    ]
    if not given:
        return ""
    takers = [f.name for f in registry.families() if set(given) <= set(f.options)] or ["another"]
    said = " and ".join(flag(n) for n in dict.fromkeys(given))
    return f"{said} {'is' if len(given) == 1 else 'are'} for --model {' or '.join(takers)}: add --model {takers[0]}, or drop them"  # fmt: skip


def trackers(cfg: TrainConfig) -> tuple[str, ...]:
    """The trackers a run writes to (``--tracker``, comma-separated, with ``--tensorboard``), in ``TRACKERS``
    order; jsonl is always one."""
    names = [n.strip() for n in cfg.tracker.split(",") if n.strip()]
    if unknown := [n for n in names if n not in TRACKERS]:
        raise ConfigError(
            f"unknown --tracker {unknown[0]!r}: use a comma-separated list of {', '.join(TRACKERS)}"
        )
    chosen = {"jsonl", *names, *(["tensorboard"] if cfg.tensorboard else [])}
    return tuple(n for n in TRACKERS if n in chosen)


def check_stop_after(stop_after: int | None, step: int) -> None:
    """``--stop-after`` must be a step still ahead of the run."""
    if stop_after is not None and stop_after <= step:
        where = f"the checkpoint's step {step}" if step else "step 0"
        raise ConfigError(f"--stop-after {stop_after} must be after {where}: give a later step, or drop it")


def dumps(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_json(), indent=2, sort_keys=True)
