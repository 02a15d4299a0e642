"""Built-in example programs for the ledgers: each returns ``(jitted_function, example_args)``.

They are the chapter's workloads written afresh: data-parallel MLP + Adam, the FSDP gradient of an
MLP, a Megatron MLP block, a distributed transpose by all-to-all, a halo exchange by
collective-permute, and pmean beside psum / N. Every example uses all of ``jax.devices()``; the
ones with a 2D mesh need a device count divisible by 2. Use them as ``meshkit comm
meshkit.examples:dp_mlp_adam --devices 8``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.mesh import make_mesh
from meshkit.models import mlp

MLP_SIZES = (16, 64, 64, 8)


def _mlp_data(key: int, batch: int):
    x = jax.random.normal(jax.random.key(key), (batch, MLP_SIZES[0]))
    y = jnp.sin(x @ jnp.ones((MLP_SIZES[0], MLP_SIZES[-1])) / 4)
    return x, y


def dp_mlp_adam(batch: int = 512):
    """One data-parallel Adam step of a [16, 64, 64, 8] MLP: params replicated, batch sharded."""
    mesh = make_mesh("data=-1")
    opt = optax.adam(1e-2)
    params = jax.device_put(mlp.init(jax.random.key(7), MLP_SIZES), NamedSharding(mesh, P()))
    x, y = jax.device_put(_mlp_data(8, batch), NamedSharding(mesh, P("data")))

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(mlp.loss)(params, (x, y))
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt.init(params), x, y)


def dp_mlp_grad(batch: int = 256):
    """The gradient of the MLP loss with replicated parameters (the DP side of the FSDP comparison)."""
    mesh = make_mesh("data=-1")
    params = jax.device_put(mlp.init(jax.random.key(0), MLP_SIZES), NamedSharding(mesh, P()))
    x, y = jax.device_put(_mlp_data(1, batch), NamedSharding(mesh, P("data")))
    return jax.jit(lambda p, x, y: jax.grad(mlp.loss)(p, (x, y))), (params, x, y)


def fsdp_mlp_grad(batch: int = 256):
    """FSDP (ZeRO-3) gradient in shard_map: parameter shards all-gathered inside the loss, so
    autodiff turns the gather's transpose into the gradient reduce-scatter."""
    mesh = make_mesh("data=-1")
    n = mesh.shape["data"]
    params = mlp.init(jax.random.key(0), MLP_SIZES)
    spec = jax.tree.map(lambda _: P("data"), params)
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), spec))
    x, y = jax.device_put(_mlp_data(1, batch), NamedSharding(mesh, P("data")))

    def local_grad(shards, x, y):
        def sharded_loss(q):
            full = jax.tree.map(lambda a: lax.all_gather(a, "data", tiled=True), q)
            return mlp.loss(full, (x, y))

        return jax.tree.map(lambda g: g / n, jax.grad(sharded_loss)(shards))

    fn = jax.shard_map(local_grad, mesh=mesh, in_specs=(spec, P("data"), P("data")), out_specs=spec)
    return jax.jit(fn), (params, x, y)


def megatron_mlp():
    """Forward pass of a Megatron MLP block on a data x model mesh: W1 by columns, W2 by rows."""
    mesh = make_mesh("data=-1,model=2")
    k1, k2, k3 = jax.random.split(jax.random.key(42), 3)
    x = jax.device_put(jax.random.normal(k1, (16, 8)), NamedSharding(mesh, P("data", None)))
    w1 = jax.device_put(jax.random.normal(k2, (8, 32)) / np.sqrt(8), NamedSharding(mesh, P(None, "model")))
    w2 = jax.device_put(jax.random.normal(k3, (32, 8)) / np.sqrt(32), NamedSharding(mesh, P("model", None)))

    @jax.jit
    def block(x, w1, w2):
        h = jax.nn.relu(x @ w1)  # columns of the hidden layer, no communication
        return jnp.matmul(
            h, w2, out_sharding=NamedSharding(mesh, P("data", None))
        )  # partial sums: all-reduce

    return block, (x, w1, w2)


def alltoall_transpose(size: int = 16):
    """Transpose of a row-sharded matrix into a row-sharded result with one all-to-all."""
    mesh = make_mesh("i=-1")
    a = jax.device_put(
        jnp.arange(size * size, dtype=jnp.float32).reshape(size, size), NamedSharding(mesh, P("i"))
    )

    def local(rows):
        cols = lax.all_to_all(rows, "i", split_axis=1, concat_axis=0, tiled=True)
        return cols.T

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("i"), out_specs=P("i"))), (a,)


def halo_exchange(length: int = 64):
    """Three-point stencil over a sharded vector: neighbours' edge values by collective-permute."""
    mesh = make_mesh("i=-1")
    n = mesh.shape["i"]
    x = jax.device_put(jnp.arange(length, dtype=jnp.float32) ** 1.5, NamedSharding(mesh, P("i")))

    def local(seg):
        left = lax.ppermute(seg[-1:], "i", [(j, j + 1) for j in range(n - 1)])
        right = lax.ppermute(seg[:1], "i", [(j + 1, j) for j in range(n - 1)])
        padded = jnp.concatenate([left, seg, right])
        return padded[:-2] + padded[1:-1] + padded[2:]

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("i"), out_specs=P("i"))), (x,)


def pmean_step():
    """``lax.pmean`` over a sharded vector."""
    return _reduce(lambda v: lax.pmean(v, "i"))


def psum_div_step():
    """``lax.psum(...) / N`` over a sharded vector: compiles to the same collectives as pmean."""
    return _reduce(lambda v: lax.psum(v, "i") / jax.lax.axis_size("i"))


def _reduce(body):
    mesh = make_mesh("i=-1")
    v = jax.device_put(jnp.arange(float(mesh.size)), NamedSharding(mesh, P("i")))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P())), (v,)
