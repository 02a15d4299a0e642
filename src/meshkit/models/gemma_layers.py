"""The Gemma family's sublayers (``meshkit.models.gemma``): its RMSNorm (``x * (1 + w)``, scaled in float32),
the local and global layers' rotary tables, the q/k/v projections with their per-head norms and query
scale, causal attention within a local layer's window, and the GeGLU MLP. Kept apart from the model module,
which assembles them into blocks, as the Llama's are (``llama_layers``, whose rotation and ``wide`` these
reuse).

Every function follows transformers' Gemma, Gemma 2 and Gemma 3 text models up to a transpose (``x @ w``
where torch computes ``x @ W.T``). A layer's kind, ``local``, is a Python bool in the loop form and a traced
one in the scanned form (each layer's kind scanned beside its parameters): the functions taking it choose
between both kinds' static computations.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from meshkit.models.llama_layers import rotate, wide
from meshkit.models.quantize import linear
from meshkit.models.rope import inv_frequencies
from meshkit.plans import causal_attention


def rms_norm(p: dict[str, jax.Array], x: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: ``x / rms(x) * (1 + scale)`` in at least float32, cast to the input dtype after
    the scale (transformers' ``GemmaRMSNorm``; the Llama casts before it)."""
    w = wide(x.dtype)
    xw = x.astype(w)
    y = xw * lax.rsqrt(jnp.mean(jnp.square(xw), -1, keepdims=True) + eps)
    return (y * (1 + p["scale"].astype(w))).astype(x.dtype)


class _Rotary(NamedTuple):
    """What ``rope.inv_frequencies`` reads of a config: one rotary's base and width, unscaled."""

    rope_theta: float
    head_dim: int
    rope_scaling: None = None


def rope_tables(pos_bt: jax.Array, cfg: Any, local: bool, dtype) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` of shape ``(B, T, 1, head_dim)`` for the local or the global layers' rotary, computed
    in at least float32 and cast to ``dtype`` (transformers' ``linear`` type divides the frequencies)."""
    w = wide(dtype)
    own = local and cfg.local_rope_theta > 0
    inv = inv_frequencies(_Rotary(cfg.local_rope_theta if own else cfg.rope_theta, cfg.head_dim), w)
    if not own and cfg.rope_factor != 1.0:
        inv = inv / cfg.rope_factor
    angles = pos_bt.astype(w)[..., None] * inv
    angles = jnp.concatenate([angles, angles], -1)[:, :, None, :]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def _rotary(pos_bt: jax.Array, cfg: Any, local: Any, dtype) -> tuple[jax.Array, jax.Array]:
    """The layer's tables: ``local`` a Python bool, or a traced one (the scanned form) choosing between both."""
    if isinstance(local, bool) or cfg.local_rope_theta == 0:
        return rope_tables(pos_bt, cfg, local is True, dtype)
    tables = [rope_tables(pos_bt, cfg, kind, dtype) for kind in (True, False)]
    return tuple(jnp.where(local, a, b) for a, b in zip(*tables, strict=True))


def project_qkv(
    p: dict[str, jax.Array], x_btd: jax.Array, pos_bt: jax.Array, cfg: Any, local: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries ``(B, T, H, h)`` (scaled for ``query_scalar``) and keys, values ``(B, T, K, h)``: projected,
    each head normalised (``qk_norm``), then the layer's rotary applied."""
    b, t, _ = x_btd.shape
    q = linear(x_btd, p["wq"]).reshape(b, t, cfg.heads, cfg.head_dim)
    k = linear(x_btd, p["wk"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    v = linear(x_btd, p["wv"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm({"scale": p["q_norm"]}, q, cfg.norm_eps)
        k = rms_norm({"scale": p["k_norm"]}, k, cfg.norm_eps)
    cos, sin = _rotary(pos_bt, cfg, local, x_btd.dtype)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    if cfg.query_scalar != cfg.head_dim:
        q = q * jnp.asarray(math.sqrt(cfg.head_dim / cfg.query_scalar), q.dtype)
    return q, k, v


def attention(q: jax.Array, k: jax.Array, v: jax.Array, cfg: Any, local: Any, seg: Any = None) -> jax.Array:
    """Causal attention, within the window on a local layer (``local`` traced: ``causal_attention``'s
    ``windowed``, one of two static calls with any collective of a context split outside it), and within
    each token's segment where ``seg`` (packed documents) is given."""
    if isinstance(local, bool):
        return causal_attention(
            q, k, v, window=cfg.window if local else None, segment_ids=seg, softcap=cfg.attn_softcap
        )
    return causal_attention(
        q, k, v, window=cfg.window, segment_ids=seg, softcap=cfg.attn_softcap, windowed=local
    )


def mlp(p: dict[str, jax.Array], x_btd: jax.Array) -> jax.Array:
    """GeGLU: ``(gelu(x w_gate) * x w_up) w_down``, gelu's tanh approximation (``gelu_pytorch_tanh``)."""
    return linear(
        jax.nn.gelu(linear(x_btd, p["w_gate"]), approximate=True) * linear(x_btd, p["w_up"]), p["w_down"]
    )
