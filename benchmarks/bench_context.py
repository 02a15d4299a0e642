"""Context-parallel attention: meshkit's ring and all-to-all forms beside hand-written shard_maps.

On 8 simulated CPU devices (``context=8``), the gradient of ``sum(attention(q, k, v) * w)`` over a
sequence split in meshkit's balanced order (device i holds chunks i and 2N-1-i), in four variants:

- ``meshkit ring``: ``meshkit.plans.causal_attention`` under the context split (``plans._context``):
  K/V passed by ``ppermute``, online softmax, after the diagonal block half a block per step
  (``lax.cond`` picks which half: the causal load balancing);
- ``hand ring``: the textbook ring a user writes in ``jax.shard_map``: the same layout, ppermutes
  and online softmax, but every step a full block masked by global positions (no skipped halves);
- ``meshkit all-to-all`` and ``hand all-to-all``: Ulysses, sequence split -> head split by
  ``all_to_all``, dense causal attention over the whole sequence, and back; the hand one written
  directly in ``jax.shard_map``.

Before timing, each hand variant's output and gradients are checked against meshkit's (``allclose``);
a mismatch prints MISMATCH and exits 1. Printed per variant: median step time over rounds, the
ratio to the hand-written one, and the compiled temporaries per device (``memory_analysis``).

Run::

    .venv/bin/python benchmarks/bench_context.py [--seq 2048] [--heads 8] [--head-dim 32] [--rounds 10]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from meshkit.plans import _context
from meshkit.spec import CONTEXT


def _hand_ring(q, k, v, n):
    """Textbook ring attention over the balanced layout: full masked blocks every step."""
    t = q.shape[1]
    i = lax.axis_index(CONTEXT)
    c = t // 2

    def pos(d):
        return jnp.concatenate([d * c + jnp.arange(c), (2 * n - 1 - d) * c + jnp.arange(c)])

    qpos = pos(i)
    o = jnp.zeros(q.shape, jnp.float32)
    m = jnp.full((q.shape[0], q.shape[2], t), -jnp.inf)
    s = jnp.zeros((q.shape[0], q.shape[2], t))
    for step in range(n):
        if step:
            k, v = (lax.ppermute(x, CONTEXT, [(d, (d + 1) % n) for d in range(n)]) for x in (k, v))
        kpos = pos((i - step) % n)
        sc = jnp.einsum("bthk,bshk->bhts", q, k) / math.sqrt(q.shape[-1])
        sc = jnp.where(qpos[:, None] >= kpos[None, :], sc, -jnp.inf)
        mb = jnp.maximum(m, sc.max(-1))
        p = jnp.exp(sc - mb[..., None])
        a = jnp.exp(m - mb)
        o = o * jnp.swapaxes(a, 1, 2)[..., None] + jnp.einsum("bhts,bshk->bthk", p, v)
        s, m = s * a + p.sum(-1), mb
    return o / jnp.swapaxes(s, 1, 2)[..., None]


def _hand_ulysses(q, k, v, n):
    """Ulysses by hand: all_to_all to heads, dense causal attention in the balanced order, back."""
    q, k, v = (lax.all_to_all(x, CONTEXT, 2, 1, tiled=True) for x in (q, k, v))
    pos = jnp.asarray(_context.balanced_order(q.shape[1], n))
    sc = jnp.einsum("bthk,bshk->bhts", q, k) / math.sqrt(q.shape[-1])
    sc = jnp.where(pos[:, None] >= pos[None, :], sc, -jnp.inf)
    out = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(sc, -1), v)
    return lax.all_to_all(out, CONTEXT, 1, 2, tiled=True)


def _meshkit(form, n):
    def attend(q, k, v, _n):
        with _context.split_sequence(n, form):
            return _context.causal_attention(q, k, v)

    return attend


def _step(attend, mesh, n):
    """jit of the gradient of ``sum(attend(q, k, v) * w)`` wrt q, k, v, sequence split over context."""
    spec = P(None, CONTEXT)

    def local(q, k, v, w):
        def f(q, k, v):
            return lax.psum(jnp.sum(attend(q, k, v, n) * w), CONTEXT)

        return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

    region = jax.shard_map(
        local, mesh=mesh, in_specs=(spec,) * 4, out_specs=(P(), (spec,) * 3), check_vma=False
    )
    return jax.jit(region)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    n = 8
    mesh = jax.make_mesh((n,), (CONTEXT,), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    q, k, v, w = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(4))
    variants = {
        "hand ring": _hand_ring,
        "meshkit ring": _meshkit("ring", n),
        "hand all-to-all": _hand_ulysses,
        "meshkit all-to-all": _meshkit("all-to-all", n),
    }
    results, bad = {}, False
    for name, attend in variants.items():
        step = _step(attend, mesh, n)
        compiled = step.lower(q, k, v, w).compile()
        out = jax.block_until_ready(compiled(q, k, v, w))
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v, w))
            times.append(time.perf_counter() - start)
        results[name] = (out, float(np.median(times)), compiled.memory_analysis().temp_size_in_bytes)
    for form in ("ring", "all-to-all"):
        hand, ours = results[f"hand {form}"], results[f"meshkit {form}"]
        for a, b in zip(jax.tree.leaves(hand[0]), jax.tree.leaves(ours[0]), strict=True):
            if not np.allclose(a, b, rtol=2e-4, atol=2e-4):
                print(f"MISMATCH {form}: max |diff| {float(np.max(np.abs(a - b))):.3g}")
                bad = True
        print(f"{form:>10}: meshkit {ours[1] * 1e3:8.2f} ms  hand {hand[1] * 1e3:8.2f} ms  ratio "
              f"{ours[1] / hand[1]:.2f}   temporaries meshkit {ours[2] / 2**20:.1f} MiB  hand "
              f"{hand[2] / 2**20:.1f} MiB")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
