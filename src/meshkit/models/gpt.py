"""A small GPT-style decoder (pre-LN, learned positions, untied unembedding) as a plain pytree.

Parameter layout (``L = layers``, ``D = width``, ``V = vocab_size``, ``T = seq_len``, ``F = mlp_ratio * D``)::

    {
        "tok_embed": (V, D),
        "pos_embed": (T, D),
        "blocks": [                                   # a Python list, one dict per layer
            {
                "ln1": {"scale": (D,), "bias": (D,)},
                "attn": {"wq": (D, D), "bq": (D,), "wk": (D, D),
                         "wv": (D, D), "bv": (D,), "wo": (D, D), "bo": (D,)},
                "ln2": {"scale": (D,), "bias": (D,)},
                "mlp": {"w_in": (D, F), "b_in": (F,), "w_out": (F, D), "b_out": (D,)},
            },
            ...
        ],
        "ln_f": {"scale": (D,), "bias": (D,)},
        "unembed": (D, V),
    }

With ``GPTConfig(scan_layers=True)`` (the scanned form) ``"blocks"`` is one dict of the same keys whose
leaves are stacked with a leading layer axis (``wq: (L, D, D)``, ...) and ``apply`` runs ``lax.scan``
over it: one compiled block instead of ``L`` (compile time flat in depth), and the form under which a
ZeRO-3 plan gathers one layer's parameters at a time. Both forms compute the same function from the
same initial values; ``to_scanned`` and ``to_layers`` convert parameters (or optimizer state shaped
like them) between the forms, and ``blocks_form`` tells which one a tree holds. The Python-loop form
marks each block with ``meshkit.layer`` (the hook a plan uses to gather and rematerialize per block).

With ``experts = E > 0`` (a mixture of experts, ``meshkit.plans.moe``) each block's ``"mlp"`` is
replaced by ``"moe": {"router": (D, E), "w_in": (E, D, F), "b_in": (E, F), "w_out": (E, F, D),
"b_out": (E, D)}``: E MLPs of the dense one's shape (logical axis ``"expert"`` first) and a router;
the loss adds ``router_aux_weight`` x the load-balancing loss (``make_loss(cfg, with_aux=True)`` also
returns it and the share of dropped token-slots as metrics).

The columns of wq, wk, wv (and the rows of wo) are ``heads * head_dim = D`` wide, head-major, so sharding
the ``"heads"`` logical axis splits whole heads when the device count divides ``heads``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from meshkit._errors import MeshkitError
from meshkit.models import stack
from meshkit.models.quantize import linear
from meshkit.models.shape import ModelShape
from meshkit.models.stack import blocks_form
from meshkit.models.stack import to_form as to_form  # the forms' converters, as the GPT's API names them
from meshkit.models.stack import to_layers as to_layers
from meshkit.models.stack import to_scanned as to_scanned
from meshkit.models.token_loss import batch_extras, head_loss, loss_of, stage_extras, whole_logits
from meshkit.plans import (
    causal_attention,
    exchange_segments,
    expert_bias,
    expert_dot,
    moe,
    position_rows,
)
from meshkit.spec import PRECISIONS

Params = dict[str, Any]
Axes = tuple[str | None, ...]

# Logical axis names per parameter, keyed by the leaf's dict key (unique across the tree).
_AXES: dict[str, Axes] = {
    "tok_embed": ("vocab", "embed"),
    "pos_embed": ("seq", "embed"),
    "unembed": ("embed", "vocab"),
    "scale": ("embed",),
    "bias": ("embed",),
    "wq": ("embed", "heads"),
    "wk": ("embed", "heads"),
    "wv": ("embed", "heads"),
    "bq": ("heads",),
    "bv": ("heads",),
    "wo": ("heads", "embed"),
    "bo": ("embed",),
    "w_in": ("embed", "mlp"),
    "b_in": ("mlp",),
    "w_out": ("mlp", "embed"),
    "b_out": ("embed",),
    "router": ("embed", None),
}


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class GPTConfig:
    """Sizes and dtypes of a GPT decoder. Hashable, so it can be a static argument of ``jax.jit``."""

    vocab_size: int
    """Number of token ids (e.g. distinct characters for a character-level model)."""
    seq_len: int
    """Maximum context length: rows of the position table; inputs may be shorter."""
    layers: int
    """Number of transformer blocks."""
    width: int
    """Model width D (residual stream size); must be divisible by ``heads``."""
    heads: int
    """Number of attention heads; each has ``head_dim = width // heads``."""
    mlp_ratio: int = 4
    """Hidden MLP size as a multiple of ``width``."""
    dtype: str = "float32"
    """Dtype of the parameters as stored and updated by the optimizer."""
    compute_dtype: str | None = None
    """Dtype of the forward pass (params are cast to it inside ``apply``); ``None`` means ``dtype``."""
    scan_layers: bool = False
    """Stack the blocks' parameters with a leading layer axis and ``lax.scan`` over them."""
    experts: int = 0
    """Mixture of experts: MLPs per layer, a token routed to ``experts_per_token`` of them; 0: a dense MLP."""
    experts_per_token: int = 2
    """Mixture of experts: top-k."""
    capacity_factor: float = 1.25
    """Mixture of experts: an expert takes ``ceil(capacity_factor x T x k / experts)`` slots of a sequence;
    0: dropless (every slot runs)."""
    router_aux_weight: float = 0.01
    """Mixture of experts: weight of the load-balancing loss added to the cross-entropy."""

    def __post_init__(self):
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        if self.experts:
            self.shape()  # ModelShape checks the mixture-of-experts fields (one owner)

    @classmethod
    def from_shape(
        cls,
        shape: ModelShape,
        *,
        precision: str = "fp32",
        scan_layers: bool = False,
        approximate: bool = False,
    ) -> GPTConfig:
        """The GPT of ``shape``: float32 parameters, computing in ``precision``'s dtype. A shape this GPT
        cannot be (a gated MLP, an MLP width that is no multiple of the width) is refused, unless
        ``approximate``: then its MLP is the GPT's two matrices of ``ffn // width`` (at least 1) times
        the width, as the planner's memory model traces it."""
        if not approximate and shape.gated:
            raise MeshkitError(
                f"{shape.name}: meshkit's GPT has no gated (SwiGLU) MLP to compile; predict only"
            )
        if not approximate and shape.ffn % shape.width:
            raise MeshkitError(
                f"{shape.name}: ffn {shape.ffn} is not a multiple of width {shape.width}; predict only"
            )
        return cls(
            vocab_size=shape.vocab,
            seq_len=shape.seq,
            layers=shape.layers,
            width=shape.width,
            heads=shape.heads,
            mlp_ratio=max(shape.ffn // shape.width, 1),
            compute_dtype=PRECISIONS[precision],
            scan_layers=scan_layers,
            experts=shape.experts,
            experts_per_token=shape.experts_per_token,
            capacity_factor=shape.capacity_factor,
        )

    def shape(self, name: str = "gpt") -> ModelShape:
        """This GPT's shape, as the planner describes models."""
        return ModelShape(
            name=name,
            family="gpt",
            layers=self.layers,
            width=self.width,
            heads=self.heads,
            vocab=self.vocab_size,
            seq=self.seq_len,
            ffn=self.mlp_width,
            experts=self.experts,
            experts_per_token=self.experts_per_token,
            capacity_factor=self.capacity_factor,
        )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.width // self.heads

    @property
    def mlp_width(self) -> int:
        """Hidden MLP size F."""
        return self.mlp_ratio * self.width


def _normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype: str) -> jax.Array:
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _layer_norm_params(cfg: GPTConfig) -> dict[str, jax.Array]:
    return {"scale": jnp.ones((cfg.width,), cfg.dtype), "bias": jnp.zeros((cfg.width,), cfg.dtype)}


