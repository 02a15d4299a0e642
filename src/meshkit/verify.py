"""Equivalence certificates: a plan run beside a single-device run and a NumPy float64 run.

``verify(plan, model, ...)`` trains a reference model for K optimizer steps under the plan, the
same K steps on one device (one run per model, steps and rate in a process, shared by every
certificate), twice under the plan (the same compiled program from the same start: bit-for-bit
reproducibility) and, for the linear and MLP models, in NumPy float64 with hand-written gradients
and Adam. It returns a
``Certificate`` with the differences, the plan's communication and memory report, and ``ok``.

Differences are relative to the reference's scale, leaf by leaf: ``max|a - b| / max|b|``.

For the GPT model, float32 Adam is itself far from exact (the single-device float32 run drifts
from float64 by about 1e-2 in 20 steps: gradient elements that nearly cancel carry a large relative
rounding error, and Adam normalises them to +-lr). There the certificate proves equivalence in
float64 (plan vs one device, both float64: the same function up to 1e-12) and checks that the
float32 plan stays within the float32 noise floor (its own distance from float64).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshkit._errors import MeshkitError
from meshkit.devices import host
from meshkit.models import gpt, linear, llama, mlp, reference_np
from meshkit.spec import STAGE, ParallelSpec
from meshkit.train import PlanReport, Trainer

#: Tolerances: float32 distributed vs float32 single device, and float32 vs float64.
TOL_SINGLE = 1e-5
TOL_FLOAT64 = 1e-4
#: The float32 check allows a plan NOISE_FACTOR x one device's own float32 drift from float64: summing
#: micro-batch (or pipeline-stage) gradients in another order is a float32 rounding of the same size
#: (dp with accumulate=2 lands at 1.2x, pp on 8 stages at 1.5x), while float64 proves the function.
NOISE_FACTOR = 2
#: Plan vs one device when both run in float64 (the same function, different summation order).
TOL_EXACT = 1e-10


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """A reference model with its data, ready for any plan."""

    name: str
    loss_fn: Any
    params: Any
    batch: tuple[np.ndarray, np.ndarray]
    logical_axes: Any
    tokens_per_example: int
    float64: Any = None
    """``(params64, x, y) -> (loss, grads)`` in NumPy float64, where the model has one."""
    in_float64: Any = None
    """``() -> Workload`` of the same model in float64 (call under ``jax.enable_x64``), where no
    NumPy reference exists."""
    units: Any = None
    """Logical axes of whole units (``{"heads": 8}``), checked against the model axis."""
    rules: Any = None
    """Tensor-parallel rules (None: the defaults; the Llama's split the vocabulary too)."""


#: Megatron pairs for the reference MLP: the first layer column-parallel, the second row-parallel.
MLP_AXES = [{"w": ("embed", "mlp"), "b": ("mlp",)}, {"w": ("mlp", "embed"), "b": ("embed",)},
            {"w": ("embed", None), "b": (None,)}]  # fmt: skip


@functools.cache  # one per process: its parameters are made by jitted code, and nothing changes them
def workload(name: str, seed: int = 0, *, heads: int = 8, layers: int = 2, stages: bool = False) -> Workload:
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
                        tokens_per_example=1, float64=reference_np.linear_grad)  # fmt: skip
    if name == "mlp":
        x = rng.normal(size=(64, 16)).astype(np.float32)
        y = np.sin(x @ np.ones((16, 8)) / 4).astype(np.float32)
        p = mlp.init(key, [16, 64, 64, 8])
        return Workload(name=name, loss_fn=mlp.loss, params=p, batch=(x, y), logical_axes=MLP_AXES,
                        tokens_per_example=1, float64=reference_np.mlp_grad)  # fmt: skip
    if name in ("gpt", "gpt-scan"):  # gpt-scan: the same model, blocks stacked under lax.scan
        cfg = gpt.GPTConfig(vocab_size=64, seq_len=16, layers=layers, width=32, heads=heads,
                            scan_layers=stages or name == "gpt-scan")  # fmt: skip
        make_loss = gpt.stages if stages else gpt.make_loss
        tokens = rng.integers(0, cfg.vocab_size, size=(16, cfg.seq_len + 1)).astype(np.int32)
        p = gpt.init(key, cfg)
        batch = (tokens[:, :-1], tokens[:, 1:])

        def in_float64() -> Workload:
            cfg64 = dataclasses.replace(cfg, dtype="float64")
            p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
            return Workload(name=name, loss_fn=make_loss(cfg64), params=p64, batch=batch,
                            logical_axes=gpt.logical_axes(p64), tokens_per_example=cfg.seq_len,
                            units={"heads": cfg.heads})  # fmt: skip

        return Workload(name=name, loss_fn=make_loss(cfg), params=p, batch=batch, logical_axes=gpt.logical_axes(p),
                        tokens_per_example=cfg.seq_len, in_float64=in_float64, units={"heads": cfg.heads})  # fmt: skip
    if name == "llama":  # grouped-query attention (half as many kv heads), the vocabulary split on model
        return _llama(rng, key, heads=heads, layers=layers, stages=stages)
    raise MeshkitError(f"unknown model {name!r}: choose linear, mlp, gpt, gpt-scan or llama")


