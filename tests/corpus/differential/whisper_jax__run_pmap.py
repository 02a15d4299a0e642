"""Distilled from sanchit-gandhi/whisper-jax benchmarks/run_pmap.py (see SOURCES), line 29.

Generation pmapped with the axis name given positionally (``jax.pmap(generate_fn, "batch")``);
the replicated parameters are closed over, not passed (each device reads the stacked copy).
"""

import jax
import jax.numpy as jnp

NUM_TOKENS = 4
n = jax.local_device_count()
params = {"emb": jnp.arange(7 * 3.0).reshape(7, 3) / 20, "out": jnp.ones((3, 7)) * 0.3}
params = jax.tree.map(lambda p: jnp.stack([p] * n), params)  # flax's jax_utils.replicate


def generate(batch, params, max_new_tokens):
    def step(tokens, _):
        logits = params["emb"][0][tokens[:, -1]] @ params["out"][0] + batch.mean()
        nxt = jnp.argmax(logits, -1)
        return jnp.concatenate([tokens[:, 1:], nxt[:, None]], axis=1), nxt

    _, seq = jax.lax.scan(step, jnp.zeros((batch.shape[0], 2), jnp.int32), None, length=max_new_tokens)
    return seq.T


def generate_fn(batch):
    return generate(batch, params=params, max_new_tokens=NUM_TOKENS)


p_generate_fn = jax.pmap(generate_fn, "batch")
out = p_generate_fn(jnp.arange(n * 2 * 5.0).reshape(n, 2, 5) / 10)
