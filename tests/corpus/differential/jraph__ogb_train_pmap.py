"""Distilled from google-deepmind/jraph jraph/ogb_examples/train_pmap.py (see SOURCES), lines 171, 177, 221.

An optax init pmapped and called at once on replicated parameters; a
``functools.partial(jax.pmap, axis_name='device')`` update step (value_and_grad with aux,
``pmean`` of gradients, loss and accuracy, optax update); and the loss pmapped for evaluation
through ``functools.partial(compute_loss, net=net)``.
"""

import functools

import jax
import jax.numpy as jnp
import optax


def net(params, graph):
    messages = graph["nodes"][graph["senders"]] @ params["w_msg"]
    nodes = jax.ops.segment_sum(messages, graph["receivers"], num_segments=graph["nodes"].shape[0])
    return jnp.mean(jnp.tanh(nodes) @ params["w_out"], axis=0, keepdims=True)


def compute_loss(params, graph, label, net):
    logits = net(params, graph)
    loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, label))
    accuracy = jnp.mean((logits > 0) == (label > 0.5))
    return loss, accuracy


n = jax.local_device_count()
params = {"w_msg": jnp.ones((3, 4)) * 0.1, "w_out": jnp.ones((4, 1)) * 0.2}
params = jax.tree.map(lambda p: jnp.stack([p] * n), params)
opt_init, opt_update = optax.adam(1e-2)
opt_state = jax.pmap(opt_init)(params)
compute_loss_fn = functools.partial(compute_loss, net=net)


@functools.partial(jax.pmap, axis_name="device")
def update_fn(params, graph, label, opt_state):
    (loss, acc), grad = jax.value_and_grad(compute_loss_fn, has_aux=True)(params, graph, label)
    grad = jax.lax.pmean(grad, axis_name="device")
    updates, opt_state = opt_update(grad, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, jax.lax.pmean(loss, "device"), jax.lax.pmean(acc, "device")


graph = {
    "nodes": jnp.arange(n * 5 * 3.0).reshape(n, 5, 3) / 40,
    "senders": jnp.tile(jnp.array([0, 1, 2, 3]), (n, 1)),
    "receivers": jnp.tile(jnp.array([1, 2, 3, 4]), (n, 1)),
}
label = (jnp.arange(n) % 2).astype(jnp.float32).reshape(n, 1, 1)
out_params, out_opt_state, out_loss, out_acc = update_fn(params, graph, label, opt_state)
evaluate_fn = jax.pmap(functools.partial(compute_loss, net=net))
out_eval = evaluate_fn(out_params, graph, label)
