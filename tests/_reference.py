"""One-device references the plan tests compare against: a jitted optax step on one device (in the
parameters' dtype: float64 under ``jax.enable_x64``), and the largest relative difference of two
parameter trees."""

import jax
import numpy as np
import optax


def one_device(loss, params, batch, steps: int, optimizer: optax.GradientTransformation) -> dict:
    """``steps`` updates of ``optimizer`` on ``loss(params, batch)`` on one device, as NumPy arrays."""

    @jax.jit
    def step(p, s, batch):
        updates, s = optimizer.update(jax.grad(loss)(p, batch), s, p)
        return optax.apply_updates(p, updates), s

    state = optimizer.init(params)
    for _ in range(steps):
        params, state = step(params, state, batch)
    return jax.tree.map(np.asarray, params)


def one_device_frozen(loss, params, batch, steps: int, optimizer, trainable) -> dict:
    """``one_device`` training only the leaves whose path (``a/b/c``) ``trainable`` accepts, the rest
    closed over as constants."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    mask = [trainable("/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p)) for p, _ in flat]
    leaves = [x for _, x in flat]

    def full(train):
        it = iter(train)
        return jax.tree.unflatten(treedef, [next(it) if m else x for x, m in zip(leaves, mask, strict=True)])

    train = one_device(lambda t, b: loss(full(t), b), [x for x, m in zip(leaves, mask, strict=True) if m],
                       batch, steps, optimizer)  # fmt: skip
    return jax.tree.map(np.asarray, full(train))


def max_rel(a, b) -> float:
    """The largest ``max |a - b| / max |b|`` over the leaves of two trees (b the reference)."""
    out = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out = max(out, float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) or 1.0)))
    return out
