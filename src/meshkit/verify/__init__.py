"""Equivalence certificates: a plan beside one device, in float64 and in float32.

``verify_model(loss_fn, params, batch, optimizer)`` certifies a plan for any loss (a plain pytree, or
a model from ``meshkit.from_nnx`` / ``from_linen`` / ``from_equinox``); ``verify(plan, model)`` does
the same for the built-in reference models (linear, MLP, GPT), the first two also beside NumPy
float64 with hand-written gradients and Adam. Both return a ``Certificate``: the differences below,
the plan's communication and memory beside the model (``Trainer.report``), and ``ok``.

What runs: K optimizer steps under the plan, twice from the same start (the same compiled program:
bit-for-bit reproducibility), the same K steps on one device (a hand-written ``jax.grad`` + optax
loop), and the plan and the one device again on the model's float64 twin (parameters and batch cast
to float64 under ``jax.enable_x64``; offered when the loss computes in float64 throughout, i.e. its
jaxpr holds no narrower float). Differences are relative to the reference's scale, leaf by leaf:
``max|a - b| / max|b|``.

What it checks, and why so:

- **float64: plan = one device** (``<= TOL_EXACT``). The plan only changes where sums happen and in
  which order (data shards, micro-batches, model shards, pipeline stages); in float64 that rounding
  is ~1e-16, so after K steps the plan must equal one device to 1e-10, or it computes another
  function (a dropped or mis-scaled micro-batch moves it by 1e-3 or more).
- **float32: first step within rounding** (``<= first_step_bound``). After K Adam steps the float32
  parameters are not a stable quantity: Adam divides each gradient element by its own size, so an
  element whose gradient nearly cancels moves by +-lr on the sign of its rounding error, and the
  run then follows its own trajectory. Measured on the verify GPT (8 layers, 5 steps), one device on
  its own with the batch's examples merely reordered lands 4.9e-4 to 5.0e-3 from float64 over 40
  orders (10x apart), 6.3e-3 from the unreordered run: any bound on one float32 K-step run against
  another cries wolf (the old "2x one device's float32 noise" failed a correct pp plan at 3.7x). The
  gradient has no such division: its float32 error is rounding of sums, light-tailed (over 30
  orders the GPT's first-step error spans 4.7e-7 to 1.0e-6, the MLP's 1.4e-7 to 3.8e-7, with or
  without micro-batches). So the float32 check is on the first step: the optimizer's state after
  one step (Adam's moments 0.1 g and 0.001 g^2; the gradient itself for an optimizer without
  state) under the plan, against float64. Its bound is derived from what the plan changes:

  ``first_step_bound = TAIL * sqrt(1 + (P - 1) / log2(n)) * first_step_noise``

  where ``first_step_noise`` is one device's own float32 error, the largest over ``ORDERS`` orders
  of the batch (the same function with every batch sum reordered, which is what data shards and
  micro-batches do; an order counts only where float64 shows it is the same function, so not under
  per-example randomness). By the probabilistic model of rounding (Higham and Mary, 2019) the error
  of a sum grows as the square root of the roundings each term meets. One device's sum of n
  examples rounds each term log2(n) times at least (on average over any summation tree), and a
  plan splitting the sum into P partial sums (``partial_sums``: devices x micro-batches) adds at most
  P - 1 roundings per term; hence the square root. ``TAIL`` = 2 covers the spread of a draw beyond
  the largest of ``ORDERS`` draws (1.9x between the smallest and largest of 30, above). A float32
  bug (a bfloat16 cast, a dropped micro-batch) moves the first step by 1e-3 or more, against bounds
  of 1e-6 to 1e-5.
- **float32 K steps, beside the spread**: ``vs_single_device`` (plan vs one device after K steps)
  is reported beside ``float32_spread`` (one device vs itself on reordered batches) and
  ``float32_noise`` (one device vs float64); informational, for the reason above.
- for linear and MLP, the float32 plan after K steps beside NumPy float64 (``<= TOL_FLOAT64``;
  these models do not amplify rounding: over 40 orders the distance varies by 1.08x).
- bitwise reproducible run to run; communication, memory and (pipelines) the bubble = model.

Without a float64 twin (a loss fixed to float32), the first step is compared with one device in
float32, its noise taken from the reordered batches; the certificate says so in ``float64_twin``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from meshkit._errors import MeshkitError
from meshkit.models import registry
from meshkit.spec import STAGE, ParallelSpec
from meshkit.verify.certificate import Certificate, _certify
from meshkit.verify.compare import (
    ORDERS,
    TAIL,
    TOL_EXACT,
    TOL_FLOAT64,
    TOL_SAME,
    bitwise_equal,
    relative_difference,
)
from meshkit.verify.meshes import bitwise_meshes, check_meshes, comparison_meshes
from meshkit.verify.reference import _reference, shared_reference
from meshkit.verify.workloads import MLP_AXES, Workload, family_workload, workload

__all__ = [
    "MLP_AXES",
    "ORDERS",
    "TAIL",
    "TOL_EXACT",
    "TOL_FLOAT64",
    "TOL_SAME",
    "Certificate",
    "Workload",
    "bitwise_equal",
    "bitwise_meshes",
    "check_meshes",
    "comparison_meshes",
    "relative_difference",
    "verify",
    "verify_model",
    "workload",
]


def _check_steps(steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise MeshkitError(f"steps must be a whole number of at least 1, got {steps!r}")


def _layers(spec: ParallelSpec, model: str) -> dict:
    """A pipeline plan verifies a model family as ``Stages`` with one layer per virtual stage (at least
    2); an expert plan a family's model with a mixture of 8 experts per layer; a context plan a family's
    model (its sequences split over the context axis)."""
    plan = spec.plan_info
    if not (plan.expert or plan.pipeline or plan.split_axes("sequence")):
        return {}
    if family_workload(model) is None:
        what = (
            "a mixture of experts"
            if plan.expert
            else "a model of stacked blocks"
            if plan.pipeline
            else "a model of token sequences (its attention split over the sequence)"
        )
        raise MeshkitError(f"plan {spec.plan} verifies {what}: use --model {' or '.join(registry.names())}")
    if not (plan.expert or plan.pipeline):
        return {}
    if plan.expert:
        return {"experts": 8}
    p = spec.degrees(jax.device_count())[STAGE]
    return {"layers": max(2, p * spec.virtual_stages), "stages": True}


def verify(
    plan: str,
    model: str = "mlp",
    *,
    mesh: str | None = None,
    steps: int = 20,
    accumulate: int = 1,
    lr: float = 1e-2,
    seed: int = 0,
    remat: str = "none",
    microbatches: int | None = None,
    pipeline_schedule: str | None = None,
    virtual_stages: int = 1,
    context_attention: str = "ring",
    deterministic: bool | int | None = None,
    sequence_parallel: bool = False,
) -> Certificate:
    """Train the built-in ``model`` for ``steps`` Adam steps under ``plan`` and certify the result.

    Pipeline plans take ``microbatches``, ``pipeline_schedule`` and ``virtual_stages``, and verify the GPT
    as ``Stages`` with one layer per virtual stage (so the layers divide over the stages)."""
    _check_steps(steps)
    spec = ParallelSpec(
        plan=plan,
        mesh=mesh,
        accumulate=accumulate,
        remat=remat,
        microbatches=microbatches,
        pipeline_schedule=pipeline_schedule,
        virtual_stages=virtual_stages,
        context_attention=context_attention,
        deterministic=deterministic or None,
        sequence_parallel=sequence_parallel,
    )
    check_meshes(spec)
    shape = _layers(spec, model)
    w = workload(model, seed, **shape)
    key = (model, seed, tuple(sorted(shape.items())), "adam", lr, steps)
    return _certify(w, optax.adam(lr), spec, steps, shared_reference(key, w, optax.adam(lr), steps, lr))


def verify_model(
    loss_fn: Callable,
    params: Any,
    batch: Any,
    optimizer: optax.GradientTransformation | None = None,
    *,
    spec: ParallelSpec | None = None,
    plan: str | None = None,
    mesh: str | None = None,
    steps: int = 20,
    accumulate: int | None = None,
    remat: str | None = None,
    microbatches: int | None = None,
    pipeline_schedule: str | None = None,
    virtual_stages: int | None = None,
    context_attention: str | None = None,
    deterministic: bool | int | None = None,
    sequence_parallel: bool | None = None,
    logical_axes: Any = None,
    rules: Any = None,
    units: Any = None,
    state: Any = None,
    rng: Any = None,
    has_aux: bool = False,
    tokens_per_example: int = 1,
    name: str = "model",
) -> Certificate:
    """Certify a plan for any model: ``loss_fn(params, batch) -> loss`` (the forms ``Trainer`` takes:
    ``state=``, ``rng=``, ``has_aux=``, or a ``meshkit.Adapted`` model as ``params``) trained for
    ``steps`` steps of ``optimizer`` (default ``optax.adam(1e-2)``) under the plan (``spec=``, or
    the options that make one; default dp over every device), beside one device and the model's
    float64 twin. ``batch`` is the global batch (leading dim = examples)."""
    optimizer = optax.adam(1e-2) if optimizer is None else optimizer
    spec = ParallelSpec.of(
        spec,
        plan=plan,
        mesh=mesh,
        accumulate=accumulate,
        remat=remat,
        microbatches=microbatches,
        pipeline_schedule=pipeline_schedule,
        virtual_stages=virtual_stages,
        context_attention=context_attention,
        deterministic=deterministic or None,
        sequence_parallel=sequence_parallel or None,
    )
    _check_steps(steps)
    check_meshes(spec)
    w = Workload(
        name=name,
        loss_fn=loss_fn,
        params=params,
        batch=batch,
        logical_axes=logical_axes,
        rules=rules,
        units=units,
        state=state,
        rng=rng,
        has_aux=has_aux,
        tokens_per_example=tokens_per_example,
    )
    return _certify(w, optimizer, spec, steps, _reference(w, optimizer, steps, numpy_lr=None))
