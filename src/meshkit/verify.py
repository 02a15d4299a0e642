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

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshkit._errors import MeshkitError
from meshkit.devices import host
from meshkit.models import gpt, linear, llama, mlp, reference_np
from meshkit.plans.placement import vocab_rules
from meshkit.spec import DATA, STAGE, ParallelSpec
from meshkit.train import PlanReport, Trainer

#: Plan vs one device when both run in float64 (the same function, its sums in another order).
TOL_EXACT = 1e-10
#: float32 plan vs NumPy float64 after K steps (linear, MLP).
TOL_FLOAT64 = 1e-4
#: The float32 first step's bound over the largest of ``ORDERS`` one-device errors (module docstring).
TAIL = 2.0
#: Batch orders one device runs in float32 (the given one first) to measure its own rounding.
ORDERS = 4
#: Two float32 first steps this close are the same function, rounding apart: the largest float32
#: first-step error measured on any model here is 1.6e-6, while another random draw (dropout masks
#: that follow the rows, or float64's own random numbers) moves it by 1e-2 and more.
TOL_SAME = 1e-4


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """A model with its data, ready for any plan: what ``Trainer`` takes, and the references."""

    name: str
    loss_fn: Any
    params: Any
    """A parameter pytree, or a ``meshkit.Adapted`` model (its state and logical axes come with it)."""
    batch: Any
    logical_axes: Any = None
    tokens_per_example: int = 1
    units: Any = None
    """Logical axes of whole units (``{"heads": 8}``), checked against the model axis."""
    rules: Any = None
    """Tensor-parallel rules (None: the defaults; the Llama's split the vocabulary too)."""
    state: Any = None
    rng: Any = None
    has_aux: bool = False
    float64: Any = None
    """``(params64, x, y) -> (loss, grads)`` in NumPy float64, where the model has one."""
    in_float64: Any = None
    """``() -> Workload``: the model in float64 (called under ``jax.enable_x64``), where casting the
    parameters is not enough (a model that casts to its own dtype); None: cast them."""


#: Megatron pairs for the reference MLP: the first layer column-parallel, the second row-parallel.
MLP_AXES = [{"w": ("embed", "mlp"), "b": ("mlp",)}, {"w": ("mlp", "embed"), "b": ("embed",)},
            {"w": ("embed", None), "b": (None,)}]  # fmt: skip


@functools.cache  # one per process: its parameters are made by jitted code, and nothing changes them
def workload(
    name: str, seed: int = 0, *, heads: int = 8, layers: int = 2, stages: bool = False, experts: int = 0
) -> Workload:
    """The reference workloads: 'linear', 'mlp' (the chapter's [16, 64, 64, 8]) and 'gpt' (width 32,
    ``heads`` heads, ``layers`` blocks; with ``stages`` the scanned GPT as ``meshkit.Stages``, the form
    pipeline plans take)."""
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    if name == "linear":
        x = rng.normal(size=(64, 16)).astype(np.float32)
        y = (x @ rng.normal(size=(16, 4)) + 0.1 * rng.normal(size=(64, 4))).astype(np.float32)
        p = linear.init(key, 16, 4)
        return Workload(name=name, loss_fn=linear.loss, params=p, batch=(x, y), logical_axes=linear.logical_axes(p),
                        float64=reference_np.linear_grad)  # fmt: skip
    if name == "mlp":
        x = rng.normal(size=(64, 16)).astype(np.float32)
        y = np.sin(x @ np.ones((16, 8)) / 4).astype(np.float32)
        p = mlp.init(key, [16, 64, 64, 8])
        return Workload(name=name, loss_fn=mlp.loss, params=p, batch=(x, y), logical_axes=MLP_AXES,
                        float64=reference_np.mlp_grad)  # fmt: skip
    if name in ("gpt", "gpt-scan"):  # gpt-scan: the same model, blocks stacked under lax.scan
        cfg = gpt.GPTConfig(vocab_size=64, seq_len=16, layers=layers, width=32, heads=heads,
                            scan_layers=stages or name == "gpt-scan", experts=experts)  # fmt: skip
        make_loss = gpt.stages if stages else functools.partial(gpt.make_loss, with_aux=bool(experts))
        tokens = rng.integers(0, cfg.vocab_size, size=(16, cfg.seq_len + 1)).astype(np.int32)
        p = gpt.init(key, cfg)
        batch = (tokens[:, :-1], tokens[:, 1:])

        def in_float64() -> Workload:  # the GPT casts to its config's dtype: a float64 config
            cfg64 = dataclasses.replace(cfg, dtype="float64")
            return dataclasses.replace(w, loss_fn=make_loss(cfg64), params=_to_float64(p), in_float64=None)

        w = Workload(name=name, loss_fn=make_loss(cfg), params=p, batch=batch, logical_axes=gpt.logical_axes(p),
                     tokens_per_example=cfg.seq_len, in_float64=in_float64, units={"heads": cfg.heads},
                     rules=vocab_rules(stages), has_aux=bool(experts))  # fmt: skip
        return w
    if name == "llama":  # grouped-query attention (half as many kv heads), the vocabulary split on model
        return _llama(rng, key, heads=heads, layers=layers, stages=stages, experts=experts)
    raise MeshkitError(
        f"unknown model {name!r}: choose linear, mlp, gpt, gpt-scan or llama, or give module:function"
    )


