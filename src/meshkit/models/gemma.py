"""Google's Gemma decoders (Gemma 1, Gemma 2 and Gemma 3's text model) as a plain pytree, in the
reference GPT's two forms. A family of its own rather than switches of the Llama: every norm differs
(``x * (1 + w)``, computed in float32 and cast after the scale, where the Llama scales in the input
dtype), the embedding is scaled by ``sqrt(width)``, the MLP is GeGLU, Gemma 2 and 3 add a norm after
attention and after the MLP (sandwich norms), and their layers differ from each other: local layers
attend within a sliding window (Gemma 3: with a rotary of their own base), global ones to the whole
past. The Llama's rotary tables (``meshkit.models.rope``) and the families' cross-entropy (``token_loss``) are
reused as they are. The sublayers (norm, rotary tables, projections, attention, MLP) are ``gemma_layers``';
this module builds blocks of them.

Parameter layout (``L = layers``, ``D = width``, ``V = vocab_size``, ``H = heads``, ``K = kv_heads``,
``h = head_dim``, ``F = ffn``)::

    {
        "tok_embed": (V, D),
        "blocks": [                                   # a Python list, one dict per layer
            {
                "attn_norm": {"scale": (D,)},
                "attn": {"wq": (D, H h), "wk": (D, K h), "wv": (D, K h), "wo": (H h, D),
                         "q_norm": (h,), "k_norm": (h,)},            # qk_norm only (Gemma 3)
                "attn_post_norm": {"scale": (D,)},                  # sandwich only (Gemma 2, 3)
                "mlp_norm": {"scale": (D,)},
                "mlp": {"w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)},
                "mlp_post_norm": {"scale": (D,)},                   # sandwich only
            },
            ...
        ],
        "norm_f": {"scale": (D,)},
        "unembed": (D, V),                            # absent with tie_embeddings (every Gemma checkpoint)
    }

A norm's ``scale`` is stored as transformers stores it, the offset from one (initialised to zeros).

Which layers are local is the config's (``local_layers``). The loop form runs each layer as it is. The
scanned form (``scan_layers``) scans over the stacked layers with each layer's kind as scanned data
beside its parameters: the rotary is picked by it and ``causal_attention(windowed=)`` chooses between
the windowed and the global call (each static, fused kernels included; a context split's collectives
outside the choice), so the parameters are still only a scan's inputs and ZeRO-3 gathers them layer
by layer. A pipeline gives a block its parameters only,
so ``stages`` makes a block of one period of the pattern (``Stages.period``: Gemma 2's 2 layers, Gemma
3's 6): each stage holds whole periods.

Queries are scaled by ``query_scalar ** -0.5`` (transformers' ``query_pre_attn_scalar``) by multiplying
them by ``sqrt(head_dim / query_scalar)`` before ``causal_attention``, which divides by ``sqrt(head_dim)``.
Gemma 2's soft caps: on the attention scores (``causal_attention(softcap=)``, written out) and on the
logits (``tanh(logits / cap) * cap`` in at least float32).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshkit._errors import MeshkitError
from meshkit.models import stack
from meshkit.models.gemma_layers import attention, mlp, project_qkv, rms_norm
from meshkit.models.llama_layers import AXES, cast_block, init_attention, normal, token_positions, wide
from meshkit.models.quantize import linear
from meshkit.models.shape import ModelShape
from meshkit.models.token_loss import batch_extras, head_loss, loss_of, stage_extras, whole_logits
from meshkit.plans import exchange_segments, layer
from meshkit.spec import PRECISIONS

Params = dict[str, Any]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class GemmaConfig:
    """Sizes, switches and dtypes of a Gemma decoder (defaults: Gemma 3's text model with every layer
    global). Hashable (a static argument of ``jax.jit``)."""

    vocab_size: int
    """Number of token ids."""
    seq_len: int
    """Longest sequence trained on (a checkpoint's ``max_position_embeddings``)."""
    layers: int
    """Number of transformer blocks."""
    width: int
    """Model width D (residual stream)."""
    heads: int
    """Query heads."""
    kv_heads: int = 0
    """Key/value heads (must divide ``heads``); 0 means ``heads``."""
    head_dim: int = 0
    """Width of one head; 0 means ``width // heads``."""
    ffn: int = 0
    """Hidden width of the GeGLU MLP; 0 means 4 x width."""
    rope_theta: float = 10000.0
    """Base of the global layers' rotary frequencies."""
    rope_factor: float = 1.0
    """Linear rotary scaling of the global layers: their frequencies divided by it (Gemma 3 4B-27B: 8)."""
    local_rope_theta: float = 0.0
    """Base of the local layers' own unscaled rotary (Gemma 3: 10000); 0: they use the global one."""
    query_scalar: float = 0.0
    """Scores scaled by ``query_scalar ** -0.5`` (``query_pre_attn_scalar``); 0 means ``head_dim``."""
    window: int | None = None
    """Keys a local layer's query sees, itself included (``sliding_window``); None: no local layers."""
    local_layers: tuple[bool, ...] = ()
    """Per layer, whether it is local (sliding window, local rotary); () means none is."""
    attn_softcap: float | None = None
    """Gemma 2: attention scores capped by ``tanh(s / cap) * cap``; None: uncapped."""
    final_softcap: float | None = None
    """Gemma 2: logits capped by ``tanh(z / cap) * cap``; None: uncapped."""
    qk_norm: bool = True
    """Gemma 3: an RMSNorm over each head's width on the queries and the keys before the rotary."""
    sandwich: bool = True
    """Gemma 2 and 3: a norm on the attention's and the MLP's outputs too (False: Gemma 1)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_embeddings: bool = True
    """Use the token embedding (transposed) as the output head; no ``unembed`` leaf."""
    dtype: str = "float32"
    """Dtype of the parameters as stored and updated."""
    compute_dtype: str | None = None
    """Dtype of the forward pass; None means ``dtype``."""
    scan_layers: bool = False
    """Stack the blocks' parameters and ``lax.scan`` over them."""
    experts: int = 0
    """Gemma has no mixture of experts: 0 (another value is refused)."""

    def __post_init__(self):
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim == 0:
            if self.width % self.heads:
                raise MeshkitError(
                    f"width {self.width} is not divisible by heads {self.heads}: give head_dim"
                )
            object.__setattr__(self, "head_dim", self.width // self.heads)
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.width)
        if self.query_scalar == 0:
            object.__setattr__(self, "query_scalar", float(self.head_dim))
        if not any(self.local_layers):  # one form for each model: no local layers, no window
            object.__setattr__(self, "local_layers", ())
            object.__setattr__(self, "window", None)
        if not self.local_layers or (self.local_rope_theta == self.rope_theta and self.rope_factor == 1):
            object.__setattr__(self, "local_rope_theta", 0.0)  # the local layers' rotary is the global one
        _check(self)

    @classmethod
    def from_shape(
        cls, shape: ModelShape, *, precision: str = "fp32", scan_layers: bool = False
    ) -> GemmaConfig:
        """The Gemma of ``shape`` (Gemma 3's blocks, every layer global): float32 parameters, computing in
        ``precision``'s dtype. A shape without a gated MLP is refused."""
        if not shape.gated:
            raise MeshkitError(f"{shape.name}: a Gemma has a gated (GeGLU) MLP; this shape is a GPT")
        return cls(
            vocab_size=shape.vocab,
            seq_len=shape.seq,
            layers=shape.layers,
            width=shape.width,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            ffn=shape.ffn,
            rope_theta=shape.rope_theta,
            norm_eps=shape.norm_eps,
            tie_embeddings=shape.tie_embeddings,
            compute_dtype=PRECISIONS[precision],
            scan_layers=scan_layers,
            experts=shape.experts,
        )

    def shape(self, name: str = "gemma") -> ModelShape:
        """This model's shape, as the planner describes models."""
        return ModelShape(
            name=name,
            family="gemma",
            layers=self.layers,
            width=self.width,
            heads=self.heads,
            vocab=self.vocab_size,
            seq=self.seq_len,
            ffn=self.ffn,
            gated=True,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
            tie_embeddings=self.tie_embeddings,
        )

    @property
    def compute(self) -> str:
        return self.compute_dtype or self.dtype

    @property
    def kinds(self) -> tuple[bool, ...]:
        """Per layer, whether it is local."""
        return self.local_layers or (False,) * self.layers

    @property
    def period(self) -> int:
        """Layers after which the pattern of local and global layers repeats (1: every layer alike)."""
        k = self.kinds
        return next(p for p in range(1, self.layers + 1) if all(k[i] == k[i % p] for i in range(self.layers)))


def _check(cfg: GemmaConfig) -> None:
    """Refuse, naming the fix, what no Gemma computes."""
    if cfg.experts:
        raise MeshkitError(f"experts={cfg.experts}: a Gemma has no mixture of experts; give 0")
    if cfg.heads % cfg.kv_heads:
        raise MeshkitError(
            f"heads {cfg.heads} is not divisible by kv_heads {cfg.kv_heads}: pick kv_heads dividing it"
        )
    if cfg.head_dim % 2:
        raise MeshkitError(f"head_dim {cfg.head_dim} is odd: rotary embeddings need an even head width")
    if cfg.local_layers and len(cfg.local_layers) != cfg.layers:
        raise MeshkitError(
            f"local_layers names {len(cfg.local_layers)} layers of {cfg.layers}: give one entry per layer"
        )
    if cfg.local_layers and cfg.window is None:
        raise MeshkitError("local layers need a window (the keys each of their queries sees): give window")
    for name in ("attn_softcap", "final_softcap"):
        value = getattr(cfg, name)
        if value is not None and not 0 < value < math.inf:
            raise MeshkitError(f"{name}={value}: give a cap above 0, or None for no cap")


def _init_block(key: jax.Array, cfg: GemmaConfig) -> Params:
    d, f, dt = cfg.width, cfg.ffn, cfg.dtype
    resid = 0.02 / math.sqrt(2 * cfg.layers)
    kq, kk, kv_, ko, kg, ku, kd = jax.random.split(key, 7)
    attn = init_attention((kq, kk, kv_, ko), cfg, resid)
    if cfg.qk_norm:
        attn |= {"q_norm": jnp.zeros((cfg.head_dim,), dt), "k_norm": jnp.zeros((cfg.head_dim,), dt)}
    norm = lambda: {"scale": jnp.zeros((d,), dt)}  # noqa: E731
    out = {
        "attn_norm": norm(),
        "attn": attn,
        "mlp_norm": norm(),
        "mlp": {
            "w_gate": normal(kg, (d, f), 0.02, dt),
            "w_up": normal(ku, (d, f), 0.02, dt),
            "w_down": normal(kd, (f, d), resid, dt),
        },
    }
    if cfg.sandwich:
        out |= {"attn_post_norm": norm(), "mlp_post_norm": norm()}
    return out


@functools.partial(jax.jit, static_argnums=1)  # one program, independent of any mesh
def init(key: jax.Array, cfg: GemmaConfig) -> Params:
    """Weights ~ N(0, 0.02²), the residual projections (wo, w_down) scaled by 1/sqrt(2 layers), norm
    offsets zeros (a scale of one)."""
    k_tok, k_un, k_blocks = jax.random.split(key, 3)
    out = {
        "tok_embed": normal(k_tok, (cfg.vocab_size, cfg.width), 0.02, cfg.dtype),
        "blocks": stack.layer_blocks(lambda k: _init_block(k, cfg), k_blocks, cfg.layers, cfg.scan_layers),
        "norm_f": {"scale": jnp.zeros((cfg.width,), cfg.dtype)},
    }
    if not cfg.tie_embeddings:
        out["unembed"] = normal(k_un, (cfg.width, cfg.vocab_size), 0.02, cfg.dtype)
    return out


def _block(
    p: Params, x_btd: jax.Array, cfg: GemmaConfig, local: Any, seg: Any = None, pos: Any = None, attend=None
) -> jax.Array:
    """One block over a whole causal sequence (positions ``pos``, default 0..T-1; segments ``seg``): a
    local layer if ``local``; its attention ``attend(q, k, v, window, softcap)``'s where given (over a
    cache: ``decode``)."""
    p = cast_block(p, cfg)
    b, t, _ = x_btd.shape
    pos = token_positions(x_btd, pos)
    q, k, v = project_qkv(p["attn"], rms_norm(p["attn_norm"], x_btd, cfg.norm_eps), pos, cfg, local)
    if attend is None:
        out = attention(q, k, v, cfg, local, seg)
    else:
        out = attend(q, k, v, cfg.window if local else None, cfg.attn_softcap)
    out = linear(out.reshape(b, t, cfg.heads * cfg.head_dim), p["attn"]["wo"])
    if cfg.sandwich:
        out = rms_norm(p["attn_post_norm"], out, cfg.norm_eps)
    x_btd = x_btd + out
    out = mlp(p["mlp"], rms_norm(p["mlp_norm"], x_btd, cfg.norm_eps))
    if cfg.sandwich:
        out = rms_norm(p["mlp_post_norm"], out, cfg.norm_eps)
    return x_btd + out


def run_layers(
    blocks: Any, x_btd: jax.Array, cfg: GemmaConfig, seg: Any = None, pos: Any = None
) -> jax.Array:
    """The blocks in order: a Python loop (each marked ``meshkit.layer``, its kind static), or a
    ``lax.scan`` over the stacked blocks with each layer's kind scanned beside its parameters; ``seg``,
    ``pos``: the batch's segment ids and positions (None: absent)."""
    kinds = cfg.kinds
    if not cfg.scan_layers:
        for p, local in zip(blocks, kinds, strict=True):
            block = lambda p, x, seg, pos, local=local: _block(p, x, cfg, local, seg, pos)  # noqa: E731
            x_btd = layer(block)(p, x_btd, seg, pos)
        return x_btd
    if cfg.period == 1:
        return lax.scan(lambda h, p: (_block(p, h, cfg, kinds[0], seg, pos), None), x_btd, blocks)[0]
    body = lambda h, xs: (_block(xs[0], h, cfg, xs[1], seg, pos), None)  # noqa: E731
    return lax.scan(body, x_btd, (blocks, jnp.asarray(np.array(kinds))))[0]


def embed(top: Params, tokens_bt: jax.Array, cfg: GemmaConfig) -> jax.Array:
    """Token embeddings in the compute dtype times ``sqrt(width)`` (its float32 value cast to the compute
    dtype, as transformers casts it: 55.4256 is 55.5 in bfloat16)."""
    scale = jnp.asarray(np.float32(math.sqrt(cfg.width))).astype(cfg.compute)
    return top["tok_embed"].astype(cfg.compute)[tokens_bt] * scale


def head(top: Params, x_btd: jax.Array, cfg: GemmaConfig) -> jax.Array:
    """Final norm and the output head: logits in at least float32, capped (``final_softcap``)."""
    x_btd = rms_norm(jax.tree.map(lambda a: a.astype(cfg.compute), top["norm_f"]), x_btd, cfg.norm_eps)
    w = top["tok_embed"].T if cfg.tie_embeddings else top["unembed"]
    logits = jnp.matmul(x_btd, w.astype(cfg.compute), preferred_element_type=wide(cfg.compute))
    cap = cfg.final_softcap
    return logits if cap is None else jnp.tanh(logits / cap) * cap


def apply(
    params: Params,
    tokens_bt: jax.Array,
    cfg: GemmaConfig,
    *,
    segment_ids: Any = None,
    positions: Any = None,
    out: Callable | None = None,
) -> jax.Array:
    """Next-token logits ``(B, T, V)`` (at least float32) for integer tokens ``(B, T)``; ``segment_ids``
    ``(B, T)``: packed documents (a token attends within its own); ``positions`` ``(B, T)``: each token's
    position for the rotary (default ``0..T-1``); ``out(head, x)``: what of the last hidden states and the
    head is returned instead of the logits (``make_loss``'s loss)."""
    stack.check_form(params, cfg)
    top = {k: v for k, v in params.items() if k != "blocks"}
    seg = exchange_segments(segment_ids)  # context plans: the keys' ids, once for every layer
    x_btd = run_layers(params["blocks"], embed(top, tokens_bt, cfg), cfg, seg, positions)
    return (out or whole_logits)(lambda x: head(top, x, cfg), x_btd)


def decode(
    params: Params, tokens_bt: jax.Array, pos_bt: jax.Array, attend: Callable, cfg: GemmaConfig
) -> jax.Array:
    """The logits ``(B, 1, V)`` after the last of ``tokens`` (at positions ``pos``), each layer ``i``
    attending through ``attend(i, q, k, v, window, softcap)`` (over a key/value cache:
    ``meshkit.models.generate``): its window on a local layer, the score cap on every layer."""
    top = {k: v for k, v in params.items() if k != "blocks"}
    x_btd = embed(top, tokens_bt, cfg)
    layers = stack.layer_list(params["blocks"], cfg.scan_layers)
    for i, (p, local) in enumerate(zip(layers, cfg.kinds, strict=True)):
        x_btd = _block(p, x_btd, cfg, local, pos=pos_bt, attend=functools.partial(attend, i))
    return head(top, x_btd[:, -1:], cfg)


def make_loss(cfg: GemmaConfig, *, with_aux: bool = False, loss_chunk: int = 0) -> Callable:
    """``loss(params, batch)``: mean next-token cross-entropy (``token_loss``: logits split over the
    vocabulary stay split; weighted by the batch's weights, packed documents and positions as it gives
    them, ``meshkit.spec.batch``); ``with_aux``: ``(loss, {})``; ``loss_chunk``: the head and the loss
    that many positions at a time (``token_loss.head_loss``)."""

    def loss(params: Params, batch: Any) -> Any:
        weights, seg, pos = batch_extras(batch)
        lossy = lambda h, x: head_loss(h, x, batch[1], weights, loss_chunk)  # noqa: E731
        value = apply(params, batch[0], cfg, segment_ids=seg, positions=pos, out=lossy)
        return (value, {}) if with_aux else value

    return loss


def stages(cfg: GemmaConfig) -> Any:
    """The model as ``meshkit.Stages`` for pipeline plans and every other; its parameters are the scanned
    form. A block is one period of the pattern of local and global layers (``Stages.period``), each layer
    of it static: a stage holds whole periods."""
    from meshkit.plans import Stages

    kinds, per = cfg.kinds, cfg.period

    def block(p: Params, x_btd: jax.Array) -> jax.Array:
        if per == 1:
            return _block(p, x_btd, cfg, kinds[0])
        for j in range(per):
            x_btd = _block(jax.tree.map(lambda a, j=j: a[j], p), x_btd, cfg, kinds[j])
        return x_btd

    def first(top: Params, batch: Any) -> jax.Array:
        stage_extras(batch)
        return embed(top, batch[0], cfg)

    return Stages(
        embed=first,
        block=block,
        head=lambda top, x_btd: head(top, x_btd, cfg),
        loss=loss_of,
        period=per,
    )


def logical_axes(params: Params) -> Any:
    """The structure of ``params`` with a tuple of logical axis names per dimension (the Llama's names;
    ``"layers"`` first on the scanned form's stacked leaves)."""
    return jax.tree.map_with_path(lambda path, _: stack.leaf_axes(path, AXES), params)


def units(cfg: GemmaConfig) -> dict[str, int]:
    """Logical axes of whole units: the query heads, and the key/value heads where they divide."""
    return {"heads": cfg.heads, "kv_heads": cfg.kv_heads}


def matmul_params(cfg: GemmaConfig) -> int:
    """Parameters that multiply activations: every matrix but the embedding lookup (the tied head counts
    once, as a matmul), and the norms' scales."""
    d, f, q, kv = cfg.width, cfg.ffn, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    norms = (4 if cfg.sandwich else 2) * d + (2 * cfg.head_dim if cfg.qk_norm else 0)
    return cfg.layers * (2 * d * q + 2 * d * kv + 3 * d * f + norms) + d + d * cfg.vocab_size


def flops_per_token(cfg: GemmaConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token at a context of ``seq_len`` tokens (default the config's ``seq_len``):
    ``6 N + 12 T (H h)`` per global layer (PaLM, appendix B), a local layer's context its window where
    that is shorter."""
    t = cfg.seq_len if seq_len is None else seq_len
    local = min(t, cfg.window) if cfg.window is not None else t
    context = sum(local if kind else t for kind in cfg.kinds)
    return 6 * matmul_params(cfg) + 12 * context * cfg.heads * cfg.head_dim
