"""Distilled from vision_transformer__vit_jax__train.py (google-research/vision_transformer, see ../legacy/SOURCES).

``make_update_fn`` returns ``jax.pmap(update_fn, axis_name='batch', donate_argnums=(0,))``; the
learning rate and the step are replicated per device, the rng is a replicated raw key folded
with the device index, and the loss is pmean'd.
"""

import jax
import jax.numpy as jnp
import numpy as np


def make_update_fn():
    def update_fn(params, lr, batch, update_rng):
        update_rng, new_update_rng = jax.random.split(update_rng)
        dropout_rng = jax.random.fold_in(update_rng, jax.lax.axis_index("batch"))

        def loss_fn(p):
            keep = jax.random.bernoulli(dropout_rng, 0.9, batch["x"].shape)
            logits = (batch["x"] * keep) @ p
            return jnp.mean((logits - batch["y"]) ** 2)

        loss, grad = jax.value_and_grad(loss_fn)(params)
        grad = jax.lax.pmean(grad, "batch")
        return params - lr * grad, jax.lax.pmean(loss, "batch"), new_update_rng

    return jax.pmap(update_fn, axis_name="batch", donate_argnums=(0,))


n = jax.local_device_count()
update = make_update_fn()
params = np.zeros((n, 4, 2), np.float32)
lr = np.full((n,), 0.5, np.float32)
batch = {
    "x": np.linspace(-1, 1, n * 3 * 4, dtype=np.float32).reshape(n, 3, 4),
    "y": np.ones((n, 3, 2), np.float32),
}
rng = np.broadcast_to(np.asarray(jax.random.PRNGKey(0)), (n, 2))
losses = []
for _ in range(3):
    params, loss, rng = update(params, lr, batch, rng)
    losses.append(loss)
out = (jax.device_get(params), np.stack(losses), np.asarray(rng))
