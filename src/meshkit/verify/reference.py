"""What one device contributes to a certificate: the model trained by a hand-written loop, in
float32 over several batch orders and in float64 (its twin), the first step's own rounding, and
NumPy float64 where the model has it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshkit.devices import host
from meshkit.models import reference_np
from meshkit.verify.compare import (
    ORDERS,
    TOL_EXACT,
    TOL_SAME,
    _float_leaves,
    _floating,
    _to_float64,
    relative_difference,
)
from meshkit.verify.workloads import Workload


def _reorder(batch: Any, order: np.ndarray) -> Any:
    return jax.tree.map(lambda a: np.asarray(a)[order], batch)


def _orders(batch: Any, count: int, seed: int = 0) -> list[np.ndarray]:
    """The given order of the batch's examples, then ``count - 1`` shuffles (the same in every process)."""
    n = jax.tree.leaves(batch)[0].shape[0]
    rng = np.random.default_rng(seed)
    return [np.arange(n)] + [rng.permutation(n) for _ in range(count - 1)]


def _keep_gradient() -> optax.GradientTransformation:
    """An optimizer that moves nothing and keeps the last gradient as its state (``trace`` with
    decay 0 holds exactly g): the probe for an optimizer without per-parameter state (SGD)."""
    return optax.chain(optax.trace(decay=0.0), optax.scale(0.0))


def _probe(optimizer: optax.GradientTransformation, params: Any) -> optax.GradientTransformation:
    """The optimizer whose state after one step is compared: the user's own where its state holds
    parameter-shaped floats (Adam's moments), else ``_keep_gradient``."""
    from meshkit.adapters import Adapted

    if isinstance(params, Adapted):
        params = params.params
    shapes = jax.eval_shape(optimizer.init, params)
    return optimizer if any(_floating(s) and s.shape for s in jax.tree.leaves(shapes)) else _keep_gradient()


def _plans_loss(w: Workload) -> tuple[Callable, Any, Any]:
    """``w``'s loss in the plans' form ``(params, state, batch, key) -> (loss, (aux, state))``, with
    its parameters and state (an adapted model's taken out of it), as the Trainer makes them."""
    from meshkit.adapters import Adapted
    from meshkit.plans import step_loss

    rng = w.rng is not None
    if isinstance(w.params, Adapted):
        a = w.params
        loss = a.loss(w.loss_fn, has_aux=w.has_aux, rng=rng)
        return step_loss(loss, stateful=True, rng=rng, has_aux=w.has_aux), a.params, a.state
    return step_loss(w.loss_fn, stateful=w.state is not None, rng=rng, has_aux=w.has_aux), w.params, w.state


def _step_key(rng: Any, step: int) -> jax.Array:
    """The key the Trainer passes at ``step``: ``fold_in(rng, step)``, or ``key(0)`` without ``rng``."""
    from meshkit.train import base_key

    key = base_key(rng)
    return jax.random.key(0) if key is None else jax.random.fold_in(key, step)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Run:
    params: Any
    """After K steps, on this host."""
    first: list[np.ndarray]
    """The probe optimizer's floating state after the first step."""
    state: Any = None
    """The model's mutated collections (batch statistics, ...) after K steps, on this host."""


class _OneDevice:
    """``w`` trained on one device of this process by a hand-written loop (``jax.grad`` and the
    optimizer), compiled once per optimizer and run for every batch order."""

    def __init__(self, w: Workload) -> None:
        self.loss, self.params, self.state = _plans_loss(w)
        self.rng = w.rng
        self.dev = jax.local_devices()[0]  # every process runs the reference on a device of its own
        self._jitted: dict[int, tuple] = {}

    def _programs(self, opt: optax.GradientTransformation) -> tuple[Callable, Callable]:
        if id(opt) not in self._jitted:  # the optimizer kept beside its programs: its id stays its own

            def step(p, s, st, batch, key):
                (_, (_, st)), g = jax.value_and_grad(self.loss, has_aux=True)(p, st, batch, key)
                u, s = opt.update(g, s, p)
                return optax.apply_updates(p, u), s, st

            self._jitted[id(opt)] = (opt, jax.jit(opt.init), jax.jit(step))
        return self._jitted[id(opt)][1:]

    def run(self, batch: Any, steps: int, optimizer: optax.GradientTransformation) -> _Run:
        init, step = self._programs(optimizer)
        put = functools.partial(jax.device_put, device=self.dev)
        p, st, b = put(self.params), put(self.state), put(batch)
        s = put(init(p))  # committed, as the step's outputs are: one compiled step, not two
        first: list[np.ndarray] = []
        for i in range(steps):
            p, s, st = step(p, s, st, b, put(_step_key(self.rng, i)))
            if i == 0:
                first = _float_leaves(s)
        return _Run(params=host(p), first=first, state=host(st))


def _below_float64(jaxpr: Any) -> str | None:
    """The first floating value narrower than float64 that ``jaxpr`` computes (``dtype (primitive)``),
    looking into its sub-programs (scan, cond, pjit, custom derivatives), or None."""
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            dtype = getattr(v.aval, "dtype", None)
            if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype != jnp.float64:
                return f"{dtype} ({eqn.primitive.name})"
        for value in eqn.params.values():
            for sub in value if isinstance(value, list | tuple) else (value,):
                inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns") and (found := _below_float64(inner)):
                    return found
    return None


