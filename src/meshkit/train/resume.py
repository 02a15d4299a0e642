"""What ``--resume`` keeps and what it may change, from the options' own declarations
(``meshkit.spec.option``'s ``fixes``): an option that fixes the run (its model, data order, arithmetic,
learning-rate schedule...) must keep the value the run started with; the others change how the same
computation is laid out over devices (the checkpoint is resharded; the results agree to rounding) or what
is measured and written around it."""

from __future__ import annotations

from typing import Any

from meshkit.spec import PLANS, ParallelSpec
from meshkit.train.config import FIELDS, ConfigError, TrainConfig, flag, lora_config, validate, warmup_steps

FIXED_ON_RESUME: dict[str, str] = {n: f.metadata["fixes"] for n, f in FIELDS.items() if f.metadata["fixes"]}
"""What each option that fixes the run fixes; a resumed run must keep it to continue the same run (the
learning-rate schedule spans ``steps``, so even ``steps`` is fixed: ``--stop-after`` stops early)."""
CHANGEABLE_ON_RESUME = tuple(n for n in FIELDS if n not in FIXED_ON_RESUME and n != "run_dir")
"""What a resumed run may change (``run_dir`` names the run itself)."""
PIPELINE_OPTIONS = ("microbatches", "pipeline_schedule", "virtual_stages")


DERIVED = ("warmup", "lora_alpha")
"""Options whose value in the run may follow from others' (``effective``)."""


def effective(cfg: TrainConfig, key: str) -> Any:
    """The value an option takes in the run: a default that depends on others (``warmup``: a tenth of
    the steps; ``lora_alpha``: LoRA's) resolved."""
    if key == "warmup":
        return warmup_steps(cfg)
    if key == "lora_alpha" and (lora := lora_config(cfg)) is not None:
        return lora.alpha
    return cfg.get(key)


def _text(value: Any) -> str:
    if value is None:
        return "default"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def check_same_run(saved: TrainConfig, cfg: TrainConfig, where: str) -> None:
    """Raise, naming the option, unless ``cfg`` keeps everything ``saved`` fixed (an option whose value in the
    run follows from another's, ``effective``'s, after the one it follows: ``--steps``, not the warmup it moved)."""
    for key, what in sorted(FIXED_ON_RESUME.items(), key=lambda kv: kv[0] in DERIVED):
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
    if "plan" in changes and not (changes["plan"] in PLANS and PLANS[changes["plan"]].pipeline):
        defaults = ParallelSpec.defaults()
        changes |= {k: defaults[k] for k in PIPELINE_OPTIONS if k not in given}
    cfg = saved.replace(**changes, run_dir=where)
    check_same_run(saved, cfg, where)
    # a --warmup equal to the one the saved run uses (a tenth of its steps) changes nothing
    cfg = cfg.replace(warmup=saved.optimizer.warmup)
    lines = [
        f"{flag(k)}: {_text(saved.get(k))} -> {_text(v)}"
        for k, v in changes.items()
        if k in CHANGEABLE_ON_RESUME and saved.get(k) != v
    ]
    validate(cfg)
    return cfg, lines


def check_stop_after(stop_after: int | None, step: int) -> None:
    """``--stop-after`` must be a step still ahead of the run."""
    if stop_after is not None and stop_after <= step:
        where = f"the checkpoint's step {step}" if step else "step 0"
        raise ConfigError(f"--stop-after {stop_after} must be after {where}: give a later step, or drop it")