def _llama(
    rng: np.random.Generator, key: jax.Array, *, heads: int, layers: int, stages: bool, experts: int = 0
) -> Workload:
    """The Llama of width 32 with ``heads`` query heads and half as many key/value heads, in float32
    and (``in_float64``) float64; as ``Stages`` (scanned) for pipeline plans."""
    cfg = llama.LlamaConfig(vocab_size=64, seq_len=16, layers=layers, width=32, heads=heads,
                            kv_heads=max(heads // 2, 1), ffn=64, scan_layers=stages, experts=experts)  # fmt: skip
    make_loss = llama.stages if stages else functools.partial(llama.make_loss, with_aux=bool(experts))
    tokens = rng.integers(0, cfg.vocab_size, size=(16, cfg.seq_len + 1)).astype(np.int32)
    p = llama.init(key, cfg)
    batch = (tokens[:, :-1], tokens[:, 1:])

    def one(dtype: str, params: Any) -> Workload:
        c = dataclasses.replace(cfg, dtype=dtype)
        return Workload(name="llama", loss_fn=make_loss(c), params=params, batch=batch,
                        logical_axes=llama.logical_axes(params), tokens_per_example=cfg.seq_len,
                        units=llama.units(cfg), rules=vocab_rules(stages), has_aux=bool(experts),
                        in_float64=None if dtype == "float64" else lambda: one("float64", _to_float64(params)))  # fmt: skip

    return one("float32", p)


def relative_difference(a: Any, b: Any) -> float:
    """``max|a - b| / max|b|`` over all floating leaves of the two trees together, leaves paired
    by their path (``['Dense_0']['kernel']``); any other leaf (an int counter, a key) must be
    equal, or the difference is infinite.

    One scale for the whole tree, not one per leaf: a leaf whose exact value is 0 holds float
    noise (the key bias of an attention layer: softmax ignores it, so its gradient is rounding),
    and dividing that noise by its own size made trees equal to 6e-8 differ by 0.9.
    """
    pairs = _paired_leaves(host(jax.tree.map(_key_data, a)), host(jax.tree.map(_key_data, b)))
    diff, scale = 0.0, 0.0
    for x, y in pairs:
        if not (jnp.issubdtype(x.dtype, jnp.inexact) and jnp.issubdtype(y.dtype, jnp.inexact)):
            if not np.array_equal(x, y):
                return math.inf
            continue
        x, y = x.astype(np.float64), y.astype(np.float64)
        if x.size:
            diff, scale = max(diff, float(np.max(np.abs(x - y)))), max(scale, float(np.max(np.abs(y))))
    return diff / (scale or 1.0)


def _paired_leaves(a: Any, b: Any) -> list[tuple[Any, Any]]:
    """The leaves of ``a`` and ``b`` paired by path; a path in one tree only is an error naming it."""
    flat_a = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(a)[0]}
    flat_b = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(b)[0]}
    if flat_a.keys() != flat_b.keys():
        only = sorted(flat_a.keys() ^ flat_b.keys())
        raise ValueError(f"relative_difference: the trees differ in structure: {only[:3]} in one tree only")
    return [(v, flat_b[k]) for k, v in flat_a.items()]


