"""Step time of meshkit's ``Trainer.step`` under each plan, beside hand-written steps and pmap.

For every plan (dp, zero1, zero2, zero3, tp, dp+tp, fsdp+tp) on the GPT decoder over 8 simulated
CPU devices, these variants of the same training step run side by side in one process:

- ``meshkit``: ``Trainer(loss, params, optax.adamw(...), plan=...).step(batch)``: shard_map manual
  over the data axis with the plan's collectives written out, optax in the global view, and the
  gradient norm it always returns as a metric;
- ``hand``: the step a user writes without meshkit: ``jax.jit`` of ``jax.value_and_grad`` + the same
  optax update; parameters, optimizer state and batch placed with the same PartitionSpecs as the
  Trainer's layout (``trainer.placement`` / ``trainer.shardings``), ``out_shardings`` pinned to that
  layout, the same donation, and for ZeRO stages ``with_sharding_constraint`` of the gradients to
  the sharded spec, so XLA's partitioner inserts every collective itself; it returns the loss only.
  zero3 and fsdp+tp (with ``:remat`` and ``:scan``) run instead beside a hand-written step with
  the same memory behaviour: per-layer gathers inside the block and per-layer gradient
  reduce-scatters, under the same remat policy (``fsdp_hand_variant``: ``shard_map`` over
  ``data``; ``fsdp2d_manual_variant``: ``shard_map`` over ``data`` and ``model``, Megatron by hand);
- ``alt``, a second reference where one exists: for dp the legacy ``jax.pmap`` step (parameters
  replicated with a leading device axis, ``lax.pmean`` of the gradients); for zero3 and fsdp+tp
  the ``jax.jit`` step a user writes with sharding constraints alone (``fsdp2d_jit_variant``: the
  same per-layer gathers, the same peak), whose partitioner all-reduces each layer's gradient and
  slices it (2x the reduce-scatter's ring bytes) and combines those all-reduces into a few;
- ``hand2`` (with ``--control``): a second, separately compiled hand-written step. ``hand2/hand``
  should be 1.00; how far it strays is the noise floor of the run;
- ``bucket`` (with ``--bucket``, zero3 and fsdp+tp): the hand-written step with each layer's
  gradients reduce-scattered in one collective (``gather_data_one_scatter``), as XLA's GPU
  reduce-scatter combiner would merge them; XLA:CPU has no such pass. It isolates what the jit
  step gains from its combined all-reduces (printed with its peak, which pays for the bucket's copy
  where a layer's backward pass decides it).

Before timing, every variant runs the same steps from the same initial parameters on the same
batches and the benchmark checks that the losses and then the parameters agree with meshkit's
(``allclose``; parameters to a small fraction of one Adam step, since Adam rescales gradient
rounding noise); a mismatch prints ``MISMATCH`` and makes the exit status 1.

Run (every plan with ``--control``: 335 s on 2 quiet cores)::

    .venv/bin/python benchmarks/bench_plans.py [--steps 4] [--rounds 10] [--plans dp,zero1,tp]
                                               [--control] [--bucket] [--json results.json]

Timing: after warm-up the variants of a plan take turns round-robin, ``--rounds`` rounds with the
order rotated every round; in each turn a variant runs one untimed step, then ``--steps`` timed
steps, each ended by ``block_until_ready`` of the new parameters, optimizer state and loss. Each
step's wall-clock time and the process's CPU time are recorded; the table reports medians.

The ``acc`` columns are the bytes each compiled step accesses per device (``cost_analysis()``):
deterministic, where the timings are not.

Reading the table: ``mk/hand`` is meshkit's median wall-clock step time over the hand-written
step's; at or below 1.05 meshkit costs no more than writing the step by hand (the target). ``cpu``
is the same ratio of CPU time per step (all threads of the process): the machine is shared, and
other tenants' load stretches wall-clock time but not CPU time, so when the two ratios disagree,
trust ``cpu`` (and the ``--control`` A/A ratio tells how noisy the run was). ``mk/alt`` compares
against legacy pmap (dp) and the jit step with per-layer constraints (zero3, fsdp+tp). The ``coll`` and ``MB`` columns are what
``meshkit.analysis.communication`` reads from each compiled program: collective executions per
step and the bytes they move (``S`` of the ring formulas, summed); the per-op breakdown follows
the table. On simulated CPU devices a collective is a rendezvous of 8 device threads that share
2 cores: each one costs a synchronisation (the slowest thread) more than its bytes, so the
*number* of collectives matters more here than on a GPU, where XLA also combines reduce-scatters
and all-gathers (XLA:CPU combines only all-reduces).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshkit

meshkit.simulate_devices(8)

from meshkit.analysis import CommLedger, communication  # noqa: E402
from meshkit.models import gpt  # noqa: E402
from meshkit.train.trainer import Trainer  # noqa: E402

ALL_PLANS = (
    "dp", "zero1", "zero2", "zero3", "tp", "dp+tp", "fsdp+tp",
    "zero3:layer", "zero3:dots", "zero3:regather", "zero3:none:scan", "zero3:layer:scan",
    "fsdp+tp:layer", "fsdp+tp:layer:scan",
)  # fmt: skip
"""``plan[:remat[:scan]]``: zero3 and fsdp+tp gather per layer (inside each block, rematerialized
under the policy) in the GPT's Python-loop and, with ``:scan``, scanned forms; each runs beside a
hand-written step with the same memory behaviour (``fsdp_hand_variant``, ``fsdp2d_hand_variant``)."""
CFG = gpt.GPTConfig(vocab_size=128, seq_len=64, layers=2, width=128, heads=8)
BATCH = 32
LR = 1e-3
CHECK_STEPS = 3
WARMUP = 2
TARGET = 1.05
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
PARAM_TOL = {"rtol": 1e-4, "atol": 0.05 * LR}  # 5% of one Adam step per parameter


def make_optimizer() -> optax.GradientTransformation:
    return optax.adamw(LR)


def batches(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, CFG.vocab_size, (BATCH, CFG.seq_len), dtype=np.int32)
        out.append((tokens, np.roll(tokens, -1, axis=1)))
    return out


@dataclass
class Variant:
    """One way of running the step: ``step(batch)`` advances its own state and returns the loss."""

    name: str
    step: Callable[[Any], jax.Array]
    state: Callable[[], Any]
    """The arrays to block on after a step (new params, optimizer state)."""
    params: Callable[[], Any]
    """The global parameters, as host arrays."""
    prepare: Callable[[Any], Any]
    """Places a host batch the way this variant wants it (done once, outside the timing)."""
    ledger: CommLedger
    compiled: Any = None
    """The compiled step (its ``cost_analysis()`` gives the bytes it accesses)."""
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def meshkit_variant(trainer: Trainer, sample: Any) -> Variant:
    def step(batch):
        return trainer.step(batch)["loss"]

    compiled = trainer.compiled(sample)
    return Variant(
        name="meshkit",
        step=step,
        state=lambda: (trainer.params, trainer.opt_state),
        params=lambda: jax.device_get(trainer.params),
        prepare=trainer.put_batch,
        ledger=communication(compiled, mesh=trainer.mesh),
        compiled=compiled,
    )


def hand_variant(trainer: Trainer, params0: Any, loss_fn, sample: Any, name: str = "hand") -> Variant:
    """``jax.jit`` + NamedSharding: the obvious step, the Trainer's layout, XLA's collectives."""
    mesh, layout = trainer.mesh, trainer.placement
    param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), layout.param_specs())
    grad_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), layout.grad_specs())
    optimizer = make_optimizer()
    zero = layout.plan.zero != "dp"

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if zero:
            grads = lax.with_sharding_constraint(grads, grad_sh)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jit_variant(name, train_step, trainer, params0, param_sh, sample)


def gather_data(shards: Any, data_dims: Any, stacked: bool = False) -> Any:
    """All-gather each leaf over ``data`` on its ZeRO dim (inside a manual region; ``stacked``: a
    scan body's slice of a stacked leaf, whose leading layer axis is gone); whole leaves pass."""
    return jax.tree.map(
        lambda x, d: x if d is None else lax.all_gather(x, "data", axis=d - stacked, tiled=True),
        shards, data_dims,
    )  # fmt: skip


def gather_data_one_scatter(shards: Any, data_dims: Any, stacked: bool = False) -> Any:
    """``gather_data`` (one all-gather per leaf) whose backward reduce-scatters all the gradients of
    ``shards`` in one collective: each leaf's cotangent laid out as ``(n, chunk)`` rows, the rows
    concatenated, one ``psum_scatter``, the result cut back into shards (the ``--bucket`` ablation:
    what a reduce-scatter combiner would do, at the price of the concatenation's copy)."""
    leaves, treedef = jax.tree.flatten(shards)
    dims = jax.tree.leaves(data_dims, is_leaf=lambda d: d is None)
    idx = [i for i, d in enumerate(dims) if d is not None]
    ds = [dims[i] - stacked for i in idx]

    @jax.custom_vjp
    def gather(xs):
        return [lax.all_gather(x, "data", axis=d, tiled=True) for x, d in zip(xs, ds, strict=True)]

    def scatter(cts, dims_):
        n = lax.axis_size("data")
        rows = [jnp.moveaxis(ct, d, 0).reshape(n, -1) for ct, d in zip(cts, dims_, strict=True)]
        mine = lax.psum_scatter(jnp.concatenate(rows, axis=1), "data", scatter_dimension=0, tiled=True)[0]
        out, offset = [], 0
        for ct, d, r in zip(cts, dims_, rows, strict=True):
            moved = jnp.moveaxis(ct, d, 0).shape
            piece = mine[offset : offset + r.shape[1]].reshape((moved[0] // n, *moved[1:]))
            out.append(jnp.moveaxis(piece, 0, d))
            offset += r.shape[1]
        return out

    def bwd(_, cts):
        # one bucket per varying-axes type: a leaf replicated over ``model`` stays apart from the
        # model-split ones (under check_vma, concatenating them would type it as split too)
        groups: dict[Any, list[int]] = {}
        for j, ct in enumerate(cts):
            groups.setdefault(jax.typeof(ct).mat.varying, []).append(j)
        out: list[Any] = [None] * len(cts)
        for js in groups.values():
            for j, g in zip(js, scatter([cts[j] for j in js], [ds[j] for j in js]), strict=True):
                out[j] = g
        return (out,)

    gather.defvjp(lambda xs: (gather(xs), None), bwd)
    for i, g in zip(idx, gather([leaves[i] for i in idx]) if idx else [], strict=True):
        leaves[i] = g
    return jax.tree.unflatten(treedef, leaves)


def fsdp_hand_variant(
    trainer: Trainer,
    params0: Any,
    cfg: gpt.GPTConfig,
    sample: Any,
    remat: str,
    name: str = "hand",
    layer_gather: Callable = gather_data,
) -> Variant:
    """ZeRO-3 with per-layer gathers, written by hand: the reference for ``zero3`` (``remat``: none
    holds each gathered layer for the backward pass, layer saves nothing and gathers again, dots
    saves matmul outputs, regather saves everything but the gathered weights).

    ``jax.shard_map`` manual over ``data``; each parameter leaf arrives as this device's shard. The
    embeddings and the head are all-gathered once; each block all-gathers its own leaves (one
    ``all_gather`` per leaf) inside a ``jax.checkpoint``-ed body that saves nothing: a ``lax.scan``
    body in the scanned form, and in the Python-loop form a block whose shards are tied to its input
    by ``lax.optimization_barrier`` (so the gathers cannot be hoisted); ``remat="none"`` drops the
    ``jax.checkpoint``. The transpose of each
    all-gather is a reduce-scatter, so gradients come back as shards; leaves kept whole are
    all-reduced. AdamW then updates the shards in the global view, as the Trainer does.
    """
    mesh, layout = trainer.mesh, trainer.placement
    n = int(mesh.shape["data"])
    optimizer = make_optimizer()
    dims = layout.tree(lambda leaf: leaf.data_dim)
    local_specs = layout.tree(lambda leaf: leaf.manual_spec(data=True))
    param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), layout.param_specs())

    def block(p, x):
        return gpt._block(p, x, cfg)

    remat_ = rematerialized(remat)

    def local_loss(p, batch):
        tokens, targets = batch
        top_dims = {k: v for k, v in dims.items() if k != "blocks"}
        top = gather_data({k: v for k, v in p.items() if k != "blocks"}, top_dims)
        x = gpt._embed(top, tokens, cfg)
        if cfg.scan_layers:

            def body(x, shards):
                return block(layer_gather(shards, dims["blocks"], stacked=True), x), None

            x, _ = lax.scan(remat_(body), x, p["blocks"])
        else:
            for shards, bdims in zip(p["blocks"], dims["blocks"], strict=True):

                def one(shards, x, bdims=bdims):
                    shards, x = lax.optimization_barrier((shards, x))
                    return block(layer_gather(shards, bdims), x)

                x = remat_(one)(shards, x)
        logits = gpt._head(top, x, cfg)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def local_grads(p, batch):
        loss, g = jax.value_and_grad(local_loss)(p, batch)  # sharded leaves: summed by the reduce-scatter
        g = jax.tree.map(lambda gi, d: gi / n if d is not None else lax.psum(gi, "data") / n, g, dims)
        return lax.pmean(loss, "data"), g

    grads_of = jax.shard_map(local_grads, mesh=mesh, in_specs=(local_specs, P("data")),
                             out_specs=(P(), local_specs), axis_names={"data"}, check_vma=False)  # fmt: skip

    def train_step(params, opt_state, batch):
        loss, grads = grads_of(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jit_variant(name, train_step, trainer, params0, param_sh, sample)


def _not_gathers(prim, *_, **__) -> bool:
    """A ``jax.checkpoint`` policy: save every value but an all-gather's output."""
    return prim.name != "all_gather"


def rematerialized(remat: str) -> Callable[[Callable], Callable]:
    """``fn`` under ``jax.checkpoint`` with the policy a user picks for ``remat`` (none: no checkpoint)."""
    policy = {
        "layer": jax.checkpoint_policies.nothing_saveable,
        "dots": jax.checkpoint_policies.dots_saveable,
        "regather": _not_gathers,
    }
    return (lambda fn: fn) if remat == "none" else (lambda fn: jax.checkpoint(fn, policy=policy[remat]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gathered(x: jax.Array, rest: NamedSharding, used: NamedSharding) -> jax.Array:
    """``x`` constrained to ``used`` (an all-gather over data); its gradient back to ``rest``."""
    return lax.with_sharding_constraint(x, used)


def _gathered_fwd(x, rest, used):
    return _gathered(x, rest, used), None


def _gathered_bwd(rest, used, _, ct):
    return (lax.with_sharding_constraint(ct, rest),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def fsdp2d_jit_variant(
    trainer: Trainer, params0: Any, cfg: gpt.GPTConfig, sample: Any, remat: str, name: str = "alt"
) -> Variant:
    """zero3 or fsdp+tp with per-layer gathers, written by hand in the global view: the second
    reference (``alt``) for ``zero3`` and ``fsdp+tp`` (parameters at rest split on ``data``, and on
    ``model`` by the tensor-parallel rules; gathered on ``data`` only). The same peak as the
    others (measured: 2D at 2 and 16 layers, none and layer remat, within 0.1 MiB of the 2D
    ``shard_map`` step), but not the same collectives: XLA:CPU's partitioner all-reduces each
    gradient and slices it, and its combiner merges those all-reduces into a few.

    ``jax.jit`` alone, no ``shard_map``: each block's leaves are tied to its input by
    ``lax.optimization_barrier`` and constrained (``with_sharding_constraint``) to their
    tensor-parallel spec, which all-gathers them over ``data`` where the block runs, inside a
    ``jax.checkpoint`` with the remat policy (none: no checkpoint); a ``custom_vjp`` constrains the
    gradient back to the spec at rest, so the partitioner reduce-scatters it there. In the scanned
    form the same happens in the scan body. The embeddings and head are gathered once.
    """
    mesh, layout = trainer.mesh, trainer.placement
    optimizer = make_optimizer()
    named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    rest = layout.tree(lambda leaf: named(leaf.spec(data=True)))
    used = layout.tree(lambda leaf: named(leaf.spec(data=False)))
    param_sh = rest
    remat_ = rematerialized(remat)

    def unstacked(sh):  # a stacked leaf's sharding as one layer's slice sees it
        return jax.tree.map(lambda s: named(P(*s.spec[1:])), sh)

    def gather(p, rest_sh, used_sh):
        return jax.tree.map(_gathered, p, rest_sh, used_sh)

    def block(p, x, rest_sh, used_sh):
        p, x = lax.optimization_barrier((p, x))
        return gpt._block(gather(p, rest_sh, used_sh), x, cfg)

    def loss(params, batch):
        tokens, targets = batch
        top = {k: v for k, v in params.items() if k != "blocks"}
        top = gather(top, {k: rest[k] for k in top}, {k: used[k] for k in top})
        x = gpt._embed(top, tokens, cfg)
        if cfg.scan_layers:
            r, u = unstacked(rest["blocks"]), unstacked(used["blocks"])
            x, _ = lax.scan(remat_(lambda x, p: (block(p, x, r, u), None)), x, params["blocks"])
        else:
            for p, r, u in zip(params["blocks"], rest["blocks"], used["blocks"], strict=True):
                x = remat_(lambda p, x, r=r, u=u: block(p, x, r, u))(p, x)
        logits = gpt._head(top, x, cfg)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def train_step(params, opt_state, batch):
        loss_, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss_

    return jit_variant(name, train_step, trainer, params0, param_sh, sample)


def _tp_block(p: Any, x: jax.Array, cfg: gpt.GPTConfig, model: int) -> jax.Array:
    """One GPT block on this device's tensor-parallel shards (Megatron by hand, manual over ``model``):
    column-split ``wq/wk/wv/w_in`` (this device's heads and hidden units), row-split ``wo/w_out``
    whose partial products are summed over ``model`` before the replicated output bias. Under
    ``check_vma`` the transpose of the replicated input's use in the column matmuls is the backward
    all-reduce over ``model`` (Megatron's ``f``); the ``psum``'s is a pass-through (``g``)."""
    b, t, _ = x.shape
    heads, hd = cfg.heads // model, cfg.head_dim
    a, m = p["attn"], p["mlp"]
    h = gpt._layer_norm(p["ln1"], x)
    q = (h @ a["wq"] + a["bq"]).reshape(b, t, heads, hd)
    k = (h @ a["wk"]).reshape(b, t, heads, hd)
    v = (h @ a["wv"] + a["bv"]).reshape(b, t, heads, hd)
    s = jnp.einsum("bthk,bshk->bhts", q, k) / np.sqrt(hd)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, jnp.finfo(s.dtype).min)
    o = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(s, axis=-1), v).reshape(b, t, heads * hd)
    x = x + lax.psum(o @ a["wo"], "model") + a["bo"]
    h = jax.nn.gelu(gpt._layer_norm(p["ln2"], x) @ m["w_in"] + m["b_in"])
    return x + lax.psum(h @ m["w_out"], "model") + m["b_out"]


def fsdp2d_manual_variant(
    trainer: Trainer,
    params0: Any,
    cfg: gpt.GPTConfig,
    sample: Any,
    remat: str,
    name: str = "hand",
    layer_gather: Callable = gather_data,
) -> Variant:
    """fsdp+tp with per-layer gathers and per-layer gradient reduce-scatters, written by hand with
    every collective explicit: the reference with fsdp+tp's memory behaviour (the reference for
    ``fsdp+tp``).

    ``jax.shard_map`` manual over ``data`` and ``model``; each leaf arrives as its 2D shard (split
    on ``model`` by the tensor-parallel rules, on ``data`` by ZeRO-3) and the block runs Megatron
    tensor parallelism by hand (``_tp_block``). Each block all-gathers its leaves over ``data``
    (one ``all_gather`` per leaf) tied to its input by ``lax.optimization_barrier`` under the remat
    policy, exactly as ``fsdp_hand_variant``; the transpose of each gather is the leaf's
    reduce-scatter, so every layer's gradients leave as shards when its backward pass is done.
    ``check_vma`` (JAX's default) inserts the model-axis all-reduces of the backward pass and the
    data-axis sums of the leaves kept whole on ``data``.
    """
    mesh, layout = trainer.mesh, trainer.placement
    n, model = int(mesh.shape["data"]), int(mesh.shape["model"])
    optimizer = make_optimizer()
    dims = layout.tree(lambda leaf: leaf.data_dim)
    specs = layout.tree(lambda leaf: leaf.spec(data=True))
    param_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    remat_ = rematerialized(remat)

    def local_loss(p, batch):
        tokens, targets = batch
        top = gather_data(
            {k: v for k, v in p.items() if k != "blocks"}, {k: v for k, v in dims.items() if k != "blocks"}
        )
        x = gpt._embed(top, tokens, cfg)
        if cfg.scan_layers:

            def body(x, shards):
                shards, x = lax.optimization_barrier((shards, x))
                return _tp_block(layer_gather(shards, dims["blocks"], stacked=True), x, cfg, model), None

            x, _ = lax.scan(remat_(body), x, p["blocks"])
        else:
            for shards, bdims in zip(p["blocks"], dims["blocks"], strict=True):

                def one(shards, x, bdims=bdims):
                    shards, x = lax.optimization_barrier((shards, x))
                    return _tp_block(layer_gather(shards, bdims), x, cfg, model)

                x = remat_(one)(shards, x)
        logits = gpt._head(top, x, cfg)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def local_grads(p, batch):
        loss, g = jax.value_and_grad(local_loss)(p, batch)  # every gradient summed over data already
        return lax.pmean(loss, "data"), jax.tree.map(lambda gi: gi / n, g)

    grads_of = jax.shard_map(local_grads, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P(), specs))

    def train_step(params, opt_state, batch):
        loss, grads = grads_of(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jit_variant(name, train_step, trainer, params0, param_sh, sample)


def jit_variant(
    name: str, train_step: Callable, trainer: Trainer, params0: Any, param_sh: Any, sample: Any
) -> Variant:
    """``train_step(params, opt_state, batch) -> (params, opt_state, loss)`` jitted on the Trainer's
    shardings with the same donation, running on its own copy of the parameters and state."""
    sh, optimizer = trainer.shardings, make_optimizer()
    jitted = jax.jit(train_step, in_shardings=(param_sh, sh.opt_state, sh.batch),
                     out_shardings=(param_sh, sh.opt_state, sh.scalar), donate_argnums=(0, 1))  # fmt: skip
    st = {"params": jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=param_sh)(params0)}
    st["opt"] = jax.jit(optimizer.init, out_shardings=sh.opt_state)(st["params"])

    def prepare(batch):
        return jax.device_put(batch, sh.batch)

    def step(batch):
        st["params"], st["opt"], loss = jitted(st["params"], st["opt"], batch)
        return loss

    compiled = jitted.lower(st["params"], st["opt"], prepare(sample)).compile()
    return Variant(
        name=name,
        step=step,
        state=lambda: (st["params"], st["opt"]),
        params=lambda: jax.device_get(st["params"]),
        prepare=prepare,
        ledger=communication(compiled, mesh=trainer.mesh),
        compiled=compiled,
    )


def pmap_variant(params0: Any, loss_fn, sample: Any) -> Variant:
    """Legacy data parallelism: replicated params with a leading device axis, pmean of the grads."""
    n = jax.device_count()
    optimizer = make_optimizer()

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        grads = lax.pmean(grads, "data")
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "data")

    pmapped = jax.pmap(train_step, axis_name="data", donate_argnums=(0, 1))
    replicate = jax.pmap(lambda t: jax.tree.map(jnp.copy, t), axis_name="data")
    stacked = jax.tree.map(lambda a: np.broadcast_to(np.asarray(a), (n, *np.shape(a))), params0)
    st = {"params": replicate(stacked)}
    st["opt"] = jax.pmap(optimizer.init)(st["params"])
    place = jax.pmap(lambda b: b)

    def prepare(batch):
        return place(jax.tree.map(lambda a: np.asarray(a).reshape(n, a.shape[0] // n, *a.shape[1:]), batch))

    def step(batch):
        st["params"], st["opt"], loss = pmapped(st["params"], st["opt"], batch)
        return loss[0]

    compiled = pmapped.lower(st["params"], st["opt"], prepare(sample)).compile()
    return Variant(
        name="pmap",
        step=step,
        state=lambda: (st["params"], st["opt"]),
        params=lambda: jax.tree.map(lambda a: np.asarray(a[0]), jax.device_get(st["params"])),
        prepare=prepare,
        ledger=communication(compiled),
        compiled=compiled,
    )


def check_same(variants: list[Variant], data: list[Any]) -> dict[str, dict[str, Any]]:
    """Run the same steps on every variant; compare losses and parameters with meshkit's."""
    losses: dict[str, list[float]] = {v.name: [] for v in variants}
    for batch in data:
        for v in variants:
            losses[v.name].append(float(v.step(v.prepare(batch))))
    ref_loss = np.array(losses["meshkit"])
    ref_params = jax.tree.leaves(variants[0].params())
    out = {}
    for v in variants[1:]:
        loss = np.array(losses[v.name])
        params = jax.tree.leaves(v.params())
        pairs = list(zip(params, ref_params, strict=True))
        loss_ok = bool(np.allclose(loss, ref_loss, **LOSS_TOL))
        params_ok = all(np.allclose(a, b, **PARAM_TOL) for a, b in pairs)
        out[v.name] = {
            "ok": loss_ok and params_ok,
            "losses": loss.tolist(),
            "meshkit_losses": ref_loss.tolist(),
            "max_loss_diff": float(np.max(np.abs(loss - ref_loss))),
            "max_param_diff": max(float(np.max(np.abs(a - b))) for a, b in pairs),
        }
    return out


def time_variants(variants: list[Variant], batch: Any, steps: int, rounds: int) -> None:
    placed = {v.name: v.prepare(batch) for v in variants}
    for v in variants:  # warm-up: caches, allocator, thread pools
        for _ in range(WARMUP):
            jax.block_until_ready((v.step(placed[v.name]), v.state()))
    for r in range(rounds):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            b = placed[v.name]
            jax.block_until_ready((v.step(b), v.state()))  # untimed: the switch from another variant
            for _ in range(steps):
                c0, t0 = time.process_time(), time.perf_counter()
                loss = v.step(b)
                jax.block_until_ready((loss, v.state()))
                v.wall.append(time.perf_counter() - t0)
                v.cpu.append(time.process_time() - c0)


def by_op_axes(ledger: CommLedger) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in ledger.records:
        acc = out.setdefault(f"{r.op}@{r.axes_label}", {"executions": 0, "size_bytes": 0})
        acc["executions"] += r.executions
        acc["size_bytes"] += r.size_bytes * r.executions
    return dict(sorted(out.items()))


def bytes_accessed(compiled: Any) -> float:
    """Bytes the compiled step reads and writes per device (XLA's ``cost_analysis``)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("bytes accessed", 0.0))


def peak_bytes(compiled: Any) -> float:
    """Per-device peak of the compiled step: arguments + temporaries (``memory_analysis()``)."""
    mem = compiled.memory_analysis()
    return float(mem.argument_size_in_bytes + mem.temp_size_in_bytes)


def ms(xs: list[float], q: float = 50) -> float:
    return 1e3 * float(np.percentile(xs, q))


def run_plan(spec: str, params0: Any, loss_fn, args) -> dict[str, Any]:
    data = batches(CHECK_STEPS + 1)
    sample = data[0]
    plan, remat, *form = [*spec.split(":"), "none"][:2] + spec.split(":")[2:]
    cfg = dataclasses.replace(CFG, scan_layers=form == ["scan"])
    if cfg.scan_layers:
        params0, loss_fn = gpt.to_scanned(params0), gpt.make_loss(cfg)
    trainer = Trainer(
        loss_fn,
        params0,
        make_optimizer(),
        plan=plan,
        remat=remat,
        logical_axes=gpt.logical_axes(params0),
        tokens_per_example=CFG.seq_len,
    )

    def hand(name: str, layer_gather: Callable = gather_data) -> Variant:  # same memory behaviour
        if plan == "zero3":  # gathers per layer, remat or not
            return fsdp_hand_variant(trainer, params0, cfg, sample, remat, name, layer_gather)
        if plan == "fsdp+tp":
            return fsdp2d_manual_variant(trainer, params0, cfg, sample, remat, name, layer_gather)
        return hand_variant(trainer, params0, loss_fn, sample, name=name)

    variants = [meshkit_variant(trainer, sample), hand("hand")]
    if plan == "dp":
        variants.append(pmap_variant(params0, loss_fn, sample))
    if plan in ("zero3", "fsdp+tp"):
        variants.append(fsdp2d_jit_variant(trainer, params0, cfg, sample, remat))
    if args.control:  # a second compile of the same reference
        variants.append(hand("hand2"))
    if args.bucket and plan in ("zero3", "fsdp+tp"):  # the hand-written step, one scatter per layer
        variants.append(hand("bucket", gather_data_one_scatter))
    checks = check_same(variants, data[:CHECK_STEPS])
    time_variants(variants, data[CHECK_STEPS], args.steps, args.rounds)
    res: dict[str, Any] = {"plan": spec, "mesh": {k: int(v) for k, v in trainer.mesh.shape.items()}}
    res["variants"] = {
        v.name: {
            "median_ms": ms(v.wall),
            "p25_ms": ms(v.wall, 25),
            "p75_ms": ms(v.wall, 75),
            "cpu_median_ms": ms(v.cpu),
            "wall_ms": [1e3 * t for t in v.wall],
            "cpu_ms": [1e3 * t for t in v.cpu],
            "collectives": v.ledger.count(),
            "size_bytes": v.ledger.size_bytes,
            "traffic_bytes": v.ledger.traffic_bytes,
            "by_op": by_op_axes(v.ledger),
            "bytes_accessed": bytes_accessed(v.compiled),
            "peak_bytes": peak_bytes(v.compiled),
        }
        for v in variants
    }
    var = res["variants"]
    mk = var["meshkit"]

    def ratios(other: str) -> dict[str, float] | None:
        if other not in var:
            return None
        return {
            "wall": mk["median_ms"] / var[other]["median_ms"],
            "cpu": mk["cpu_median_ms"] / var[other]["cpu_median_ms"],
        }

    res["ratio_hand"] = ratios("hand")
    res["bytes_ratio_hand"] = mk["bytes_accessed"] / var["hand"]["bytes_accessed"]
    res["alt"] = next((v.name for v in variants if v.name in ("pmap", "alt")), None)
    res["ratio_alt"] = ratios(res["alt"]) if res["alt"] else None
    res["ratio_bucket"] = ratios("bucket")
    res["control"] = (
        {
            "wall": var["hand2"]["median_ms"] / var["hand"]["median_ms"],
            "cpu": var["hand2"]["cpu_median_ms"] / var["hand"]["cpu_median_ms"],
        }
        if "hand2" in var
        else None
    )
    res["checks"] = checks
    res["same_result"] = all(c["ok"] for c in checks.values())
    return res


def mb(b: float) -> str:
    return f"{b / 1e6:.2f}"


def mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def print_table(results: list[dict[str, Any]]) -> None:
    control = any(r["control"] for r in results)
    head = (
        f"{'plan':<16} {'mesh':<15} {'meshkit ms':>10} {'hand ms':>8} {'mk/hand':>7} {'cpu':>5} "
        f"{'alt ms':>8} {'mk/alt':>7} {'cpu':>5}" + (f" {'A/A':>5} {'cpu':>5}" if control else "") + " |"
        f" {'coll mk':>7} {'MB mk':>6} {'coll hand':>9} {'MB hand':>7} {'coll alt':>9} {'MB alt':>7} |"
        f" {'acc mk':>6} {'acc hand':>8} {'ratio':>5} | {'peak mk':>7} {'hand':>6} {'alt':>6} | same"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        v, rh, rp, ctl = r["variants"], r["ratio_hand"], r["ratio_alt"], r["control"]
        mesh = ",".join(f"{k}={s}" for k, s in r["mesh"].items())
        pm = v.get(r["alt"]) if r["alt"] else None
        flag = " *" if rh["wall"] > TARGET or rh["cpu"] > TARGET else ""
        line = (
            f"{r['plan']:<16} {mesh:<15} {v['meshkit']['median_ms']:>10.1f} {v['hand']['median_ms']:>8.1f} "
            f"{rh['wall']:>7.2f} {rh['cpu']:>5.2f} "
            + (
                f"{pm['median_ms']:>8.1f} {rp['wall']:>7.2f} {rp['cpu']:>5.2f}"
                if pm
                else f"{'-':>8} {'-':>7} {'-':>5}"
            )
            + (
                f" {ctl['wall']:>5.2f} {ctl['cpu']:>5.2f}"
                if ctl
                else (f" {'-':>5} {'-':>5}" if control else "")
            )
            + f" | {v['meshkit']['collectives']:>7} {mb(v['meshkit']['size_bytes']):>6} "
            f"{v['hand']['collectives']:>9} {mb(v['hand']['size_bytes']):>7} "
            + (f"{pm['collectives']:>9} {mb(pm['size_bytes']):>7}" if pm else f"{'-':>9} {'-':>7}")
            + f" | {mb(v['meshkit']['bytes_accessed']):>6} {mb(v['hand']['bytes_accessed']):>8} "
            f"{r['bytes_ratio_hand']:>5.3f} | {mib(v['meshkit']['peak_bytes']):>7} {mib(v['hand']['peak_bytes']):>6} "
            + (f"{mib(pm['peak_bytes']):>6}" if pm else f"{'-':>6}")
            + f" | {'yes' if r['same_result'] else 'MISMATCH'}{flag}"
        )
        print(line)
    print(
        f"(ratios: median wall-clock and, under 'cpu', median process CPU time per step; "
        f"* = meshkit above {TARGET:.2f}x the hand-written step"
        + ("; A/A = hand2/hand, the noise floor" if control else "")
        + "; alt = legacy pmap for dp, the jit step with per-layer constraints for zero3 and fsdp+tp; acc = MB the compiled step accesses"
        " per device, cost_analysis; peak = MiB per device, arguments + temporaries, memory_analysis)"
    )
    print("\ncollectives per step (executions x MB) by op@axes:")
    for r in results:
        for name, v in r["variants"].items():
            if name == "hand2":
                continue
            parts = ", ".join(f"{k} {d['executions']}x{mb(d['size_bytes'])}" for k, d in v["by_op"].items())
            print(f"  {r['plan']:<16} {name:<8} {parts or '(none)'}")
    bucketed = [r for r in results if r["ratio_bucket"]]
    if bucketed:
        print("\none reduce-scatter per layer (--bucket), against the per-leaf hand-written step and alt:")
        for r in bucketed:
            v, rb = r["variants"], r["ratio_bucket"]
            b, h, a = v["bucket"], v["hand"], v[r["alt"]]
            print(
                f"  {r['plan']:<20} bucket {b['median_ms']:6.1f} ms  mk/bucket {rb['wall']:.2f} cpu {rb['cpu']:.2f}  "
                f"hand/bucket {h['median_ms'] / b['median_ms']:.2f}  bucket/alt {b['median_ms'] / a['median_ms']:.2f}  "
                f"peak MiB bucket {mib(b['peak_bytes'])} hand {mib(h['peak_bytes'])} alt {mib(a['peak_bytes'])}  "
                f"collectives {b['collectives']} (hand {h['collectives']}, alt {a['collectives']})"
            )
    print("\nsame result (max |diff| vs meshkit after the same steps):")
    for r in results:
        for name, c in r["checks"].items():
            print(
                f"  {r['plan']:<16} {name:<8} loss {c['max_loss_diff']:.2e}  params {c['max_param_diff']:.2e}  "
                f"{'ok' if c['ok'] else 'MISMATCH'}"
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant per turn (default 4)")
    ap.add_argument("--rounds", type=int, default=10, help="round-robin rounds (default 10)")
    ap.add_argument(
        "--plans", default=",".join(ALL_PLANS), help=f"comma-separated subset of {','.join(ALL_PLANS)}"
    )
    ap.add_argument(
        "--control", action="store_true", help="also time a second hand-written step (A/A noise floor)"
    )
    ap.add_argument(
        "--bucket",
        action="store_true",
        help="zero3/fsdp+tp: also time the hand-written step with one gradient reduce-scatter per layer",
    )
    ap.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    args = ap.parse_args()
    plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    unknown = [p for p in plans if p not in ALL_PLANS]
    if unknown or not plans:
        ap.error(f"unknown plan(s) {unknown}: choose from {','.join(ALL_PLANS)}")
    if args.steps < 1 or args.rounds < 1:
        ap.error("--steps and --rounds must be at least 1")

    t_start = time.perf_counter()
    params0 = jax.device_get(gpt.init(jax.random.key(0), CFG))
    loss_fn = gpt.make_loss(CFG)
    print(
        f"GPT {CFG.layers} layers, width {CFG.width}, {CFG.heads} heads, vocab {CFG.vocab_size}, "
        f"seq {CFG.seq_len}; global batch {BATCH}; adamw; {jax.device_count()} {jax.default_backend()} "
        f"devices; {args.rounds} rounds x {args.steps} timed steps per variant\n",
        flush=True,
    )
    results = []
    for plan in plans:
        t0 = time.perf_counter()
        results.append(run_plan(plan, params0, loss_fn, args))
        print(f"  {plan}: done in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    print_table(results)
    total = time.perf_counter() - t_start
    print(f"\ntotal {total:.1f}s")
    if args.json:
        cfg = {k: getattr(CFG, k) for k in ("vocab_size", "seq_len", "layers", "width", "heads")}
        payload = {
            "config": {
                "gpt": cfg,
                "batch": BATCH,
                "optimizer": f"adamw({LR})",
                "devices": jax.device_count(),
                "steps": args.steps,
                "rounds": args.rounds,
                "target_ratio": TARGET,
                "seconds": total,
            },
            "results": results,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return 0 if all(r["same_result"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
