"""Distilled from google-research/multinerf internal/train_utils.py (see SOURCES), lines 341, 391.

A train step pmapped with ``in_axes=(0, 0, 0, None, None, None)`` and ``donate_argnums=(0, 1)``
(state and batch donated; three broadcast scalars), and a render function whose only mapped
input is the rays (``in_axes=(None, None, None, 0)``), its output gathered with ``all_gather``.
"""

import jax
import jax.numpy as jnp


def model_apply(variables, rays, train_frac):
    h = jnp.tanh(rays @ variables["w1"]) * (1.0 + train_frac)
    return {"rgb": jax.nn.sigmoid(h @ variables["w2"]), "distance": jnp.sum(h**2, -1)}


def create_train_step(lr_init):
    def train_step(state, batch, rng, step, train_frac, lr_mult):
        def loss_fn(variables):
            noise = jax.random.normal(rng, batch["rays"].shape) * 1e-3
            out = model_apply(variables, batch["rays"] + noise, train_frac)
            return jnp.mean((out["rgb"] - batch["rgb"]) ** 2)

        loss, grad = jax.value_and_grad(loss_fn)(state["params"])
        grad = jax.lax.pmean(grad, axis_name="batch")
        stats = {"mse": jax.lax.pmean(loss, axis_name="batch"), "step": step}
        new_params = jax.tree.map(lambda p, g: p - lr_init * lr_mult * g, state["params"], grad)
        rng = jax.random.split(rng)[0]
        return {"params": new_params}, stats, rng

    train_pstep = jax.pmap(
        train_step,
        axis_name="batch",
        in_axes=(0, 0, 0, None, None, None),
        donate_argnums=(0, 1),
    )
    return train_pstep


def create_render_fn():
    def render_eval_fn(variables, train_frac, _, rays):
        return jax.lax.all_gather(model_apply(variables, rays, train_frac), axis_name="batch")

    render_eval_pfn = jax.pmap(
        render_eval_fn,
        in_axes=(None, None, None, 0),
        axis_name="batch",
    )
    return render_eval_pfn


n = jax.local_device_count()
variables = {"w1": jnp.ones((3, 5)) * 0.3, "w2": jnp.ones((5, 3)) * 0.2}
state = {"params": jax.tree.map(lambda p: jnp.stack([p] * n), variables)}
batch = {"rays": jnp.arange(n * 4 * 3.0).reshape(n, 4, 3) / 30, "rgb": jnp.full((n, 4, 3), 0.5)}
rngs = jax.random.split(jax.random.PRNGKey(6), n)
out_state, out_stats, out_rng = create_train_step(0.5)(state, batch, rngs, 3, 0.25, 1.0)
out_render = create_render_fn()(variables, 0.5, None, batch["rays"])
