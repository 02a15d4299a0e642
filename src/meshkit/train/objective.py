"""What a post-training run optimises (``--task dpo``, ``--task grpo``): its objective from the run's
options (``ObjectiveOptions``), the one place that refuses what cannot train as given, the loss the step
is built from, and the frozen reference model's log-probs (``reference_step``).

- ``dpo``: :mod:`meshkit.models.preference` on pair rows; the reference's summed log-probs of each pair
  fill the batch's ``reference`` before each step.
- ``grpo``: :mod:`meshkit.models.grpo` on rollout rows (:mod:`meshkit.train.rollout`); where ``--beta`` > 0
  the reference's per-token log-probs join the rollout's values.

The reference is the frozen starting model: under LoRA the base weights of the run's own parameters (never
trained: no copy), else a copy of the parameters as they start, laid out as the run's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshkit.spec import CONTEXT, PLANS, get_plan

OPTIONS = {
    "dpo": ("beta", "preference_loss", "label_smoothing", "simpo_gamma"),
    "grpo": ("beta", "reward", "generations", "max_new_tokens", "temperature", "grpo_loss", "epsilon",
             "epsilon_high", "scale_rewards", "updates_per_rollout"),
}  # fmt: skip
"""The options each post-training task reads (``ObjectiveOptions``): one given to a task that does not read
it is refused, never ignored."""
BETA = {"dpo": 0.1, "grpo": 0.0}
"""``--beta``'s default by task (TRL's)."""


def problem(cfg: Any) -> str | None:
    """Why the run's objective options cannot train as given (one line naming the fix), or None."""
    task = cfg.data.task
    mine = OPTIONS.get(task, ())
    defaults = {f.name: f.default for f in dataclasses.fields(cfg.objective)}
    given = [n for n in defaults if n not in mine and getattr(cfg.objective, n) != defaults[n]]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        readers = sorted(t for t, names in OPTIONS.items() if given[0] in names)
        return f"{flags} set(s) what only --task {' or '.join(readers)} trains: add that task, or drop it"
    if task not in OPTIONS:
        return None
    what = "pairs of answers" if task == "dpo" else "prompts"
    if cfg.data.data is None:
        return f"--task {task} needs --data: a directory of {what} (meshkit data prepare --chat)"
    if cfg.parallel.plan_info.uses(CONTEXT):
        others = [p for p in PLANS if not get_plan(p).uses(CONTEXT) and not get_plan(p).pipeline]
        return (
            f"--task {task} sums each answer's log-probs along its sequence, which plan {cfg.parallel.plan} splits "
            f"over the context axis: use a plan without it ({', '.join(others)})"
        )
    if cfg.model.loss_chunk:
        return (
            f"--loss-chunk takes the next-token loss in pieces; --task {task} reads each sequence's log-probs "
            "whole: drop --loss-chunk"
        )
    if cfg.model.quantize != "none":
        return (
            f"--quantize {cfg.model.quantize} quantizes the next-token loss's step; --task {task} compares the "
            "policy with an unquantized reference: drop --quantize"
        )
    if cfg.model.experts:
        return (
            f"--task {task} does not train a mixture of experts yet (its load-balancing loss is not part of "
            "the post-training losses): use a dense model (--experts 0)"
        )
    return _settings_problem(cfg) if task == "dpo" else _grpo_problem(cfg)


def _settings_problem(cfg: Any) -> str | None:
    from meshkit._errors import MeshkitError

    try:
        preference(cfg) if cfg.data.task == "dpo" else grpo(cfg)
    except MeshkitError as e:
        return str(e)
    return None


def _grpo_problem(cfg: Any) -> str | None:
    o = cfg.objective
    if o.reward is None:
        return "--task grpo needs --reward: exact (the row's answer), regex:PATTERN, or MODULE:FUNCTION"
    if cfg.data.batch_size % o.generations:
        return (
            f"--batch-size {cfg.data.batch_size} completions do not divide into groups of --generations "
            f"{o.generations}: give a multiple of {o.generations}"
        )
    if o.max_new_tokens >= cfg.data.seq_len:
        return (
            f"--max-new-tokens {o.max_new_tokens} leaves no room for a prompt in --seq-len {cfg.data.seq_len}: "
            "give a longer --seq-len"
        )
    return _settings_problem(cfg)