def _key_data(a: Any) -> Any:
    """A typed PRNG key as its key data (NumPy cannot hold it); any other leaf as it is."""
    if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(a)
    return a


def bitwise_equal(a: Any, b: Any) -> bool:
    pairs = zip(jax.tree.leaves(host(a)), jax.tree.leaves(host(b)), strict=True)
    return all(np.array_equal(x, y) for x, y in pairs)


# -- the pieces every certificate runs ---------------------------------------------------------------


def _floating(a: Any) -> bool:
    return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)


def _to_float64(tree: Any) -> Any:
    """``tree`` as its float64 twin holds it (call under ``jax.enable_x64``): floating leaves as
    NumPy float64, and weakly typed scalars (an Equinox BatchNorm's counter) as the weak scalars
    float64 mode makes of the same number (int64, float64), so that the model's own updates of
    them keep their type; everything else as it is."""

    def one(a: Any) -> Any:
        if getattr(a, "weak_type", False) and np.ndim(a) == 0:
            return jnp.asarray(a.item())
        return np.asarray(a, np.float64) if _floating(a) else a

    return jax.tree.map(one, tree)


def _float_leaves(tree: Any) -> list[np.ndarray]:
    """The floating array leaves of ``tree`` (an optimizer state: its moments, not its step count)."""
    return [a for a in jax.tree.leaves(host(tree)) if _floating(a) and np.ndim(a)]


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


#: One-device references made in this process, by model, seed, shape, steps and rate: every
#: certificate of a built-in model compares against the same runs.
_REFERENCES: dict[tuple, _Reference] = {}


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
    return _Reference(runs=runs, run64=run64, twin=twin, float64_twin=why, first=first, first_vs=vs,
                      noise=max(errors) if errors else None, numpy64=numpy64)  # fmt: skip


# -- the certificate ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Certificate:
    """What ``meshkit verify`` proves about one plan on one model."""

    plan: str
    model: str
    steps: int
    accumulate: int
    exact_vs_single_device: float | None
    """Plan vs one device after K steps, both in float64 (None without a float64 twin)."""
    state_exact_vs_single_device: float | None = None
    """The same for the model's state (mutated collections: batch statistics); None without state
    or without a float64 twin."""
    first_step: float
    """The plan's float32 first step (its optimizer state after one step) vs ``first_step_vs``."""
    first_step_vs: str
    """'float64', 'one device in float32' (no float64 twin, or one drawing other random numbers),
    or why the first step is not checked."""
    first_step_noise: float | None
    """One device's own float32 first-step error: the largest over the batch orders."""
    first_step_bound: float | None
    """``TAIL * sqrt(1 + (partial_sums - 1) / log2(examples)) * first_step_noise``."""
    partial_sums: int
    """Partial sums the plan splits a gradient into: devices x micro-batches."""
    examples: int
    orders: int
    """Batch orders one device ran that are the same function as the given one."""
    vs_single_device: float
    """float32 plan vs one device after K steps (informational: see the module docstring)."""
    bitwise_vs_single_device: bool
    float32_noise: float | None
    """One device after K steps, float32 vs float64 (informational)."""
    float32_spread: float | None
    """One device after K steps in float32, reordered batches vs the given order: how far a correct
    reordering alone moves K float32 steps (informational)."""
    vs_float64: float | None
    """float32 plan after K steps vs NumPy float64 (linear, MLP)."""
    float64_twin: str | None
    """Why the model has no float64 twin, or None when it has one."""
    reproducible: bool
    final_loss: float
    report: PlanReport
    bitwise_across_meshes: dict[str, bool] | None = None
    """Deterministic mode: each mesh of ``comparison_meshes`` (``data=N`` on the first N devices, of each
    process's own under ``meshkit launch``) -> whether its K steps have the plan's bits, and on several
    processes ``2 processes x 4`` -> whether every process gathered the same bits of the plan's run
    (``bitwise_meshes``); None otherwise."""

    @property
    def checks(self) -> dict[str, bool]:
        out = {}
        if self.exact_vs_single_device is not None:
            out["float64: plan = one device"] = self.exact_vs_single_device <= TOL_EXACT
        if self.state_exact_vs_single_device is not None:
            out["float64: state = one device"] = self.state_exact_vs_single_device <= TOL_EXACT
        if self.first_step_bound is not None:
            out["float32: first step within rounding"] = self.first_step <= self.first_step_bound
        if self.vs_float64 is not None:
            out["float32: matches NumPy float64"] = self.vs_float64 <= TOL_FLOAT64
        out["bitwise reproducible"] = self.reproducible
        if self.bitwise_across_meshes is not None:
            out["bitwise across meshes"] = all(self.bitwise_across_meshes.values())
        out["communication = model"] = all(r.ok for r in self.report.communication)
        out["memory = formula"] = all(r.ok for r in self.report.memory)
        if self.report.pipeline is not None:
            out["executed schedule = model (bubble)"] = self.report.pipeline.ok
        return out

    @property
    def ok(self) -> bool:
        return all(self.checks.values())

    def to_json(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "report"}
        return {**fields, "checks": self.checks, "ok": self.ok, "report": self.report.to_json()}