def _llama(rng: np.random.Generator, key: jax.Array, *, heads: int, layers: int, stages: bool) -> Workload:
    """The Llama of width 32 with ``heads`` query heads and half as many key/value heads, in float32
    and (``in_float64``) float64; as ``Stages`` (scanned) for pipeline plans."""
    from meshkit.plans.placement import DEFAULT_TP_RULES, VOCAB_TP_RULES

    cfg = llama.LlamaConfig(vocab_size=64, seq_len=16, layers=layers, width=32, heads=heads,
                            kv_heads=max(heads // 2, 1), ffn=64, scan_layers=stages)  # fmt: skip
    make_loss = llama.stages if stages else llama.make_loss
    tokens = rng.integers(0, cfg.vocab_size, size=(16, cfg.seq_len + 1)).astype(np.int32)
    p = llama.init(key, cfg)
    batch = (tokens[:, :-1], tokens[:, 1:])
    rules = DEFAULT_TP_RULES if stages else VOCAB_TP_RULES  # pipelines keep the vocabulary whole on model

    def one(dtype: str, params: Any) -> Workload:
        c = dataclasses.replace(cfg, dtype=dtype)
        return Workload(name="llama", loss_fn=make_loss(c), params=params, batch=batch,
                        logical_axes=llama.logical_axes(params), tokens_per_example=cfg.seq_len,
                        units=llama.units(cfg), rules=rules,
                        in_float64=None if dtype == "float64" else lambda: one("float64", _to64(params)))  # fmt: skip

    return one("float32", p)


def _to64(params: Any) -> Any:
    return jax.tree.map(lambda a: np.asarray(a, np.float64), params)


def relative_difference(a: Any, b: Any) -> float:
    """Largest leaf-wise ``max|a - b| / max|b|``."""
    out = 0.0
    for x, y in zip(jax.tree.leaves(host(a)), jax.tree.leaves(host(b)), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = float(np.max(np.abs(y))) or 1.0
        out = max(out, float(np.max(np.abs(x - y))) / scale)
    return out


def bitwise_equal(a: Any, b: Any) -> bool:
    pairs = zip(jax.tree.leaves(host(a)), jax.tree.leaves(host(b)), strict=True)
    return all(np.array_equal(x, y) for x, y in pairs)


#: Single-device reference runs already made in this process, by workload, dtype, steps and rate:
#: every certificate of one model compares against the same run (a GPT step compiles in seconds).
_REFERENCES: dict[tuple, Any] = {}


def _single_device(w: Workload, optimizer, steps: int, key: tuple | None = None) -> Any:
    """``steps`` optimizer steps of ``w`` on one device, memoized under ``key`` when given."""
    if key is not None and key in _REFERENCES:
        return _REFERENCES[key]
    dev = jax.local_devices()[0]  # every process runs the reference on a device of its own
    params = jax.device_put(w.params, dev)
    state = optimizer.init(params)
    batch = jax.device_put(w.batch, dev)

    @jax.jit  # the batch an argument, not a constant baked into the program
    def step(p, s, batch):
        g = jax.grad(w.loss_fn)(p, batch)
        u, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, u), s

    for _ in range(steps):
        params, state = step(params, state, batch)
    if key is not None:
        _REFERENCES[key] = params
    return params


def _layers(spec: ParallelSpec, model: str) -> dict:
    """A pipeline plan verifies the GPT as ``Stages`` with one layer per virtual stage (at least 2)."""
    if not spec.plan_info.pipeline:
        return {}
    if model not in ("gpt", "gpt-scan", "llama"):
        raise MeshkitError(f"plan {spec.plan} verifies a model of stacked blocks: use --model gpt or llama")
    p = spec.degrees(jax.device_count())[STAGE]
    return {"layers": max(2, p * spec.virtual_stages), "stages": True}


def _float64(w: Workload, steps: int, lr: float) -> Any:
    params = reference_np.to_float64(w.params)
    x, y = (np.asarray(a, np.float64) for a in w.batch)
    state = reference_np.adam_init(params)
    for _ in range(steps):
        _, grads = w.float64(params, x, y)
        params, state = reference_np.adam_step(params, grads, state, lr)
    return params


@dataclass(frozen=True, kw_only=True, slots=True)
class Certificate:
    """What ``meshkit verify`` proves about one plan on one model."""

    plan: str
    model: str
    steps: int
    accumulate: int
    vs_single_device: float
    bitwise_vs_single_device: bool
    vs_float64: float | None
    """float32 plan vs NumPy float64 (linear, MLP)."""
    exact_vs_single_device: float | None
    """Plan vs one device, both in float64 (GPT)."""
    float32_noise: float | None
    """One device float32 vs float64: how far float32 itself drifts (GPT)."""
    reproducible: bool
    final_loss: float
    report: PlanReport

    @property
    def checks(self) -> dict[str, bool]:
        tol = TOL_SINGLE if self.float32_noise is None else max(TOL_SINGLE, NOISE_FACTOR * self.float32_noise)
        out = {
            "matches single device": self.vs_single_device <= tol,
            "bitwise reproducible": self.reproducible,
            "communication = model": all(r.ok for r in self.report.communication),
            "memory = formula": all(r.ok for r in self.report.memory),
        }
        if self.vs_float64 is not None:
            out["matches float64"] = self.vs_float64 <= TOL_FLOAT64
        if self.exact_vs_single_device is not None:
            out["matches single device in float64"] = self.exact_vs_single_device <= TOL_EXACT
        if self.report.pipeline is not None:
            out["executed schedule = model (bubble)"] = self.report.pipeline.ok
        return out

    @property
    def ok(self) -> bool:
        return all(self.checks.values())

    def to_json(self) -> dict:
        return {
            "plan": self.plan,
            "model": self.model,
            "steps": self.steps,
            "accumulate": self.accumulate,
            "vs_single_device": self.vs_single_device,
            "bitwise_vs_single_device": self.bitwise_vs_single_device,
            "vs_float64": self.vs_float64,
            "exact_vs_single_device": self.exact_vs_single_device,
            "float32_noise": self.float32_noise,
            "reproducible": self.reproducible,
            "final_loss": self.final_loss,
            "checks": self.checks,
            "ok": self.ok,
            "report": self.report.to_json(),
        }


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
) -> Certificate:
    """Train ``model`` for ``steps`` Adam steps under ``plan`` and certify the result.

    Pipeline plans take ``microbatches``, ``pipeline_schedule`` and ``virtual_stages``, and verify the GPT
    as ``Stages`` with one layer per virtual stage (so the layers divide over the stages)."""
    if steps < 1:
        raise MeshkitError(f"steps must be at least 1, got {steps}")
    spec = ParallelSpec(plan=plan, mesh=mesh, accumulate=accumulate, remat=remat, microbatches=microbatches,
                        pipeline_schedule=pipeline_schedule, virtual_stages=virtual_stages)  # fmt: skip
    shape = _layers(spec, model)
    w = workload(model, seed, **shape)
    optimizer = optax.adam(lr)

    def run(w: Workload, compiled: dict | None = None) -> tuple[Trainer, float]:
        t = Trainer(w.loss_fn, w.params, optimizer, spec=spec, logical_axes=w.logical_axes,
                    tokens_per_example=w.tokens_per_example, units=w.units, rules=w.rules)  # fmt: skip
        if compiled is not None:
            t._compiled = compiled
        loss = jnp.nan
        for _ in range(steps):
            loss = t.step(w.batch)["loss"]
        return t, float(loss)

    first, loss = run(w)
    # Reproducibility: the same compiled program run again from the same start, bit for bit.
    second, _ = run(w, compiled=first._compiled)
    ref = (model, seed, tuple(sorted(shape.items())), steps, lr)
    single = _single_device(w, optimizer, steps, key=(*ref, "float32"))
    f64 = _float64(w, steps, lr) if w.float64 is not None else None
    exact = noise = None
    if w.in_float64 is not None:
        with jax.enable_x64(True):
            w64 = w.in_float64()
            single64 = _single_device(w64, optimizer, steps, key=(*ref, "float64"))
            exact = relative_difference(run(w64)[0].params, single64)
            noise = relative_difference(single, single64)
    return Certificate(
        plan=plan,
        model=model,
        steps=steps,
        accumulate=accumulate,
        vs_single_device=relative_difference(first.params, single),
        bitwise_vs_single_device=bitwise_equal(first.params, single),
        vs_float64=None if f64 is None else relative_difference(first.params, f64),
        exact_vs_single_device=exact,
        float32_noise=noise,
        reproducible=bitwise_equal(first.params, second.params),
        final_loss=loss,
        report=first.report(w.batch),
    )
