"""The Llama family's sublayers (``meshkit.models.llama``): RMSNorm, the q/k/v projections with their
biases, per-head norms and rotary positions, attention over a key/value cache, the SwiGLU MLP and its
experts, and their parameters' logical axes (``AXES``, which the Gemma's share). Kept apart from the model module, which assembles them into blocks, so that the block, the
training forward pass and generation's cached pass (``models/generate.py``) share one definition of
each, and so that neither module outgrows what one reader holds.

Every function follows Hugging Face's ``LlamaForCausalLM`` up to a transpose (``x @ w`` where torch
computes ``x @ W.T``): RMSNorm statistics in float32 with the scale applied in the input dtype, the
rotary on the two halves of each head (``rotate_half``), ``silu(x w_gate) * (x w_up)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from meshkit.models.quantize import linear
from meshkit.models.rope import attention_scaling, inv_frequencies
from meshkit.models.stack import is_router
from meshkit.plans import expert_bias, expert_dot, moe, sequence_positions, sink_softmax

Params = dict[str, Any]
Axes = tuple[str | None, ...]

AXES: dict[str, Axes] = {
    "tok_embed": ("vocab", "embed"),
    "unembed": ("embed", "vocab"),
    "scale": ("embed",),
    "wq": ("embed", "heads"),
    "wk": ("embed", "kv_heads"),
    "wv": ("embed", "kv_heads"),
    "wo": ("heads", "embed"),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "router": ("embed", None),
    "w_shared_gate": ("embed", None),
    "bq": ("heads",),
    "bk": ("kv_heads",),
    "bv": ("kv_heads",),
    "q_norm": (None,),
    "k_norm": (None,),
    "q_width_norm": ("heads",),
    "k_width_norm": ("kv_heads",),
    "bo": ("embed",),
    "sinks": ("heads",),
    "router_bias": (None,),
    "router_choice_bias": (None,),
    "b_gate": ("mlp",),
    "b_up": ("mlp",),
    "b_down": ("embed",),
}
"""Logical axis names of a leaf's dimensions, by its key (``stack.leaf_axes`` adds ``"expert"`` and
``"layers"``): a bias has its weight's output axis, a per-head norm none (every head shares it), a norm over
every head's width at once (OLMo 2's) the heads' axis, as a bias, and so do the heads' sinks (GPT-OSS's, one per
head: split with the heads)."""


def wide(dtype) -> jnp.dtype:
    """At least float32 (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def rms_norm(p: dict[str, jax.Array], x_btd: jax.Array, eps: float, wide_scale: bool = False) -> jax.Array:
    """RMSNorm: statistics in at least float32, scaled in the input dtype (as Hugging Face's Llama), or
    with ``wide_scale`` scaled in float32 and then cast (its OLMo 2's ``Olmo2RMSNorm``)."""
    xw = x_btd.astype(wide(x_btd.dtype))
    y = xw * lax.rsqrt(jnp.mean(jnp.square(xw), -1, keepdims=True) + eps)
    if wide_scale:
        return (p["scale"].astype(xw.dtype) * y).astype(x_btd.dtype)
    return p["scale"] * y.astype(x_btd.dtype)


def token_positions(x_btd: jax.Array, positions_bt: jax.Array | None) -> jax.Array:
    """``(B, T)`` positions of the tokens: the batch's (reset per packed document) where given, else
    ``0..T-1`` of each row (context plans: this device's positions). The Llama's and the Gemma's."""
    b, t = x_btd.shape[:2]
    return jnp.broadcast_to(sequence_positions(t), (b, t)) if positions_bt is None else positions_bt


def rope_tables(pos_bt: jax.Array, cfg: Any, dtype) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` of shape ``(B, T, 1, r)`` for integer positions (``r``: the rotary's width,
    ``rope.rotary_width``), computed in at least float32 and cast to ``dtype``."""
    w = wide(dtype)
    angles = pos_bt.astype(w)[..., None] * inv_frequencies(cfg, w)
    angles = jnp.concatenate([angles, angles], -1)[:, :, None, :]
    scale = attention_scaling(cfg)  # YaRN's factor on both (transformers' attention_scaling), else 1
    if scale == 1.0:
        return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)
    return (jnp.cos(angles) * scale).astype(dtype), (jnp.sin(angles) * scale).astype(dtype)


def rotate(x_bthk: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """The rotary on the two halves of each head's first ``r`` dims (``cos``'s width; ``rotate_half``), the
    rest of the head passed on unturned (transformers' partial rotary, Phi-3's ``apply_rotary_pos_emb``)."""
    r = cos.shape[-1]
    if r < x_bthk.shape[-1]:
        return jnp.concatenate([rotate(x_bthk[..., :r], cos, sin), x_bthk[..., r:]], -1)
    half = r // 2
    rotated = jnp.concatenate([-x_bthk[..., half:], x_bthk[..., :half]], -1)
    return x_bthk * cos + rotated * sin


def project_qkv(
    p: dict[str, jax.Array], x_btd: jax.Array, pos_bt: jax.Array, cfg: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries ``(B, T, H, h)`` and keys, values ``(B, T, K, h)``: projected (plus their biases), each
    head normalised (``qk_norm``) or all heads' width at once (``qk_norm_whole``, OLMo 2's: over a split
    of the heads the compiler sums the statistics), then rotary positions applied."""
    b, t, _ = x_btd.shape

    def project(w: str, b_: str, heads: int, norm: str | None = None) -> jax.Array:
        y = linear(x_btd, p[w]) + p[b_] if cfg.qkv_bias else linear(x_btd, p[w])
        if norm is not None and cfg.qk_norm_whole:
            y = rms_norm({"scale": p[norm]}, y, cfg.norm_eps, wide_scale=True)
        return y.reshape(b, t, heads, cfg.head_dim)

    q, k, v = (
        project("wq", "bq", cfg.heads, "q_width_norm"),
        project("wk", "bk", cfg.kv_heads, "k_width_norm"),
        project("wv", "bv", cfg.kv_heads),
    )
    if cfg.qk_norm:
        q = rms_norm({"scale": p["q_norm"]}, q, cfg.norm_eps)
        k = rms_norm({"scale": p["k_norm"]}, k, cfg.norm_eps)
    cos, sin = rope_tables(pos_bt, cfg, x_btd.dtype)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def attend(
    q_bthk: jax.Array,
    k_bskh: jax.Array,
    v_bskh: jax.Array,
    mask_bts: jax.Array,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query attention ``(B, T, H, h)`` of ``T`` queries over ``S`` keys (a cache) where ``mask``
    allows: scores (capped to ``(-softcap, softcap)`` by ``tanh(s / softcap) * softcap`` where given, before
    the mask, as ``plans.attention`` caps them) and softmax in at least float32, with each head's sink
    (``sinks`` ``(H,)``) in it where given (``plans.sink_softmax``)."""
    b, t, heads, hd = q_bthk.shape
    kv = k_bskh.shape[2]
    w = wide(q_bthk.dtype)
    # each key/value head serves ``heads / kv`` consecutive query heads (transformers' repeat_kv): the queries
    # grouped under their key/value head, the cache read once (repeating it per query head copied the
    # whole cache every decode step); a query head's split over the model axis keeps its key/value head
    # on the same device where the key/value heads divide over it (``generate.kv_sharding``)
    q = q_bthk.reshape(b, t, kv, heads // kv, hd)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k_bskh, preferred_element_type=w) / math.sqrt(hd)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask_bts[:, None, None], scores, jnp.finfo(w).min)
    sink = None if sinks is None else sinks.reshape(kv, heads // kv)[None, :, :, None]
    probs = sink_softmax(scores, sink).astype(q_bthk.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh).reshape(b, t, heads, hd)


def mlp(p: dict[str, jax.Array], x_btd: jax.Array) -> jax.Array:
    """SwiGLU: ``(silu(x w_gate) * x w_up) w_down``."""
    return linear(jax.nn.silu(linear(x_btd, p["w_gate"])) * linear(x_btd, p["w_up"]), p["w_down"])


def experts_mlp(p: dict[str, jax.Array], x: jax.Array, limit: float = 0.0, alpha: float = 1.702) -> jax.Array:
    """``n`` SwiGLU experts (leading dim of every leaf) on their rows: ``(n, c, D)`` with capacity,
    ``(M, D)`` grouped by expert when dropless (``expert_dot``); plus each expert's biases where the leaves
    hold them (``b_gate``, ``b_up``, ``b_down``: GPT-OSS's, ``expert_bias``); ``limit``: ``swiglu``'s clamp."""

    def project(h: jax.Array, w: str, b: str) -> jax.Array:
        y = expert_dot(h, p[w])
        return y + expert_bias(p[b]) if b in p else y

    hidden = swiglu(project(x, "w_gate", "b_gate"), project(x, "w_up", "b_up"), limit, alpha)
    return project(hidden, "w_down", "b_down")


def swiglu(gate: jax.Array, up: jax.Array, limit: float = 0.0, alpha: float = 1.702) -> jax.Array:
    """``silu(gate) * up``, or with ``limit`` GPT-OSS's clamped form (its ``GptOssExperts._apply_gate``): the gate
    capped above at ``limit``, ``up`` clipped to ``[-limit, limit]``, ``(up + 1) gate sigmoid(alpha gate)``."""
    if not limit:
        return jax.nn.silu(gate) * up
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)


def cast_block(p: Params, cfg: Any) -> Params:
    """A block's parameters in the compute dtype."""
    return jax.tree.map(lambda a: a.astype(cfg.compute), p)


def normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype: str) -> jax.Array:
    """N(0, std²) in float32, cast to ``dtype`` (the Llama's and the Gemma's initial weights)."""
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def init_attention(keys: tuple, cfg: Any, resid: float) -> Params:
    """The attention's projections ``wq``, ``wk``, ``wv``, ``wo`` ~ N(0, 0.02²), ``wo`` ~ N(0, resid²) (the
    Llama's and the Gemma's)."""
    d, q, kv, dt = cfg.width, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.dtype
    shapes = {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d)}
    return {
        name: normal(k, shape, resid if name == "wo" else 0.02, dt)
        for k, (name, shape) in zip(keys, shapes.items(), strict=True)
    }


def init_block(key: jax.Array, cfg: Any, dense: bool = False) -> Params:
    """One block's parameters (``meshkit.models.llama``'s layout): weights ~ N(0, 0.02²), the residual
    projections scaled by ``1/sqrt(2 layers)``, norm scales ones, biases zeros; ``dense``: a dense MLP of
    width ``dense_ffn`` in a mixture of experts' layer (``dense_layers``)."""
    routed = cfg.experts and not dense
    d, f = cfg.width, cfg.dense_ffn if cfg.experts and dense else cfg.ffn
    q, kv, dt = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.dtype
    resid = 0.02 / math.sqrt(2 * cfg.layers)
    kq, kk, kv_, ko, kg, ku, kd = jax.random.split(key, 7)
    e = (cfg.experts,) if routed else ()
    mlp = {
        "w_gate": normal(kg, (*e, d, f), 0.02, dt),
        "w_up": normal(ku, (*e, d, f), 0.02, dt),
        "w_down": normal(kd, (*e, f, d), resid, dt),
    }
    if routed:
        mlp = {"router": normal(jax.random.fold_in(key, 1), (d, cfg.experts), 0.02, dt), **mlp}
    if routed and cfg.sigmoid_router:
        mlp["router_choice_bias"] = jnp.zeros((cfg.experts,), dt)
    if routed and cfg.moe_bias:
        e_ = cfg.experts
        mlp |= {"router_bias": jnp.zeros((e_,), dt), "b_gate": jnp.zeros((e_, f), dt)}
        mlp |= {"b_up": jnp.zeros((e_, f), dt), "b_down": jnp.zeros((e_, d), dt)}
    attn = init_attention((kq, kk, kv_, ko), cfg, resid)
    if cfg.o_bias:
        attn["bo"] = jnp.zeros((d,), dt)
    if cfg.sinks:
        attn["sinks"] = normal(jax.random.fold_in(key, 3), (cfg.heads,), 0.02, dt)
    if cfg.qkv_bias:
        attn |= {"bq": jnp.zeros((q,), dt), "bk": jnp.zeros((kv,), dt), "bv": jnp.zeros((kv,), dt)}
    if cfg.qk_norm:
        attn |= {"q_norm": jnp.ones((cfg.head_dim,), dt), "k_norm": jnp.ones((cfg.head_dim,), dt)}
    if cfg.qk_norm_whole:
        attn |= {"q_width_norm": jnp.ones((q,), dt), "k_width_norm": jnp.ones((kv,), dt)}
    block = {
        "attn_norm": {"scale": jnp.ones((d,), dt)},
        "attn": attn,
        "mlp_norm": {"scale": jnp.ones((d,), dt)},
        "moe" if routed else "mlp": mlp,
    }
    if cfg.shared_ffn and routed:
        ks = jax.random.split(jax.random.fold_in(key, 2), 4)
        s = cfg.shared_ffn
        block["shared"] = {
            "w_gate": normal(ks[0], (d, s), 0.02, dt),
            "w_up": normal(ks[1], (d, s), 0.02, dt),
            "w_down": normal(ks[2], (s, d), resid, dt),
        } | ({"w_shared_gate": normal(ks[3], (d, 1), 0.02, dt)} if cfg.shared_gate else {})
    return block


def residual(norm: Params, x_btd: jax.Array, sublayer: Callable, cfg: Any) -> jax.Array:
    """``x`` plus the sublayer: of the normalised ``x`` (pre-norm), or normalised after it (``post_norms``,
    OLMo 2's norm, scaled in float32: ``rms_norm``'s ``wide_scale``, as GPT-OSS's pre-norms with ``wide_norms``)."""
    if cfg.post_norms:
        return x_btd + rms_norm(norm, sublayer(x_btd), cfg.norm_eps, wide_scale=True)
    return x_btd + sublayer(rms_norm(norm, x_btd, cfg.norm_eps, wide_scale=cfg.norms_wide))


def experts(p: Params, x_btd: jax.Array, cfg: Any, capacity_factor: float) -> tuple:
    """The mixture of experts of the normalised ``x_btd`` (``p``: a block's ``"moe"``): ``(y, aux,
    dropped)`` as ``plans.moe`` computes them, at ``capacity_factor`` (0: dropless)."""
    weights = {name: w for name, w in p.items() if not is_router(name)}
    return moe(
        functools.partial(experts_mlp, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha),
        weights,
        p["router"],
        x_btd,
        k=cfg.experts_per_token,
        capacity_factor=capacity_factor,
        renormalize=cfg.router_renormalize,
        router_bias=p.get("router_bias"),
        sigmoid=cfg.sigmoid_router,
        choice_bias=p.get("router_choice_bias"),
        groups=(cfg.expert_groups, cfg.top_groups),
        scale=cfg.routed_scale,
    )


def dropless_ffn(p: Params, cfg: Any, h_btd: jax.Array) -> jax.Array:
    """A block's MLP, or its experts with every token routed (generation's), and any shared expert."""
    if "moe" not in p:
        return mlp(p["mlp"], h_btd)
    return experts(p["moe"], h_btd, cfg, 0.0)[0] + shared_expert(p, h_btd)


def shared_expert(p: Params, h_btd: jax.Array) -> jax.Array:
    """A block's shared expert (Qwen2-MoE's ``shared_expert``, every token through it), gated per token by
    ``sigmoid(h w_shared_gate)`` where it has a gate (DeepSeek's has none); 0 for a block without one."""
    if "shared" not in p:
        return jnp.zeros((), h_btd.dtype)
    s = p["shared"]
    out = mlp({k: w for k, w in s.items() if k != "w_shared_gate"}, h_btd)
    return jax.nn.sigmoid(linear(h_btd, s["w_shared_gate"])) * out if "w_shared_gate" in s else out
