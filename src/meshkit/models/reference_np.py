"""NumPy float64 references: linear regression and the MLP with hand-written gradients, Adam and SGD,
and the token families' loss (``token_loss``: the GPT, the Llama and the Gemma of their ``small``
configs, dense and unwindowed-or-windowed as those are) on a token batch with its weights, packed
documents' segment ids and reset positions (``meshkit.spec.batch``).

Parameters use the same pytree layout as :mod:`meshkit.models.linear` (``{"w", "b"}``) and
:mod:`meshkit.models.mlp` (a list of ``{"w", "b"}``), holding float64 NumPy arrays, so a distributed run
can be compared with an exact-arithmetic-like baseline after K optimizer steps. ``jax.tree`` is used only
to walk the structure; every number is computed by NumPy.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np

Layer = dict[str, np.ndarray]


def to_float64(tree: Any) -> Any:
    """Copy any pytree of arrays (JAX or NumPy) to float64 NumPy arrays."""
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def mlp_apply(params: list[Layer], x_bd: np.ndarray) -> np.ndarray:
    """Forward pass: tanh on every hidden layer, linear output."""
    for layer in params[:-1]:
        x_bd = np.tanh(x_bd @ layer["w"] + layer["b"])
    return x_bd @ params[-1]["w"] + params[-1]["b"]


def mlp_loss(params: list[Layer], x_bd: np.ndarray, y_bo: np.ndarray) -> float:
    """Mean squared error over every element."""
    return float(np.mean((mlp_apply(params, x_bd) - y_bo) ** 2))


def mlp_grad(params: list[Layer], x_bd: np.ndarray, y_bo: np.ndarray) -> tuple[float, list[Layer]]:
    """Loss and its gradient by backpropagation."""
    acts = [x_bd]  # the input of each layer
    for layer in params[:-1]:
        acts.append(np.tanh(acts[-1] @ layer["w"] + layer["b"]))
    err_bo = acts[-1] @ params[-1]["w"] + params[-1]["b"] - y_bo
    delta_bo = 2.0 * err_bo / err_bo.size  # d loss / d pre-activation of the current layer
    grads: list[Layer] = []
    for i in reversed(range(len(params))):
        grads.append({"w": acts[i].T @ delta_bo, "b": delta_bo.sum(0)})
        if i:
            delta_bo = (delta_bo @ params[i]["w"].T) * (1.0 - acts[i] ** 2)
    return float(np.mean(err_bo**2)), grads[::-1]


def linear_grad(params: Layer, x_bi: np.ndarray, y_bo: np.ndarray) -> tuple[float, Layer]:
    """Loss and its gradient: ``dw = x^T (2 e / n)``, ``db = sum_b 2 e / n`` with ``e = x w + b - y``."""
    value, (grads,) = mlp_grad([params], x_bi, y_bo)
    return value, grads


class AdamState(NamedTuple):
    """Step count and first and second moment estimates."""

    count: int
    mu: Any
    nu: Any


def adam_init(params: Any) -> AdamState:
    """Zero moments, zero steps."""
    zeros = jax.tree.map(np.zeros_like, params)
    return AdamState(0, zeros, zeros)


def adam_step(
    params: Any,
    grads: Any,
    state: AdamState,
    lr: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> tuple[Any, AdamState]:
    """One ``optax.adam`` step (``eps_root=0``, bias-corrected moments) applied to ``params``."""
    count = state.count + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
    params = jax.tree.map(
        lambda p, m, v: p - lr * (m / (1 - b1**count)) / (np.sqrt(v / (1 - b2**count)) + eps), params, mu, nu
    )
    return params, AdamState(count, mu, nu)


def sgd_momentum_init(params: Any) -> Any:
    """Zero momentum trace."""
    return jax.tree.map(np.zeros_like, params)


def sgd_momentum_step(
    params: Any, grads: Any, trace: Any, lr: float, momentum: float = 0.9
) -> tuple[Any, Any]:
    """One ``optax.sgd(lr, momentum)`` step (heavy ball, not Nesterov): ``t = g + m t``, ``p -= lr t``."""
    trace = jax.tree.map(lambda t, g: g + momentum * t, trace, grads)
    return jax.tree.map(lambda p, t: p - lr * t, params, trace), trace


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _rope(x_bthk: np.ndarray, pos_bt: np.ndarray, theta: float) -> np.ndarray:
    """Rotary positions on the two halves of each head (``rotate_half``)."""
    h = x_bthk.shape[-1]
    angles = pos_bt[..., None].astype(np.float64) / theta ** (np.arange(0, h, 2) / h)
    angles = np.concatenate([angles, angles], -1)[:, :, None, :]
    rotated = np.concatenate([-x_bthk[..., h // 2 :], x_bthk[..., : h // 2]], -1)
    return x_bthk * np.cos(angles) + rotated * np.sin(angles)


def _attend(q, k, v, seg_bt, window=None, softcap=None) -> np.ndarray:
    """Causal attention of ``(B, T, H, h)`` queries over ``(B, T, K, h)`` keys and values, a query seeing
    the keys of its own segment (and the last ``window`` row positions) only."""
    b, t, heads, h = q.shape
    k, v = np.repeat(k, heads // k.shape[2], 2), np.repeat(v, heads // v.shape[2], 2)
    s = np.einsum("bthk,bshk->bhts", q, k) / math.sqrt(h)
    if softcap is not None:
        s = np.tanh(s / softcap) * softcap
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    ok = (i >= j) & ((i - j < window) if window is not None else True)
    ok = ok[None, None] & (seg_bt[:, None, :, None] == seg_bt[:, None, None, :])
    probs = _softmax(np.where(ok, s, -np.inf))
    return np.einsum("bhts,bshk->bthk", probs, v).reshape(b, t, heads * h)


def _layer_norm(p: Layer, x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * p["scale"] + p["bias"]


def _rms(x: np.ndarray, scale: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * scale


def _heads(x: np.ndarray, n: int) -> np.ndarray:
    return x.reshape(*x.shape[:2], n, -1)


def _gpt(params: Any, cfg: Any, tokens, seg, pos) -> np.ndarray:
    x = params["tok_embed"][tokens] + params["pos_embed"][pos]
    for p in params["blocks"]:
        a, y = p["attn"], _layer_norm(p["ln1"], x)
        q, k, v = (
            _heads(y @ a["wq"] + a["bq"], cfg.heads),
            _heads(y @ a["wk"], cfg.heads),
            _heads(y @ a["wv"] + a["bv"], cfg.heads),
        )
        x = x + _attend(q, k, v, seg) @ a["wo"] + a["bo"]
        m = p["mlp"]
        x = x + _gelu_tanh(_layer_norm(p["ln2"], x) @ m["w_in"] + m["b_in"]) @ m["w_out"] + m["b_out"]
    return _layer_norm(params["ln_f"], x) @ params["unembed"]


def _llama(params: Any, cfg: Any, tokens, seg, pos) -> np.ndarray:
    x, eps = params["tok_embed"][tokens], cfg.norm_eps
    for p, window in zip(params["blocks"], cfg.layer_windows, strict=True):
        a, y = p["attn"], _rms(x, p["attn_norm"]["scale"], eps)
        q, k = (
            _rope(_heads(y @ a["wq"], cfg.heads), pos, cfg.rope_theta),
            _rope(_heads(y @ a["wk"], cfg.kv_heads), pos, cfg.rope_theta),
        )
        x = x + _attend(q, k, _heads(y @ a["wv"], cfg.kv_heads), seg, window) @ a["wo"]
        m, y = p["mlp"], _rms(x, p["mlp_norm"]["scale"], eps)
        x = x + (_silu(y @ m["w_gate"]) * (y @ m["w_up"])) @ m["w_down"]
    head = params["tok_embed"].T if cfg.tie_embeddings else params["unembed"]
    return _rms(x, params["norm_f"]["scale"], eps) @ head


def _gemma(params: Any, cfg: Any, tokens, seg, pos) -> np.ndarray:
    eps = cfg.norm_eps
    norm = lambda n, x: _rms(x, 1.0 + n["scale"], eps)  # noqa: E731
    x = params["tok_embed"][tokens] * float(np.float32(math.sqrt(cfg.width)))  # as the model casts it
    for p, local in zip(params["blocks"], cfg.kinds, strict=True):
        a, y = p["attn"], norm(p["attn_norm"], x)
        q, k = (
            _rope(_heads(y @ a["wq"], cfg.heads), pos, cfg.rope_theta),
            _rope(_heads(y @ a["wk"], cfg.kv_heads), pos, cfg.rope_theta),
        )
        q = q * math.sqrt(cfg.head_dim / cfg.query_scalar)
        out = _attend(
            q, k, _heads(y @ a["wv"], cfg.kv_heads), seg, cfg.window if local else None, cfg.attn_softcap
        )
        x = x + norm(p["attn_post_norm"], out @ a["wo"])
        m, y = p["mlp"], norm(p["mlp_norm"], x)
        x = x + norm(p["mlp_post_norm"], (_gelu_tanh(y @ m["w_gate"]) * (y @ m["w_up"])) @ m["w_down"])
    logits = norm(params["norm_f"], x) @ (params["tok_embed"].T if cfg.tie_embeddings else params["unembed"])
    cap = cfg.final_softcap
    return logits if cap is None else np.tanh(logits / cap) * cap


_FORWARDS = {"GPTConfig": _gpt, "LlamaConfig": _llama, "GemmaConfig": _gemma}


def token_logprobs(params: Any, cfg: Any, batch: Any, temperature: float = 1.0) -> np.ndarray:
    """Each target's log-probability ``(B, T)`` under a GPT, Llama or Gemma (``cfg``; the loop form, dense,
    the ``small`` configs' switches: the Gemma's window, soft caps, sandwich norms and tied head) on
    ``batch`` (a pair or a ``TokenBatch``: its segment ids and positions), in float64; of the logits divided
    by ``temperature`` where given (a sampler's, as GRPO's loss reads them)."""
    params = to_float64(params)
    tokens, targets = np.asarray(batch[0]), np.asarray(batch[1])
    _, seg, pos = _extras(batch)
    seg = np.zeros(tokens.shape, np.int64) if seg is None else seg
    pos = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape) if pos is None else pos
    logits = _FORWARDS[type(cfg).__name__](params, cfg, tokens, seg, pos) / temperature
    peak = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - peak).sum(-1)) + peak[..., 0]
    return np.take_along_axis(logits, targets[..., None], -1)[..., 0] - lse


def _extras(batch: Any) -> list[Any]:
    """``(weights, segment_ids, positions)`` of a batch as NumPy arrays (None where absent)."""
    return [None if a is None else np.asarray(a) for a in (tuple(batch[2:5]) + (None,) * 3)[:3]]


def token_loss(params: Any, cfg: Any, batch: Any) -> float:
    """The mean over every token of ``cross-entropy x weight`` (``meshkit.models.token_loss``) of
    ``token_logprobs``' model and batch, in float64."""
    token = -token_logprobs(params, cfg, batch)
    weights = _extras(batch)[0]
    return float(np.mean(token if weights is None else token * weights))