def _bound(noise: float | None, partial_sums: int, examples: int) -> float | None:
    if noise is None:
        return None
    return TAIL * math.sqrt(1 + (partial_sums - 1) / max(1.0, math.log2(examples))) * noise


def _certify(w: Workload, optimizer: optax.GradientTransformation, spec: ParallelSpec, steps: int,
             ref: _Reference) -> Certificate:  # fmt: skip
    """Train ``w`` under ``spec`` (float32, again from the same start, float64) beside ``ref``."""
    probe = _probe(optimizer, w.params)

    def trainer(w: Workload, opt: optax.GradientTransformation = optimizer, mesh: Any = None) -> Trainer:
        layout = {"spec": spec} if mesh is None else {"plan": spec.plan, "mesh": mesh, "remat": spec.remat,
                  "compute_dtype": spec.compute_dtype, "deterministic": spec.deterministic,
                  "microbatches": spec.microbatches, "pipeline_schedule": spec.pipeline_schedule,
                  "virtual_stages": spec.virtual_stages}  # fmt: skip
        return Trainer(w.loss_fn, w.params, opt, **layout, logical_axes=w.logical_axes, rules=w.rules,
                       units=w.units, state=w.state, rng=w.rng, has_aux=w.has_aux,
                       tokens_per_example=w.tokens_per_example)  # fmt: skip

    def train(t: Trainer, steps: int) -> tuple[list[np.ndarray], float]:
        first, loss = [], jnp.nan
        for i in range(steps):
            loss = t.step(w.batch)["loss"]
            if i == 0:
                first = _float_leaves(t.opt_state)
        return first, float(loss)

    first32 = trainer(w)
    first, loss = train(first32, steps)
    if probe is not optimizer:
        first, _ = train(trainer(w, probe), 1)
    again = trainer(w)  # the same compiled program from the same start
    again._compiled = first32._compiled
    train(again, steps)
    exact = exact_state = None
    if ref.twin is not None:
        with jax.enable_x64(True):
            t64 = trainer(ref.twin)
            for _ in range(steps):
                t64.step(ref.twin.batch)
            exact = relative_difference(t64.params, ref.run64.params)
            if _float_leaves(ref.run64.state):
                exact_state = relative_difference(_float_leaves(t64.state), _float_leaves(ref.run64.state))
    single, *others = ref.runs
    partial_sums = spec.deterministic or first32.num_devices * first32.assembled.microbatches
    across = None
    if spec.deterministic is not None:

        def on(mesh: Any) -> Any:
            t = trainer(w, mesh=mesh)
            train(t, steps)
            return t.params

        across = bitwise_meshes(first32.params, on, spec)
    examples = int(jax.tree.leaves(w.batch)[0].shape[0])
    spread = [relative_difference(r.params, single.params) for r in others]
    return Certificate(
        plan=spec.plan,
        model=w.name,
        steps=steps,
        accumulate=spec.accumulate,
        exact_vs_single_device=exact,
        state_exact_vs_single_device=exact_state,
        first_step=relative_difference(first, ref.first),
        first_step_vs=ref.first_vs,
        first_step_noise=ref.noise,
        first_step_bound=_bound(ref.noise, partial_sums, examples),
        partial_sums=partial_sums,
        examples=examples,
        orders=len(ref.runs),
        vs_single_device=relative_difference(first32.params, single.params),
        bitwise_vs_single_device=bitwise_equal(first32.params, single.params),
        float32_noise=None if ref.run64 is None else relative_difference(single.params, ref.run64.params),
        float32_spread=max(spread) if spread else None,
        vs_float64=None if ref.numpy64 is None else relative_difference(first32.params, ref.numpy64),
        float64_twin=ref.float64_twin,
        reproducible=bitwise_equal(first32.params, again.params),
        final_loss=loss,
        report=first32.report(w.batch),
        bitwise_across_meshes=across,
    )