def _init_block(key: jax.Array, cfg: GPTConfig) -> Params:
    d, f, dt = cfg.width, cfg.mlp_width, cfg.dtype
    resid_std = 0.02 / math.sqrt(2 * cfg.layers)
    kq, kk, kv, ko, kin, kout = jax.random.split(key, 6)
    attn = {
        "wq": _normal(kq, (d, d), 0.02, dt),
        "bq": jnp.zeros((d,), dt),
        "wk": _normal(kk, (d, d), 0.02, dt),
        "wv": _normal(kv, (d, d), 0.02, dt),
        "bv": jnp.zeros((d,), dt),
        "wo": _normal(ko, (d, d), resid_std, dt),
        "bo": jnp.zeros((d,), dt),
    }
    e = (cfg.experts,) if cfg.experts else ()
    mlp = {
        "w_in": _normal(kin, (*e, d, f), 0.02, dt),
        "b_in": jnp.zeros((*e, f), dt),
        "w_out": _normal(kout, (*e, f, d), resid_std, dt),
        "b_out": jnp.zeros((*e, d), dt),
    }
    if not cfg.experts:
        return {"ln1": _layer_norm_params(cfg), "attn": attn, "ln2": _layer_norm_params(cfg), "mlp": mlp}
    router = _normal(jax.random.fold_in(key, 1), (d, cfg.experts), 0.02, dt)
    return {
        "ln1": _layer_norm_params(cfg),
        "attn": attn,
        "ln2": _layer_norm_params(cfg),
        "moe": {"router": router, **mlp},
    }


