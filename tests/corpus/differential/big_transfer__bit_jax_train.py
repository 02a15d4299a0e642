"""Distilled from google-research/big_transfer bit_jax/train.py (see SOURCES), lines 88, 99.

A model's apply function (a static method on a class) pmapped bare for evaluation, and a
``partial(jax.pmap, axis_name='batch')`` update whose learning rate comes in per device; the
gradients averaged with ``pmean`` through ``jax.tree.map``.
"""

from functools import partial

import jax
import jax.numpy as jnp


class ResNet:
    @staticmethod
    def call(params, images):
        h = jax.nn.relu(images.reshape(images.shape[0], -1) @ params["conv"])
        return h @ params["head"]


def cross_entropy_loss(*, logits, labels):
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.sum(logp * labels, axis=1))


def loss_fn(params, images, labels):
    return cross_entropy_loss(logits=ResNet.call(params, images), labels=labels)


resnet_fn_repl = jax.pmap(ResNet.call)


@partial(jax.pmap, axis_name="batch")
def update_fn(opt, lr, batch):
    loss, g = jax.value_and_grad(loss_fn)(opt["target"], batch["image"], batch["label"])
    g = jax.tree.map(lambda x: jax.lax.pmean(x, axis_name="batch"), g)
    momentum = jax.tree.map(lambda m, gg: 0.9 * m + gg, opt["momentum"], g)
    target = jax.tree.map(lambda p, m: p - lr * m, opt["target"], momentum)
    return {"target": target, "momentum": momentum}, jax.lax.pmean(loss, "batch")


n = jax.local_device_count()
params = {"conv": jnp.ones((12, 6)) * 0.05, "head": jnp.ones((6, 3)) * 0.1}
opt = {"target": jax.tree.map(lambda p: jnp.stack([p] * n), params)}
opt["momentum"] = jax.tree.map(jnp.zeros_like, opt["target"])
images = jnp.arange(n * 2 * 12.0).reshape(n, 2, 2, 2, 3) / 100
labels = jax.nn.one_hot(jnp.arange(n * 2).reshape(n, 2) % 3, 3)
out_opt, out_loss = update_fn(opt, jnp.full((n,), 0.1), {"image": images, "label": labels})
out_logits = resnet_fn_repl(out_opt["target"], images)
