"""Distilled from jax__docs__jax-101__06-parallelism.py (google/jax docs, see ../legacy/SOURCES).

Immediately called pmaps (also nested in one call), in_axes=(0, None), a psum over a named axis,
and the data-parallel linear regression step with replicated params and pmean'd gradients.
The short-axis call is the same convolution over 4 rows on 8 devices (pmap allows it).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

x = np.arange(5)
w = np.array([2.0, 3.0, 4.0])


def convolve(x, w):
    output = []
    for i in range(1, len(x) - 1):
        output.append(jnp.dot(x[i - 1 : i + 2], w))
    return jnp.array(output)


n_devices = jax.local_device_count()
xs = np.arange(5 * n_devices).reshape(-1, 5)
ws = np.stack([w] * n_devices)
out_conv = jax.pmap(convolve)(xs, ws)
out_twice = jax.pmap(convolve)(xs, jax.pmap(convolve)(xs, ws))
out_broadcast = jax.pmap(convolve, in_axes=(0, None))(xs, w)
out_short = jax.pmap(convolve)(xs[:4], ws[:4])


def normalized_convolution(x, w):
    output = []
    for i in range(1, len(x) - 1):
        output.append(jnp.dot(x[i - 1 : i + 2], w))
    output = jnp.array(output)
    return output / jax.lax.psum(output, axis_name="p")


out_normalized = jax.pmap(normalized_convolution, axis_name="p")(xs, ws)

LEARNING_RATE = 0.005


def loss_fn(params, xs, ys):
    pred = xs @ params["weight"] + params["bias"]
    return jnp.mean((pred - ys) ** 2)


@functools.partial(jax.pmap, axis_name="num_devices")
def update(params, xs, ys):
    loss, grads = jax.value_and_grad(loss_fn)(params, xs, ys)
    grads = jax.lax.pmean(grads, axis_name="num_devices")
    loss = jax.lax.pmean(loss, axis_name="num_devices")
    new_params = jax.tree.map(lambda param, g: param - g * LEARNING_RATE, params, grads)
    return new_params, loss


data_x = np.linspace(-1.0, 1.0, 128, dtype=np.float32).reshape(128, 1)
data_y = data_x * 2 - 1 + 0.1 * np.cos(7 * data_x)
params = {"weight": jnp.ones((1, 1)), "bias": jnp.zeros(())}
replicated_params = jax.tree.map(lambda x: jnp.array([x] * n_devices), params)


def split(arr):
    return arr.reshape(n_devices, arr.shape[0] // n_devices, *arr.shape[1:])


losses = []
for _ in range(3):
    replicated_params, loss = update(replicated_params, split(data_x), split(data_y))
    losses.append(loss[0])
out_params = jax.device_get(jax.tree.map(lambda x: x[0], replicated_params))
out_losses = np.asarray(losses)