@functools.partial(jax.jit, static_argnums=1)  # one compiled program, not one per weight drawn
def init(key: jax.Array, cfg: GPTConfig) -> Params:
    """Parameters: weights ~ N(0, 0.02²), residual projections (wo, w_out) scaled by 1/sqrt(2 layers),
    LayerNorm scales ones, biases zeros."""
    k_tok, k_pos, k_un, k_blocks = jax.random.split(key, 4)
    return {
        "tok_embed": _normal(k_tok, (cfg.vocab_size, cfg.width), 0.02, cfg.dtype),
        "pos_embed": _normal(k_pos, (cfg.seq_len, cfg.width), 0.02, cfg.dtype),
        "blocks": stack.layer_blocks(lambda k: _init_block(k, cfg), k_blocks, cfg.layers, cfg.scan_layers),
        "ln_f": _layer_norm_params(cfg),
        "unembed": _normal(k_un, (cfg.width, cfg.vocab_size), 0.02, cfg.dtype),
    }


def _wide(dtype) -> jnp.dtype:
    """The dtype for numerically sensitive steps: at least float32 (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def _layer_norm(p: dict[str, jax.Array], x_btd: jax.Array, eps: float = 1e-5) -> jax.Array:
    """LayerNorm with statistics in at least float32, result in the input dtype."""
    xw_btd = x_btd.astype(_wide(x_btd.dtype))
    mean_bt1 = xw_btd.mean(-1, keepdims=True)
    var_bt1 = jnp.square(xw_btd - mean_bt1).mean(-1, keepdims=True)
    y_btd = ((xw_btd - mean_bt1) * jax.lax.rsqrt(var_bt1 + eps)).astype(x_btd.dtype)
    return y_btd * p["scale"] + p["bias"]


def _attention(
    p: dict[str, jax.Array], x_btd: jax.Array, cfg: GPTConfig, seg: Any = None, attend: Any = None
) -> jax.Array:
    """Causal multi-head self-attention (``seg``: within each token's segment only; ``attend(q, k, v)``:
    over a cache instead, ``decode``); scores and softmax in at least float32."""
    b, t, _ = x_btd.shape
    # No key bias: it adds q.b_k to every score of a query, which softmax cancels, so its gradient
    # is exactly zero and in floating point pure rounding noise (Adam would amplify it to +-lr).
    q_bthk = (linear(x_btd, p["wq"]) + p["bq"]).reshape(b, t, cfg.heads, cfg.head_dim)
    k_bthk = linear(x_btd, p["wk"]).reshape(b, t, cfg.heads, cfg.head_dim)
    v_bthk = (linear(x_btd, p["wv"]) + p["bv"]).reshape(b, t, cfg.heads, cfg.head_dim)
    if attend is None:  # context plans: over the split
        out_bthk = causal_attention(q_bthk, k_bthk, v_bthk, segment_ids=seg)
    else:
        out_bthk = attend(q_bthk, k_bthk, v_bthk)
    return linear(out_bthk.reshape(b, t, cfg.width), p["wo"]) + p["bo"]


def _mlp(p: dict[str, jax.Array], x_btd: jax.Array) -> jax.Array:
    return linear(jax.nn.gelu(linear(x_btd, p["w_in"]) + p["b_in"]), p["w_out"]) + p["b_out"]


def _experts(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """``n`` expert MLPs (leading dim of every leaf) on their rows: ``(n, c, D)`` with capacity, ``(M, D)``
    grouped by expert when dropless (``expert_dot``)."""
    h = jax.nn.gelu(expert_dot(x, p["w_in"]) + expert_bias(p["b_in"]))
    return expert_dot(h, p["w_out"]) + expert_bias(p["b_out"])


def _embed(top: Params, tokens_bt: jax.Array, cfg: GPTConfig, positions_bt: Any = None) -> jax.Array:
    """Token plus position embeddings, in the compute dtype (``top``: the non-block parameters); the
    position rows ``positions_bt`` where given (packed documents), else ``0..T-1``."""
    t = tokens_bt.shape[1]
    if t > cfg.seq_len:
        raise ValueError(f"sequence length {t} exceeds seq_len {cfg.seq_len}")
    compute = cfg.compute_dtype or cfg.dtype
    table = top["pos_embed"].astype(compute)
    # context plans: this device's positions (a batch's positions are split like its tokens)
    pos = position_rows(table, t) if positions_bt is None else table[positions_bt]
    return top["tok_embed"].astype(compute)[tokens_bt] + pos


def _block(p: Params, x_btd: jax.Array, cfg: GPTConfig, seg: Any = None) -> jax.Array:
    """One pre-LN transformer block (``seg``: packed documents' segment ids); casts its own parameters
    (where a plan gathers them per layer)."""
    p = jax.tree.map(lambda a: a.astype(cfg.compute_dtype or cfg.dtype), p)
    x_btd = x_btd + _attention(p["attn"], _layer_norm(p["ln1"], x_btd), cfg, seg)
    return x_btd + _mlp(p["mlp"], _layer_norm(p["ln2"], x_btd))


def _moe_block(
    p: Params, carry: tuple[jax.Array, jax.Array], cfg: GPTConfig, seg: Any = None
) -> tuple[jax.Array, jax.Array]:
    """One block whose MLP is a mixture of experts; ``carry``: the residual and the running
    ``[load-balancing loss, dropped slots]`` summed over the blocks so far."""
    x_btd, stats = carry
    p = jax.tree.map(lambda a: a.astype(cfg.compute_dtype or cfg.dtype), p)
    x_btd = x_btd + _attention(p["attn"], _layer_norm(p["ln1"], x_btd), cfg, seg)
    y_btd, aux, dropped = _mixture(p["moe"], _layer_norm(p["ln2"], x_btd), cfg, cfg.capacity_factor)
    return x_btd + y_btd, stats + jnp.stack([aux, dropped]).astype(stats.dtype)


def _mixture(p: Params, x_btd: jax.Array, cfg: GPTConfig, capacity_factor: float) -> tuple:
    """The mixture of experts of the normalised ``x_btd`` (``p``: a block's ``"moe"``): ``(y, aux, dropped)``."""
    experts = {k: v for k, v in p.items() if k != "router"}
    return moe(
        _experts, experts, p["router"], x_btd, k=cfg.experts_per_token, capacity_factor=capacity_factor
    )


def _head(top: Params, x_btd: jax.Array, cfg: GPTConfig) -> jax.Array:
    """Final LayerNorm and unembedding: logits in at least float32."""
    compute = cfg.compute_dtype or cfg.dtype
    x_btd = _layer_norm(jax.tree.map(lambda a: a.astype(compute), top["ln_f"]), x_btd)
    return jnp.matmul(x_btd, top["unembed"].astype(compute), preferred_element_type=_wide(compute))


def apply(
    params: Params, tokens_bt: jax.Array, cfg: GPTConfig, *, segment_ids: Any = None, positions: Any = None
) -> jax.Array:
    """Next-token logits ``(B, T, V)`` for integer tokens ``(B, T)`` with ``T <= seq_len``; ``segment_ids``
    ``(B, T)``: packed documents (a token attends within its own); ``positions`` ``(B, T)``: the rows of
    the position table each token takes (default ``0..T-1``).

    Parameters are cast to ``cfg.compute_dtype`` first; LayerNorm statistics, attention softmax and the
    returned logits are float32 (float64 when computing in float64).
    """
    return forward(params, tokens_bt, cfg, segment_ids=segment_ids, positions=positions)[0]


def forward(
    params: Params,
    tokens_bt: jax.Array,
    cfg: GPTConfig,
    *,
    segment_ids: Any = None,
    positions: Any = None,
    out: Callable | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(logits, stats)``: ``apply``'s logits and the MoE ``[load-balancing loss, dropped slots]``
    summed over the layers (zeros for a dense model); ``out(head, x)``: what of the last hidden states and
    the head is returned instead of the logits (``make_loss``'s loss)."""
    form = blocks_form(params)
    if (form == "scanned") != cfg.scan_layers:
        fix = "gpt.to_scanned(params)" if cfg.scan_layers else "gpt.to_layers(params)"
        raise ValueError(
            f"params hold the {form} form but cfg.scan_layers={cfg.scan_layers}: convert with {fix}"
        )
    top = {k: v for k, v in params.items() if k != "blocks"}
    x_btd = _embed(top, tokens_bt, cfg, positions)
    x_btd, stats = stack.run_layers(
        lambda p, x, s: _block(p, x, cfg, s),
        lambda p, c, s: _moe_block(p, c, cfg, s),
        x_btd,
        params["blocks"],
        cfg.scan_layers,
        cfg.experts,
        (exchange_segments(segment_ids),),
    )
    return (out or whole_logits)(lambda x: _head(top, x, cfg), x_btd), stats


def decode(
    params: Params, tokens_bt: jax.Array, pos_bt: jax.Array, attend: Callable, cfg: GPTConfig
) -> jax.Array:
    """The logits ``(B, 1, V)`` after the last of ``tokens`` (at rows ``pos`` of the position table), each
    layer ``i`` attending through ``attend(i, q, k, v)`` (over a key/value cache: ``meshkit.models.generate``);
    a mixture of experts dropless."""
    top = {k: v for k, v in params.items() if k != "blocks"}
    compute = cfg.compute_dtype or cfg.dtype
    x_btd = top["tok_embed"].astype(compute)[tokens_bt] + top["pos_embed"].astype(compute)[pos_bt]
    for i, p in enumerate(stack.layer_list(params["blocks"], cfg.scan_layers)):
        p = jax.tree.map(lambda a: a.astype(compute), p)
        x_btd = x_btd + _attention(
            p["attn"], _layer_norm(p["ln1"], x_btd), cfg, attend=functools.partial(attend, i)
        )
        h = _layer_norm(p["ln2"], x_btd)
        x_btd = x_btd + (_mixture(p["moe"], h, cfg, 0.0)[0] if cfg.experts else _mlp(p["mlp"], h))
    return _head(top, x_btd[:, -1:], cfg)


def stages(cfg: GPTConfig) -> Any:
    """The GPT as ``meshkit.Stages`` (embedding, stacked blocks, head, cross-entropy), for pipeline
    plans and every other plan alike; its parameters are the scanned form (``GPTConfig(scan_layers=True)``,
    or ``to_scanned(params)``). The batch is ``(tokens_bt, targets_bt)``."""
    from meshkit.plans import Stages
    from meshkit.spec import one_of, plans_of

    if cfg.experts:
        raise MeshkitError(
            f"pipeline plans do not run mixture-of-experts models yet: use {one_of(plans_of('expert'))}"
        )

    def first(top: Params, batch: Any) -> jax.Array:
        stage_extras(batch)
        return _embed(top, batch[0], cfg)

    return Stages(
        embed=first,
        block=lambda p, x_btd: _block(p, x_btd, cfg),
        head=lambda top, x_btd: _head(top, x_btd, cfg),
        loss=loss_of,
    )


def make_loss(cfg: GPTConfig, *, with_aux: bool = False, loss_chunk: int = 0) -> Callable:
    """``loss(params, batch)``: mean token cross-entropy of the next-token logits (``token_loss``: weighted
    by the batch's weights, packed documents and positions as it gives them, ``meshkit.spec.batch``), plus
    ``router_aux_weight`` x the load-balancing loss for a mixture of experts. ``with_aux``:
    ``(loss, metrics)`` with ``stack.moe_metrics`` (empty for a dense model): a Trainer's ``has_aux=True``.
    ``loss_chunk``: the head and the loss that many positions at a time (``token_loss.head_loss``)."""

    def loss(params: Params, batch: Any) -> Any:
        tokens_bt, targets_bt = batch[0], batch[1]
        weights, seg, pos = batch_extras(batch)
        lossy = lambda h, x: head_loss(h, x, targets_bt, weights, loss_chunk)  # noqa: E731
        value, stats = forward(params, tokens_bt, cfg, segment_ids=seg, positions=pos, out=lossy)
        metrics = (
            stack.moe_metrics(stats, tokens_bt.size, cfg.layers, cfg.experts_per_token) if cfg.experts else {}
        )
        if cfg.experts:
            value = value + cfg.router_aux_weight * metrics["router_aux"]
        return (value, metrics) if with_aux else value

    return loss


def logical_axes(params: Params) -> Any:
    """The same structure as ``params`` with a tuple of logical axis names (or None) per dimension.

    Names: ``"vocab"``, ``"embed"`` (width), ``"heads"`` (the heads*head_dim dimension), ``"mlp"`` (hidden
    MLP dimension), ``"seq"`` (position table rows), ``"layers"`` (the scanned form's stacked axis). Works on arrays or ``jax.ShapeDtypeStruct`` leaves.
    """

    return jax.tree.map_with_path(lambda path, _: stack.leaf_axes(path, _AXES), params)


def matmul_params(cfg: GPTConfig) -> int:
    """Parameter count without the token and position tables, which are lookups rather than matmuls.

    Biases and LayerNorm parameters are included (as nanoGPT does); they are a negligible share. A
    mixture of experts counts the parameters a token multiplies: ``experts_per_token`` MLPs and the router.
    """
    d, f = cfg.width, cfg.mlp_width
    mlp = (d * f + f) + (f * d + d)
    mlp = cfg.experts_per_token * mlp + d * cfg.experts if cfg.experts else mlp
    block = 4 * d * d + 3 * d + mlp + 2 * 2 * d  # q, k, v, o; no key bias
    return cfg.layers * block + 2 * d + d * cfg.vocab_size


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token at a context of ``seq_len`` tokens (the run's sequence; default the
    config's ``seq_len``, a checkpoint's n_positions): ``6 N + 12 L T D`` (PaLM, appendix B).

    ``N = matmul_params(cfg)`` (embedding lookups are not matmuls); ``6 N`` is forward (2 N) plus backward
    (4 N) for the weight matmuls, and ``12 L T D`` the attention score and value matmuls (``Q K^T`` and
    ``P V``, 2 x 2 T D forward per layer, x3 with backward), with no discount for the causal mask.
    """
    t = cfg.seq_len if seq_len is None else seq_len
    return 6 * matmul_params(cfg) + 12 * cfg.layers * t * cfg.width
