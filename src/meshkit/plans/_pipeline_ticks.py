"""One device's run of a pipeline's schedule table (see ``_pipeline``): a ``lax.scan`` over the clock
ticks, each running this device's action (idle, or the forward or recomputing backward of one
micro-batch through one chunk) under ``lax.switch``, then the two ``lax.ppermute`` that move one
activation to the next stage and one cotangent to the previous one, each tagged with its micro-batch
and destination so that the executed schedule is recorded."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshkit.plans import _schedule
from meshkit.plans._deterministic import TreeAdder
from meshkit.plans._stages import Stages
from meshkit.spec import STAGE


def _perm(p: int, shift: int, ring: bool) -> list[tuple[int, int]]:
    pairs = [(i, i + shift) for i in range(p) if 0 <= i + shift < p]
    if ring and p > 1:
        pairs.append((p - 1, 0) if shift > 0 else (0, p - 1))
    return pairs


class _Ticks:
    """One device's run of the schedule table: a ``lax.scan`` over the clock ticks, each looking up
    this device's action (idle, the forward or the backward of one micro-batch through one chunk)
    and running it under ``lax.switch``, then the two permutes; its carry the activation and
    cotangent buffers with their tags, the gradient accumulators and the loss."""

    def __init__(
        self,
        stages: Stages,
        sched: _schedule.Schedule,
        policy: Any,
        top: Any,
        blocks: Any,
        micro: Any,
        d: Any,
        tree: bool = False,
    ) -> None:
        self.stages, self.sched, self.policy = stages, sched, policy
        self.top, self.blocks, self.micro, self.d = top, blocks, micro, d
        self.p, self.v, self.S = sched.p, sched.v, sched.stages
        self.k = jax.tree.leaves(blocks)[0].shape[0] // sched.v
        self.x_like = jax.eval_shape(stages.embed, top, jax.tree.map(lambda a: a[0], micro))
        self.zeros_x = jnp.zeros(self.x_like.shape, self.x_like.dtype)
        # deterministic mode (``tree``): every micro-batch's loss and gradients summed unscaled in the
        # binary tree, in micro-batch order (each chunk's backwards run in that order), scaled at the end
        self.tree = TreeAdder(sched.m) if tree else None
        self.scale = 1.0 if tree else 1.0 / sched.m
        self.loss_dtype = jnp.promote_types(self.x_like.dtype, jnp.float32)
        self.fwd_perm, self.bwd_perm = _perm(self.p, 1, self.v > 1), _perm(self.p, -1, self.v > 1)

    def run(self) -> tuple[Any, Any, jax.Array, jax.Array]:
        """``(chunk gradients, top gradients, loss, record)`` after every tick."""
        s = self.sched
        table = np.stack([s.kind, s.chunk, s.mb, s.x_read, s.g_read, s.x_write, s.g_write], axis=-1)
        buf = lambda n: jnp.zeros((n + 1, *self.x_like.shape), self.x_like.dtype)  # noqa: E731
        sums = (self.blocks, self.top, jnp.zeros((), self.loss_dtype))
        sums = jax.tree.map(jnp.zeros_like, sums) if self.tree is None else self.tree.zeros(sums)
        carry = (
            buf(s.x_slots),
            jnp.zeros((s.x_slots + 1,), jnp.int32),
            buf(s.g_slots),
            jnp.zeros((s.g_slots + 1,), jnp.int32),
            sums,
        )
        carry, record = lax.scan(self.tick, carry, jnp.asarray(table, jnp.int32))
        sums = carry[4] if self.tree is None else self.tree.total(carry[4])
        return (*sums, record)

    def chunk(self, tree, c):
        return jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, c * self.k, self.k), tree)

    def forward(self, cp, tp, x_in, s, mbatch):
        x = lax.cond(s == 0, lambda: self.stages.embed(tp, mbatch).astype(self.x_like.dtype), lambda: x_in)
        return self.stages.run_blocks(cp, x, self.policy)

    def with_loss(self, cp, tp, x_in, s, mbatch):
        y = self.forward(cp, tp, x_in, s, mbatch)

        def head():
            return (
                jnp.asarray(self.stages.loss(self.stages.head(tp, y), mbatch), self.loss_dtype) * self.scale
            )

        loss = lax.cond(s == self.S - 1, head, lambda: jnp.zeros((), self.loss_dtype))
        return y, loss

    def decode(self, tag):
        return tag // self.S, tag % self.S

    def idle(self, ops):
        zeros_c = jax.tree.map(jnp.zeros_like, self.chunk(self.blocks, 0))
        return (
            self.zeros_x,
            self.zeros_x,
            zeros_c,
            jax.tree.map(jnp.zeros_like, self.top),
            jnp.zeros((), self.loss_dtype),
            jnp.zeros((3,), jnp.int32),
        )

    def fwd(self, ops):
        c, s, j, xbuf, xtag, xr = ops[:6]
        mbatch = jax.tree.map(lambda a: a[j], self.micro)
        y = self.forward(self.chunk(self.blocks, c), self.top, xbuf[xr], s, mbatch)
        got_j, got_s = self.decode(xtag[xr])
        got_j, got_s = jnp.where(s == 0, j, got_j), jnp.where(s == 0, 0, got_s)
        out = self.idle(ops)
        return y, self.zeros_x, out[2], out[3], out[4], jnp.stack([jnp.int32(_schedule.FWD), got_j, got_s])

    def bwd(self, ops):
        c, s, j, xbuf, xtag, xr, gbuf, gtag, gr = ops
        mbatch = jax.tree.map(lambda a: a[j], self.micro)
        (y, loss), vjp = jax.vjp(
            lambda cp, tp, x: self.with_loss(cp, tp, x, s, mbatch),
            self.chunk(self.blocks, c),
            self.top,
            xbuf[xr],
        )
        last = s == self.S - 1
        g = jnp.where(last, jnp.zeros_like(y), gbuf[gr].astype(y.dtype))
        dc, dt, dx = vjp((g, jnp.where(last, 1.0, 0.0).astype(self.loss_dtype)))
        got_j, got_s = self.decode(jnp.where(last, xtag[xr], gtag[gr]))
        if self.S == 1:
            got_j, got_s = j, jnp.int32(0)
        record = jnp.stack([jnp.int32(_schedule.BWD), got_j, got_s])
        return self.zeros_x, dx.astype(self.x_like.dtype), dc, dt, loss, record

    def accumulate(self, sums, kind, c, s, j, dc, dt, loss):
        """Add one tick's gradients and loss: in order (the normal mode: idle and forward ticks add
        zeros), or, deterministic, into the binary tree of a backward tick's micro-batch ``j``: the
        chunk's layers, the embedding and head where this virtual stage uses them, the loss where it
        is computed (the last virtual stage)."""
        k = self.k
        at = lambda a: lax.dynamic_slice_in_dim(a, c * k, k)  # noqa: E731
        put = lambda a, g: lax.dynamic_update_slice_in_dim(a, g, c * k, 0)  # noqa: E731
        if self.tree is None:
            acc_c, acc_t, loss_acc = sums
            acc_c = jax.tree.map(lambda a, g: put(a, at(a) + g), acc_c, dc)
            return acc_c, jax.tree.map(jnp.add, acc_t, dt), loss_acc + loss
        bwd, last = kind == _schedule.BWD, s == self.S - 1
        chunk = self.tree.add(tuple(jax.tree.map(at, level[0]) for level in sums), j, dc, bwd)
        top = self.tree.add(tuple(level[1] for level in sums), j, dt, bwd & ((s == 0) | last))
        losses = self.tree.add(tuple(level[2] for level in sums), j, loss, bwd & last)
        return tuple(
            (jax.tree.map(put, level[0], new), t, lo)
            for level, new, t, lo in zip(sums, chunk, top, losses, strict=True)
        )

    def tick(self, carry, row):
        xbuf, xtag, gbuf, gtag, sums = carry
        p, S, d = self.p, self.S, self.d
        kind, c, j, xr, gr, xw, gw = (row[d, i] for i in range(7))
        s = c * p + d
        send_x, send_g, dc, dt, loss, rec = lax.switch(
            kind, [self.idle, self.fwd, self.bwd], (c, s, j, xbuf, xtag, xr, gbuf, gtag, gr)
        )
        sums = self.accumulate(sums, kind, c, s, j, dc, dt, loss)
        if p > 1 or self.v > 1:
            tag_x = j * S + s + 1  # what the receiver consumes: micro-batch j at virtual stage s + 1
            tag_g = j * S + s - 1
            if p > 1:
                send_x, tag_x = lax.ppermute((send_x, tag_x), STAGE, self.fwd_perm)
                send_g, tag_g = lax.ppermute((send_g, tag_g), STAGE, self.bwd_perm)
            xbuf, xtag = xbuf.at[xw].set(send_x), xtag.at[xw].set(tag_x)
            gbuf, gtag = gbuf.at[gw].set(send_g), gtag.at[gw].set(tag_g)
        return (xbuf, xtag, gbuf, gtag, sums), rec