def beta(cfg: Any) -> float:
    """The run's ``--beta``, or its task's default."""
    given = cfg.objective.beta
    return BETA.get(cfg.data.task, 0.0) if given is None else given


def preference(cfg: Any) -> Any:
    """The run's preference objective (``meshkit.models.preference.Preference``), or None for other tasks."""
    if cfg.data.task != "dpo":
        return None
    from meshkit.models.preference import Preference

    o = cfg.objective
    return Preference(
        loss=o.preference_loss, beta=beta(cfg), label_smoothing=o.label_smoothing, gamma=o.simpo_gamma
    )


def grpo(cfg: Any) -> Any:
    """The run's GRPO settings (``meshkit.models.grpo.GRPO``), or None for other tasks."""
    if cfg.data.task != "grpo":
        return None
    from meshkit.models.grpo import GRPO

    o = cfg.objective
    return GRPO(loss=o.grpo_loss, beta=beta(cfg), epsilon=o.epsilon, epsilon_high=o.epsilon_high,
                temperature=o.temperature, scale_rewards=o.scale_rewards)  # fmt: skip


def applied(family: Any, model: Any) -> Any:
    """The family's ``apply`` with its config: ``(params, tokens, segment_ids=, positions=) -> logits``."""
    return lambda params, tokens, **kw: family.module.apply(params, tokens, model, **kw)


def loss_options(cfg: Any) -> dict[str, Any]:
    """What ``Family.training_loss`` takes from the run's options besides the plan: ``--loss-chunk`` and
    ``--quantize``."""
    return {"loss_chunk": cfg.model.loss_chunk, "quantize": cfg.model.quantize}


def training_loss(cfg: Any, family: Any, model: Any) -> tuple[Any, bool]:
    """``(loss, has_aux)`` the run trains: the family's (``Family.training_loss``), or a post-training task's
    loss of the family's logits with TRL's metrics."""
    if (pref := preference(cfg)) is not None:
        from meshkit.models import preference as P

        return P.make_loss(applied(family, model), pref), True
    if (how := grpo(cfg)) is not None:
        from meshkit.models import grpo as G

        return G.make_loss(applied(family, model), how), True
    return family.training_loss(model, pipeline=cfg.parallel.plan_info.pipeline, **loss_options(cfg))


def frozen_logps(cfg: Any, logps: Any, params: Any, sharding: Any, adapters: Any) -> Any:
    """``(trainer, batch) -> logps(reference params, batch)``, jitted: the reference is the frozen starting
    model (module docstring); ``adapters``: the run's ``LoraConfig`` or None."""
    import jax
    import jax.numpy as jnp

    from meshkit.models import lora

    del cfg
    if adapters is None:
        frozen = jax.tree.map(jnp.copy, params)
        run = jax.jit(logps, out_shardings=sharding)
        return lambda trainer, batch: run(frozen, batch)
    run = jax.jit(lambda p, b: logps(lora.base(p), b), out_shardings=sharding)
    return lambda trainer, batch: run(trainer.params, batch)


def reference_step(cfg: Any, family: Any, model: Any, params: Any, sharding: Any, adapters: Any) -> Any:
    """``(trainer, batch) -> batch`` with the reference's summed log-probs of its pairs
    (``TokenBatch.reference``) for ``--task dpo`` with a reference; None for every other run (GRPO's
    reference joins its rollouts: ``meshkit.train.rollout``)."""
    pref = preference(cfg)
    if pref is None or not pref.needs_reference:
        return None
    from meshkit.models import preference as P

    run = frozen_logps(cfg, P.reference_fn(applied(family, model)), params, sharding, adapters)
    return lambda trainer, batch: batch._replace(reference=run(trainer, batch))