def _float64_twin(w: Workload) -> tuple[Workload | None, str | None]:
    """``w`` in float64 (call under ``jax.enable_x64``), or None and why not."""
    from meshkit.adapters import Adapted

    if w.in_float64 is not None:
        return w.in_float64(), None
    if isinstance(w.params, Adapted):
        params = dataclasses.replace(
            w.params, params=_to_float64(w.params.params), state=_to_float64(w.params.state)
        )
    else:
        params = _to_float64(w.params)
    twin = dataclasses.replace(w, params=params, batch=_to_float64(w.batch), state=_to_float64(w.state))
    loss, p, st = _plans_loss(twin)
    try:
        narrow = _below_float64(jax.make_jaxpr(loss)(p, st, twin.batch, _step_key(w.rng, 0)).jaxpr)
    except Exception as e:  # the user's loss, traced with float64 inputs
        return (
            None,
            f"the loss fails in float64 ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
        )
    if narrow is not None:
        return None, f"the loss computes in {narrow} even from float64 parameters"
    return twin, None


def _numpy_float64(w: Workload, steps: int, lr: float) -> Any:
    params = reference_np.to_float64(w.params)
    x, y = (np.asarray(a, np.float64) for a in w.batch)
    state = reference_np.adam_init(params)
    for _ in range(steps):
        _, grads = w.float64(params, x, y)
        params, state = reference_np.adam_step(params, grads, state, lr)
    return params


@dataclass(frozen=True, kw_only=True, slots=True)
class _Reference:
    """Everything one device contributes to a certificate (shared by every plan of one model)."""

    runs: list[_Run]
    """float32, one per batch order that is the same function as the given order (that first)."""
    run64: _Run | None
    """float64, the given order."""
    twin: Workload | None
    """The model in float64 (its arrays NumPy float64: use it under ``jax.enable_x64``)."""
    float64_twin: str | None
    """Why there is no float64 twin, or None."""
    first: list[np.ndarray]
    """The first step a plan's float32 first step is compared with."""
    first_vs: str
    """What ``first`` is: 'float64', 'one device in float32', or why the first step is not checked."""
    noise: float | None
    """One device's own float32 first-step error against ``first`` (None: nothing measures it)."""
    numpy64: Any = None


#: One-device references made in this process (``shared_reference``), by what determines them: every
#: certificate of one model compares against the same runs.
_REFERENCES: dict[tuple, _Reference] = {}


def shared_reference(
    key: tuple, w: Workload, optimizer: optax.GradientTransformation, steps: int, numpy_lr: float | None
) -> _Reference:
    """``_reference(w, ...)``, made once in this process per ``key``, which must name everything that
    determines it: the model (its config and form), its parameters' and data's seeds, the optimizer,
    ``steps`` and ``numpy_lr``. Every plan of one model is certified against the same one-device runs
    (they do not depend on the plan), so each certificate after the first compiles only the plan's steps."""
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(w, optimizer, steps, numpy_lr)
    return _REFERENCES[key]


def _reference(
    w: Workload, optimizer: optax.GradientTransformation, steps: int, numpy_lr: float | None
) -> _Reference:
    probe = _probe(optimizer, w.params)
    one = _OneDevice(w)
    orders = _orders(w.batch, ORDERS)
    runs = []
    for order in orders:
        run = one.run(_reorder(w.batch, order), steps, optimizer)
        if probe is not optimizer:
            run = dataclasses.replace(run, first=one.run(_reorder(w.batch, order), 1, probe).first)
        runs.append(run)
    # an order is the same function as the given one when float64 says so (to TOL_EXACT), and
    # float32 does not move it beyond rounding (per-example randomness does: it follows the rows)
    same = [relative_difference(r.first, runs[0].first) <= TOL_SAME for r in runs]
    with jax.enable_x64(True):
        twin, why = _float64_twin(w)
        run64 = None
        if twin is not None:
            one64 = _OneDevice(twin)
            run64 = one64.run(twin.batch, steps, optimizer)
            firsts = [one64.run(_reorder(twin.batch, o), 1, probe).first for o in orders]
            same = [
                ok and relative_difference(f, firsts[0]) <= TOL_EXACT
                for ok, f in zip(same, firsts, strict=True)
            ]
            run64 = dataclasses.replace(run64, first=firsts[0])
    runs = [r for r, ok in zip(runs, same, strict=True) if ok]
    if run64 is not None and relative_difference(runs[0].first, run64.first) <= TOL_SAME:
        first, vs, errors = run64.first, "float64", [relative_difference(r.first, run64.first) for r in runs]
    else:  # no twin, or one that draws other random numbers: one device in float32, its reorderings as noise
        first, vs, errors = (
            runs[0].first,
            "one device in float32",
            [relative_difference(r.first, runs[0].first) for r in runs[1:]],
        )
    if not errors:
        vs = (
            "not checked: the model draws its random numbers per example and otherwise in float64, so "
            "neither a reordered batch nor float64 measures float32's own rounding"
        )
    numpy64 = _numpy_float64(w, steps, numpy_lr) if numpy_lr is not None and w.float64 is not None else None
    return _Reference(
        runs=runs,
        run64=run64,
        twin=twin,
        float64_twin=why,
        first=first,
        first_vs=vs,
        noise=max(errors) if errors else None,
        numpy64=numpy64,
    )
