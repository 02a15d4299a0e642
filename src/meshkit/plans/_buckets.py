"""Bucketed data-axis collectives: one reduce-scatter (or all-gather) per dtype, not one per leaf.

Inside a manual ``data`` region, each data-sharded leaf is laid out as ``(n, chunk)`` rows (its
sharded dim moved to the front), the rows of all leaves of a dtype are concatenated, and a single
collective moves the bucket. This is how FSDP/ZeRO implementations flatten parameters; XLA's GPU
compiler combines per-leaf collectives itself, its CPU compiler does not (only all-reduces), and
per-leaf collectives then cost a synchronisation of every device each.

A leaf also split on the ``model`` axis (fsdp+tp: the data split on another dim) moves in a
collective of its own, inside a nested ``shard_map`` manual over ``model`` too, so that it moves
this device's model shard only. Tried and measured on a GPT (data=2, model=4): in a bucket, and
also alone but with ``model`` left to the partitioner (with or without a sharding constraint on the
gathered value), XLA first all-gathers the leaf over ``model`` and then moves whole rows over
``data``: 2.6-3.5x the model's data-axis bytes plus model-axis gathers nobody asked for.

Forward and backward: the transpose of the bucketed all-gather is the bucketed reduce-scatter, so
ZeRO-3's gradient reduce-scatter comes out bucketed too. Bytes moved are unchanged.

A bfloat16 sum over a manual axis (reduce-scatter, all-reduce) runs manual over every mesh axis
(``manual_sum``): XLA:CPU (jaxlib 0.12.0.1) aborts the process compiling a bf16 all-reduce or
reduce-scatter lowered where another mesh axis is left to the partitioner (fsdp+tp, dp+tp with
micro-batches, pipelines with tp), "Invalid binary instruction opcode copy": JAX annotates the root of the reduction's
computation as replicated there, the partitioner turns that annotation into a ``copy``, and the
CPU compiler's AllReducePromotion (bf16 sums done in f32) rebuilds the reduction from the root's
opcode. float16 and float32 sums are not promoted and keep their form.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, get_abstract_mesh
from jax.sharding import PartitionSpec as P

from meshkit.plans.placement import LeafPlacement
from meshkit.spec import DATA, MODEL


def _groups(arrays: Sequence[jax.Array], leaves: Sequence[LeafPlacement]) -> dict:
    """Indices of data-sharded leaves, grouped by dtype (in leaf order); a leaf also split on the
    model axis is a group of its own."""
    out: dict = {}
    for i, (a, leaf) in enumerate(zip(arrays, leaves, strict=True)):
        if leaf.data_dim is not None:
            out.setdefault(("leaf", i) if leaf.model_sharded else jnp.dtype(a.dtype), []).append(i)
    return out


def _alone(idx: list[int], leaves: Sequence[LeafPlacement]) -> int | None:
    return idx[0] if len(idx) == 1 and leaves[idx[0]].model_sharded else None


def _on_model_shard(fn, x: jax.Array, leaf: LeafPlacement) -> jax.Array:
    """``fn`` on this device's model shard of ``x`` (manual over ``model`` as well as ``data``)."""
    spec = model_spec(leaf)
    return jax.shard_map(
        fn, mesh=get_abstract_mesh(), in_specs=spec, out_specs=spec, axis_names={MODEL}, check_vma=False
    )(x)


def manual_sum(fn, x, specs=None):
    """``fn(x)``, a sum over manual axes (an all-reduce or a reduce-scatter); a bfloat16 one runs
    inside a region manual over the axes still automatic too, ``x`` laid over them by ``specs`` (a
    prefix of ``x``'s structure; default replicated). See the module docstring: XLA:CPU aborts
    compiling such a sum otherwise."""
    mesh = get_abstract_mesh()
    auto = {a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t != AxisType.Manual}
    if not auto or not any(jnp.dtype(a.dtype) == jnp.bfloat16 for a in jax.tree.leaves(x)):
        return fn(x)
    specs = P() if specs is None else specs
    return jax.shard_map(fn, mesh=mesh, in_specs=(specs,), out_specs=specs, axis_names=auto, check_vma=False)(
        x
    )


def model_spec(leaf: LeafPlacement) -> P:
    """The leaf's split over the model axis alone (a pipeline's stage axis is manual already)."""
    return P(*[a if a == MODEL else None for a in leaf.model_spec])


def reduce_scatter(grads: Sequence[jax.Array], leaves: Sequence[LeafPlacement], n: int) -> list[jax.Array]:
    """Sum full local gradients over the data axis and keep this device's shard of each sharded leaf.

    Leaves kept whole pass through unchanged. Equal to ``psum_scatter(g, scatter_dimension=dim,
    tiled=True)`` per leaf, in one collective per dtype.
    """
    out = list(grads)
    for idx in _groups(grads, leaves).values():
        if (i := _alone(idx, leaves)) is not None:
            dim = leaves[i].data_dim
            out[i] = _on_model_shard(
                lambda g, d=dim: lax.psum_scatter(g, DATA, scatter_dimension=d, tiled=True),
                grads[i],
                leaves[i],
            )
            continue
        rows = [jnp.moveaxis(grads[i], leaves[i].data_dim, 0).reshape(n, -1) for i in idx]
        mine = manual_sum(
            lambda b: lax.psum_scatter(b, DATA, scatter_dimension=0, tiled=True)[0],
            jnp.concatenate(rows, axis=1),
        )
        offset = 0
        for i, r in zip(idx, rows, strict=True):
            moved = jnp.moveaxis(grads[i], leaves[i].data_dim, 0).shape
            piece = mine[offset : offset + r.shape[1]].reshape((moved[0] // n, *moved[1:]))
            out[i] = jnp.moveaxis(piece, 0, leaves[i].data_dim)
            offset += r.shape[1]
    return out


def all_gather(shards: Sequence[jax.Array], leaves: Sequence[LeafPlacement], n: int) -> list[jax.Array]:
    """Reassemble every data-sharded leaf from its shards (one all-gather per dtype)."""
    out = list(shards)
    for idx in _groups(shards, leaves).values():
        if (i := _alone(idx, leaves)) is not None:
            dim = leaves[i].data_dim
            out[i] = _on_model_shard(
                lambda x, d=dim: lax.all_gather(x, DATA, axis=d, tiled=True), shards[i], leaves[i]
            )
            continue
        flat = [jnp.moveaxis(shards[i], leaves[i].data_dim, 0).reshape(1, -1) for i in idx]
        rows = lax.all_gather(jnp.concatenate(flat, axis=1), DATA, axis=0, tiled=True)
        offset = 0
        for i, f in zip(idx, flat, strict=True):
            moved = jnp.moveaxis(shards[i], leaves[i].data_dim, 0).shape
            full = rows[:, offset : offset + f.shape[1]].reshape((n * moved[0], *moved[1:]))
            out[i] = jnp.moveaxis(full, 0, leaves[i].data_dim)
            offset += f.shape[1]
    return out