def comparison_meshes(spec: ParallelSpec, devices: Sequence[Any]) -> dict[str, Any]:
    """The meshes deterministic mode compares for ``spec``, on the first of ``devices``, by label: a data
    axis of N = 1, 2, 4... devices, N dividing the devices and at most the micro-shards. A plan with a stage
    axis holds its stage degree S and varies the data axis: ``(stage, data)`` meshes of S x N devices (a
    tied embedding keeps its bits across data axes, not between one stage and several:
    docs/deterministic.md)."""
    from jax.sharding import Mesh

    stages = spec.degrees(jax.device_count())[STAGE] if spec.plan_info.pipeline else None
    per = stages or 1
    out, n = {}, 1
    while n <= spec.deterministic and n * per <= len(devices):
        if len(devices) % (n * per) == 0:
            chosen = np.array(devices[: n * per])
            if stages is None:
                out[f"{DATA}={n}"] = Mesh(chosen, (DATA,))
            else:
                out[f"{STAGE}={stages},{DATA}={n}"] = Mesh(chosen.reshape(stages, n), (STAGE, DATA))
        n *= 2
    return out


def check_meshes(spec: ParallelSpec) -> None:
    """Refuse, in one line and before any training, a deterministic spec whose 'bitwise across meshes'
    check has no mesh to run on: on several processes each compares meshes of its own devices, so those
    must be as many in every process and hold the plan's stage degree."""
    if spec.deterministic is None:
        return
    processes, local = jax.process_count(), jax.local_device_count()
    if processes > 1 and jax.device_count() != processes * local:
        raise MeshkitError(
            f"meshkit verify --deterministic on {processes} processes compares meshes of each process's own "
            f"devices: give every process as many (--devices-per-process), not {jax.device_count()} over "
            f"{processes}"
        )
    if not comparison_meshes(spec, jax.local_devices() if processes > 1 else jax.devices()):
        stages = spec.degrees(jax.device_count())[STAGE]
        raise MeshkitError(
            f"meshkit verify --deterministic compares meshes of one process's {local} devices, too few for "
            f"plan {spec.plan}'s {stages} stages: give each process at least {stages} (--devices-per-process)"
        )


def bitwise_meshes(params: Any, train_on: Callable[[Any], Any], spec: ParallelSpec) -> dict[str, bool]:
    """Deterministic mode: ``train_on(mesh)`` (the parameters after the same K steps) on each of
    ``comparison_meshes``, compared bit for bit with ``params`` (the plan's run).

    On one process the meshes are of the first devices. On several (``meshkit launch``) the plan ran on
    every process's devices; each process trains on meshes of its own devices (no collective across
    processes) and compares with the plan's parameters gathered to it, and the processes exchange
    digests of those bits, so that every process returns the same verdict: ``data=N`` holds where every
    process's run equals the plan's bits, and the row of the plan's own mesh (``2 processes x 4``) where
    every process gathered the same bits of it."""
    if jax.process_count() == 1:
        return {
            label: bitwise_equal(train_on(mesh), params)
            for label, mesh in comparison_meshes(spec, jax.devices()).items()
        }
    from jax.experimental import multihost_utils

    meshes = comparison_meshes(spec, jax.local_devices())
    mine = np.stack([_digest(params)] + [_digest(train_on(mesh)) for mesh in meshes.values()])
    every = np.asarray(multihost_utils.process_allgather(mine))  # (processes, 1 + meshes, digest)
    out = {label: bool((every[:, i + 1] == every[0, 0]).all()) for i, label in enumerate(meshes)}
    out[f"{jax.process_count()} processes x {jax.local_device_count()}"] = bool(
        (every[:, 0] == every[0, 0]).all()
    )
    return out


def _digest(tree: Any) -> np.ndarray:
    """SHA-256 of ``tree``'s bits on this host (shards of other processes gathered), as 32 bytes."""
    h = hashlib.sha256()
    for a in jax.tree.leaves(host(tree)):
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return np.frombuffer(h.digest(), np.uint8)


def _check_steps(steps: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise MeshkitError(f"steps must be a whole number of at least 1, got {steps!r}")


def _layers(spec: ParallelSpec, model: str) -> dict:
    """A pipeline plan verifies the GPT as ``Stages`` with one layer per virtual stage (at least 2);
    an expert plan the GPT or the Llama with a mixture of 8 experts per layer."""
    if spec.plan_info.expert:
        if model not in ("gpt", "gpt-scan", "llama"):
            raise MeshkitError(f"plan {spec.plan} verifies a mixture of experts: use --model gpt or llama")
        return {"experts": 8}
    if not spec.plan_info.pipeline:
        return {}
    if model not in ("gpt", "gpt-scan", "llama"):
        raise MeshkitError(f"plan {spec.plan} verifies a model of stacked blocks: use --model gpt or llama")
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
) -> Certificate:
    """Train the built-in ``model`` for ``steps`` Adam steps under ``plan`` and certify the result.

    Pipeline plans take ``microbatches``, ``pipeline_schedule`` and ``virtual_stages``, and verify the GPT
    as ``Stages`` with one layer per virtual stage (so the layers divide over the stages)."""
    _check_steps(steps)
    spec = ParallelSpec(plan=plan, mesh=mesh, accumulate=accumulate, remat=remat, microbatches=microbatches,
                        pipeline_schedule=pipeline_schedule, virtual_stages=virtual_stages,
                        context_attention=context_attention, deterministic=deterministic or None)  # fmt: skip
    check_meshes(spec)
    shape = _layers(spec, model)
    w = workload(model, seed, **shape)
    key = (model, seed, tuple(sorted(shape.items())), steps, lr)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(w, optax.adam(lr), steps, numpy_lr=lr)
    return _certify(w, optax.adam(lr), spec, steps, _REFERENCES[key])


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
    spec = ParallelSpec.of(spec, plan=plan, mesh=mesh, accumulate=accumulate, remat=remat, microbatches=microbatches,
                 pipeline_schedule=pipeline_schedule, virtual_stages=virtual_stages,
                 context_attention=context_attention, deterministic=deterministic or None)  # fmt: skip
    _check_steps(steps)
    check_meshes(spec)
    w = Workload(name=name, loss_fn=loss_fn, params=params, batch=batch, logical_axes=logical_axes, rules=rules,
                 units=units, state=state, rng=rng, has_aux=has_aux, tokens_per_example=tokens_per_example)  # fmt: skip
    return _certify(w, optimizer, spec, steps, _reference(w, optimizer, steps, numpy_lr=None))
