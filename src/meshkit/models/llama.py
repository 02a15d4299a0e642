"""A Llama-family decoder (RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no
biases, optionally tied embeddings) as a plain pytree, in the reference GPT's two forms. Three
switches make it the decoders of other families (``docs/families.md``): ``qkv_bias`` (Qwen2),
``qk_norm`` (Qwen3) and ``rope_scaling`` (Llama 3.1's long-context frequencies).

Parameter layout (``L = layers``, ``D = width``, ``V = vocab_size``, ``H = heads``, ``K = kv_heads``,
``h = head_dim``, ``F = ffn``)::

    {
        "tok_embed": (V, D),
        "blocks": [                                   # a Python list, one dict per layer
            {
                "attn_norm": {"scale": (D,)},
                "attn": {"wq": (D, H h), "wk": (D, K h), "wv": (D, K h), "wo": (H h, D),
                         "bq": (H h,), "bk": (K h,), "bv": (K h,),   # qkv_bias only
                         "q_norm": (h,), "k_norm": (h,)},            # qk_norm only
                "mlp_norm": {"scale": (D,)},
                "mlp": {"w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)},
            },
            ...
        ],
        "norm_f": {"scale": (D,)},
        "unembed": (D, V),                            # absent with tie_embeddings: tok_embed.T
    }

With ``experts = E > 0`` each block's ``"mlp"`` is ``"moe": {"router": (D, E), "w_gate": (E, D, F),
"w_up": (E, D, F), "w_down": (E, F, D)}``: E SwiGLU experts and a router (as the GPT's, ``gpt.py``).

``LlamaConfig(scan_layers=True)`` stacks the blocks with a leading layer axis and ``lax.scan``s over
them; ``gpt.to_scanned`` / ``to_layers`` / ``to_form`` / ``blocks_form`` convert any tree with a
``"blocks"`` entry and work here unchanged. The loop form marks each block with ``meshkit.layer``.

Weights follow Hugging Face's ``LlamaForCausalLM`` conventions up to a transpose (``x @ w``
where torch computes ``x @ W.T``): rotary embedding on the two halves of each head
(``rotate_half``), RMSNorm statistics in float32 with the scale applied in the input dtype,
``silu(x w_gate) * (x w_up)``. So ``meshkit.interop`` moves weights in and out by transposing.

Logical axes: ``"heads"`` (query heads x head_dim), ``"kv_heads"`` (key/value heads x head_dim),
``"mlp"``, ``"vocab"``, ``"embed"``; a bias has its weight's output axis, a per-head norm none
(replicated: every head shares it). The default tensor-parallel rules split heads and the MLP, the
key/value heads where they divide over the model axis, and the vocabulary of the embedding and the
head; ``cross_entropy`` is written so that the compiler keeps split logits split.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from meshkit._errors import MeshkitError
from meshkit.models import gpt
from meshkit.models.rope import Llama3Rope, inv_frequencies
from meshkit.models.shape import ModelShape
from meshkit.plans import causal_attention, expert_dot, moe, sequence_positions
from meshkit.spec import PRECISIONS

Params = dict[str, Any]
Axes = tuple[str | None, ...]

_AXES: dict[str, Axes] = {
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
    "bq": ("heads",),
    "bk": ("kv_heads",),
    "bv": ("kv_heads",),
    "q_norm": (None,),
    "k_norm": (None,),
}


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class LlamaConfig:
    """Sizes and dtypes of a Llama decoder. Hashable (a static argument of ``jax.jit``)."""

    vocab_size: int
    """Number of token ids."""
    seq_len: int
    """Longest sequence trained on (rotary positions extend past it; generation may go further)."""
    layers: int
    """Number of transformer blocks."""
    width: int
    """Model width D (residual stream)."""
    heads: int
    """Query heads."""
    kv_heads: int = 0
    """Key/value heads (grouped-query attention; must divide ``heads``); 0 means ``heads``."""
    head_dim: int = 0
    """Width of one head; 0 means ``width // heads``."""
    ffn: int = 0
    """Hidden width of the SwiGLU MLP; 0 means 4 x width."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding's frequencies."""
    rope_scaling: Llama3Rope | None = None
    """Llama 3.1's rescaled frequencies; None: the plain rotary."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2; none on the output projection)."""
    qk_norm: bool = False
    """An RMSNorm over each head's width on the queries and the keys before the rotary (Qwen3)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Use the token embedding (transposed) as the output head; no ``unembed`` leaf."""
    dtype: str = "float32"
    """Dtype of the parameters as stored and updated."""
    compute_dtype: str | None = None
    """Dtype of the forward pass; None means ``dtype``."""
    scan_layers: bool = False
    """Stack the blocks' parameters and ``lax.scan`` over them."""
    experts: int = 0
    """Mixture of experts: SwiGLU MLPs per layer, a token routed to ``experts_per_token``; 0: dense."""
    experts_per_token: int = 2
    """Mixture of experts: top-k."""
    capacity_factor: float = 1.25
    """Mixture of experts: an expert takes ``ceil(capacity_factor x T x k / experts)`` slots of a sequence;
    0: dropless (every slot runs, one grouped matmul per weight)."""
    router_renormalize: bool = False
    """Mixture of experts: the top-k gates divided by their sum (Mixtral; Qwen3-MoE's ``norm_topk_prob``)."""
    router_aux_weight: float = 0.01
    """Mixture of experts: weight of the load-balancing loss added to the cross-entropy."""

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
        if self.heads % self.kv_heads:
            raise MeshkitError(
                f"heads {self.heads} is not divisible by kv_heads {self.kv_heads}: pick kv_heads dividing it"
            )
        if self.head_dim % 2:
            raise MeshkitError(f"head_dim {self.head_dim} is odd: rotary embeddings need an even head width")
        if self.experts:
            self.shape()  # ModelShape checks the mixture-of-experts fields (one owner)

    @classmethod
    def from_shape(
        cls, shape: ModelShape, *, precision: str = "fp32", scan_layers: bool = False
    ) -> LlamaConfig:
        """The Llama of ``shape`` (the planner's presets are these models): float32 parameters,
        computing in ``precision``'s dtype. A shape without a gated MLP is refused."""
        if not shape.gated:
            raise MeshkitError(f"{shape.name}: a Llama has a gated (SwiGLU) MLP; this shape is a GPT")
        return cls(vocab_size=shape.vocab, seq_len=shape.seq, layers=shape.layers, width=shape.width,
                   heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim, ffn=shape.ffn,
                   rope_theta=shape.rope_theta, norm_eps=shape.norm_eps, tie_embeddings=shape.tie_embeddings,
                   compute_dtype=PRECISIONS[precision], scan_layers=scan_layers, experts=shape.experts,
                   experts_per_token=shape.experts_per_token, capacity_factor=shape.capacity_factor)  # fmt: skip

    def shape(self, name: str = "llama") -> ModelShape:
        """This model's shape, as the planner describes models."""
        return ModelShape(name=name, layers=self.layers, width=self.width, heads=self.heads, vocab=self.vocab_size,
                          seq=self.seq_len, ffn=self.ffn, gated=True, kv_heads=self.kv_heads, head_dim=self.head_dim,
                          rope_theta=self.rope_theta, norm_eps=self.norm_eps,
                          tie_embeddings=self.tie_embeddings, experts=self.experts,
                          experts_per_token=self.experts_per_token, capacity_factor=self.capacity_factor)  # fmt: skip

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @property
    def compute(self) -> str:
        return self.compute_dtype or self.dtype


def _normal(key: jax.Array, shape: tuple[int, ...], std: float, dtype: str) -> jax.Array:
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _init_block(key: jax.Array, cfg: LlamaConfig) -> Params:
    d, f, q, kv, dt = cfg.width, cfg.ffn, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.dtype
    resid = 0.02 / math.sqrt(2 * cfg.layers)
    kq, kk, kv_, ko, kg, ku, kd = jax.random.split(key, 7)
    e = (cfg.experts,) if cfg.experts else ()
    mlp = {"w_gate": _normal(kg, (*e, d, f), 0.02, dt), "w_up": _normal(ku, (*e, d, f), 0.02, dt),
           "w_down": _normal(kd, (*e, f, d), resid, dt)}  # fmt: skip
    if cfg.experts:
        mlp = {"router": _normal(jax.random.fold_in(key, 1), (d, cfg.experts), 0.02, dt), **mlp}
    attn = {"wq": _normal(kq, (d, q), 0.02, dt), "wk": _normal(kk, (d, kv), 0.02, dt),
            "wv": _normal(kv_, (d, kv), 0.02, dt), "wo": _normal(ko, (q, d), resid, dt)}  # fmt: skip
    if cfg.qkv_bias:
        attn |= {"bq": jnp.zeros((q,), dt), "bk": jnp.zeros((kv,), dt), "bv": jnp.zeros((kv,), dt)}
    if cfg.qk_norm:
        attn |= {"q_norm": jnp.ones((cfg.head_dim,), dt), "k_norm": jnp.ones((cfg.head_dim,), dt)}
    return {
        "attn_norm": {"scale": jnp.ones((d,), dt)},
        "attn": attn,
        "mlp_norm": {"scale": jnp.ones((d,), dt)},
        "moe" if cfg.experts else "mlp": mlp,
    }  # fmt: skip


@functools.partial(jax.jit, static_argnums=1)  # one program, independent of any mesh
def init(key: jax.Array, cfg: LlamaConfig) -> Params:
    """Weights ~ N(0, 0.02²), the residual projections (wo, w_down) scaled by 1/sqrt(2 layers),
    RMSNorm scales ones, biases zeros."""
    k_tok, k_un, k_blocks = jax.random.split(key, 3)
    blocks = [_init_block(k, cfg) for k in jax.random.split(k_blocks, cfg.layers)]
    out = {
        "tok_embed": _normal(k_tok, (cfg.vocab_size, cfg.width), 0.02, cfg.dtype),
        "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *blocks) if cfg.scan_layers else blocks,
        "norm_f": {"scale": jnp.ones((cfg.width,), cfg.dtype)},
    }
    if not cfg.tie_embeddings:
        out["unembed"] = _normal(k_un, (cfg.width, cfg.vocab_size), 0.02, cfg.dtype)
    return out


def _wide(dtype) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def rms_norm(p: dict[str, jax.Array], x_btd: jax.Array, eps: float) -> jax.Array:
    """RMSNorm: statistics in at least float32, scaled in the input dtype (as Hugging Face's)."""
    xw = x_btd.astype(_wide(x_btd.dtype))
    y = xw * lax.rsqrt(jnp.mean(jnp.square(xw), -1, keepdims=True) + eps)
    return p["scale"] * y.astype(x_btd.dtype)


def rope_tables(pos_bt: jax.Array, cfg: LlamaConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` of shape ``(B, T, 1, head_dim)`` for integer positions, computed in at least
    float32 and cast to ``dtype``."""
    wide = _wide(dtype)
    angles = pos_bt.astype(wide)[..., None] * inv_frequencies(cfg, wide)
    angles = jnp.concatenate([angles, angles], -1)[:, :, None, :]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def _rotate(x_bthk: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x_bthk.shape[-1] // 2
    rotated = jnp.concatenate([-x_bthk[..., half:], x_bthk[..., :half]], -1)
    return x_bthk * cos + rotated * sin


def project_qkv(
    p: dict[str, jax.Array], x_btd: jax.Array, pos_bt: jax.Array, cfg: LlamaConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries ``(B, T, H, h)`` and keys, values ``(B, T, K, h)``: projected (plus their biases), each
    head normalised (``qk_norm``), then rotary positions applied."""
    b, t, _ = x_btd.shape

    def project(w: str, b_: str, heads: int) -> jax.Array:
        y = x_btd @ p[w] + p[b_] if cfg.qkv_bias else x_btd @ p[w]
        return y.reshape(b, t, heads, cfg.head_dim)

    q, k, v = (
        project("wq", "bq", cfg.heads),
        project("wk", "bk", cfg.kv_heads),
        project("wv", "bv", cfg.kv_heads),
    )
    if cfg.qk_norm:
        q = rms_norm({"scale": p["q_norm"]}, q, cfg.norm_eps)
        k = rms_norm({"scale": p["k_norm"]}, k, cfg.norm_eps)
    cos, sin = rope_tables(pos_bt, cfg, x_btd.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def attend(
    p: dict[str, jax.Array],
    q_bthk: jax.Array,
    k_bskh: jax.Array,
    v_bskh: jax.Array,
    mask_bts: jax.Array,
    cfg: LlamaConfig,
) -> jax.Array:
    """Grouped-query attention of ``T`` queries over ``S`` keys where ``mask`` allows, then the
    output projection; scores and softmax in at least float32."""
    b, t = q_bthk.shape[:2]
    wide = _wide(q_bthk.dtype)
    # each key/value head serves ``groups`` query heads: repeated to one per query head, so that a
    # query head's split over the model axis finds its key/value head on the same device
    k = jnp.repeat(k_bskh, cfg.groups, axis=2)
    v = jnp.repeat(v_bskh, cfg.groups, axis=2)
    scores = jnp.einsum("bthk,bshk->bhts", q_bthk, k, preferred_element_type=wide) / math.sqrt(cfg.head_dim)
    scores = jnp.where(mask_bts[:, None], scores, jnp.finfo(wide).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q_bthk.dtype)
    out = jnp.einsum("bhts,bshk->bthk", probs, v).reshape(b, t, cfg.heads * cfg.head_dim)
    return out @ p["wo"]


def mlp(p: dict[str, jax.Array], x_btd: jax.Array) -> jax.Array:
    """SwiGLU: ``(silu(x w_gate) * x w_up) w_down``."""
    return (jax.nn.silu(x_btd @ p["w_gate"]) * (x_btd @ p["w_up"])) @ p["w_down"]


def experts_mlp(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """``n`` SwiGLU experts (leading dim of every leaf) on their rows: ``(n, c, D)`` with capacity,
    ``(M, D)`` grouped by expert when dropless (``expert_dot``)."""
    return expert_dot(jax.nn.silu(expert_dot(x, p["w_gate"])) * expert_dot(x, p["w_up"]), p["w_down"])


def cast_block(p: Params, cfg: LlamaConfig) -> Params:
    return jax.tree.map(lambda a: a.astype(cfg.compute), p)


def causal_mask(t: int) -> jax.Array:
    return jnp.tril(jnp.ones((1, t, t), bool))


def _block(p: Params, x_btd: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """One pre-norm block over a whole causal sequence (positions 0..T-1)."""
    p = cast_block(p, cfg)
    b, t, _ = x_btd.shape
    pos = jnp.broadcast_to(sequence_positions(t), (b, t))  # context plans: this device's positions
    q, k, v = project_qkv(p["attn"], rms_norm(p["attn_norm"], x_btd, cfg.norm_eps), pos, cfg)
    x_btd = x_btd + causal_attention(q, k, v).reshape(b, t, cfg.heads * cfg.head_dim) @ p["attn"]["wo"]
    return x_btd + mlp(p["mlp"], rms_norm(p["mlp_norm"], x_btd, cfg.norm_eps))


def _moe_block(
    p: Params, carry: tuple[jax.Array, jax.Array], cfg: LlamaConfig
) -> tuple[jax.Array, jax.Array]:
    """``_block`` with a mixture of experts for its MLP (``gpt._moe_block``'s carry)."""
    x_btd, stats = carry
    p = cast_block(p, cfg)
    b, t, _ = x_btd.shape
    pos = jnp.broadcast_to(sequence_positions(t), (b, t))
    q, k, v = project_qkv(p["attn"], rms_norm(p["attn_norm"], x_btd, cfg.norm_eps), pos, cfg)
    x_btd = x_btd + causal_attention(q, k, v).reshape(b, t, cfg.heads * cfg.head_dim) @ p["attn"]["wo"]
    experts = {name: w for name, w in p["moe"].items() if name != "router"}
    y_btd, aux, dropped = moe(experts_mlp, experts, p["moe"]["router"], rms_norm(p["mlp_norm"], x_btd, cfg.norm_eps),
                              k=cfg.experts_per_token, capacity_factor=cfg.capacity_factor,
                              renormalize=cfg.router_renormalize)  # fmt: skip
    return x_btd + y_btd, stats + jnp.stack([aux, dropped]).astype(stats.dtype)


def embed(top: Params, tokens_bt: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """Token embeddings in the compute dtype (a lookup: split over the vocabulary, each device
    contributes the rows it holds and the compiler sums them)."""
    return top["tok_embed"].astype(cfg.compute)[tokens_bt]


def head(top: Params, x_btd: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """Final RMSNorm and the output head: logits in at least float32."""
    x_btd = rms_norm(jax.tree.map(lambda a: a.astype(cfg.compute), top["norm_f"]), x_btd, cfg.norm_eps)
    w = top["tok_embed"].T if cfg.tie_embeddings else top["unembed"]
    return jnp.matmul(x_btd, w.astype(cfg.compute), preferred_element_type=_wide(cfg.compute))


def _check_form(params: Params, cfg: LlamaConfig) -> None:
    scanned = not isinstance(params["blocks"], list | tuple)
    if scanned != cfg.scan_layers:
        form = "scanned" if scanned else "layers"
        raise MeshkitError(
            f"params hold the {form} form but cfg.scan_layers={cfg.scan_layers}: convert with gpt.to_form(params, "
            f"{cfg.scan_layers})"
        )
    if cfg.tie_embeddings == ("unembed" in params):
        raise MeshkitError(
            f"params {'have' if 'unembed' in params else 'lack'} an unembed leaf but cfg.tie_embeddings="
            f"{cfg.tie_embeddings}: build the config from the checkpoint's"
        )


def apply(params: Params, tokens_bt: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """Next-token logits ``(B, T, V)`` (at least float32) for integer tokens ``(B, T)``."""
    return forward(params, tokens_bt, cfg)[0]


def forward(params: Params, tokens_bt: jax.Array, cfg: LlamaConfig) -> tuple[jax.Array, jax.Array]:
    """``(logits, stats)``: the logits and the MoE ``[load-balancing loss, dropped slots]`` summed
    over the layers (zeros for a dense model)."""
    _check_form(params, cfg)
    top = {k: v for k, v in params.items() if k != "blocks"}
    x_btd = embed(top, tokens_bt, cfg)

    x_btd, stats = gpt.run_layers(lambda p, x: _block(p, x, cfg), lambda p, c: _moe_block(p, c, cfg), x_btd,
                                  params["blocks"], cfg.scan_layers, cfg.experts)  # fmt: skip
    return head(top, x_btd, cfg), stats


def cross_entropy(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, written so that logits split over the vocabulary stay split:
    every reduction over the vocabulary (the max, the sum of exponentials, the target's logit
    picked by a comparison rather than a gather) is elementwise work plus a reduction, which the
    compiler turns into an all-reduce of one number per token."""
    wide = _wide(logits_btv.dtype)
    logits = logits_btv.astype(wide)
    peak = lax.stop_gradient(jnp.max(logits, -1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(logits - peak), -1)) + peak[..., 0]
    vocab = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    picked = jnp.sum(jnp.where(vocab == targets_bt[..., None], logits, 0.0), -1)
    return jnp.mean(lse - picked)


def make_loss(cfg: LlamaConfig, *, with_aux: bool = False) -> Callable:
    """``loss(params, (tokens_bt, targets_bt))``: mean next-token cross-entropy, plus the weighted
    load-balancing loss for a mixture of experts; ``with_aux``: ``(loss, metrics)`` (``gpt.make_loss``)."""

    def loss(params: Params, batch: tuple[jax.Array, jax.Array]) -> Any:
        logits, stats = forward(params, batch[0], cfg)
        value = cross_entropy(logits, batch[1])
        metrics = (
            gpt.moe_metrics(stats, batch[0].size, cfg.layers, cfg.experts_per_token) if cfg.experts else {}
        )
        if cfg.experts:
            value = value + cfg.router_aux_weight * metrics["router_aux"]
        return (value, metrics) if with_aux else value

    return loss


def stages(cfg: LlamaConfig) -> Any:
    """The model as ``meshkit.Stages`` (embedding, stacked blocks, head, cross-entropy) for pipeline
    plans and every other; its parameters are the scanned form."""
    from meshkit.plans import Stages
    from meshkit.spec import one_of, plans_of

    if cfg.experts:
        raise MeshkitError(
            f"pipeline plans do not run mixture-of-experts models yet: use {one_of(plans_of('expert'))}"
        )
    return Stages(
        embed=lambda top, batch: embed(top, batch[0], cfg),
        block=lambda p, x_btd: _block(p, x_btd, cfg),
        head=lambda top, x_btd: head(top, x_btd, cfg),
        loss=lambda logits, batch: cross_entropy(logits, batch[1]),
    )


def logical_axes(params: Params) -> Any:
    """The structure of ``params`` with a tuple of logical axis names per dimension (``"layers"``
    first on the scanned form's stacked leaves)."""

    return jax.tree.map_with_path(lambda path, _: gpt.leaf_axes(path, _AXES), params)


def units(cfg: LlamaConfig) -> dict[str, int]:
    """Logical axes of whole units: the model axis must divide the query heads; key/value heads
    that do not divide over it stay whole on it (``placement.WHERE_DIVIDES``)."""
    return {"heads": cfg.heads, "kv_heads": cfg.kv_heads}


def matmul_params(cfg: LlamaConfig) -> int:
    """Parameters that multiply activations: every matrix but the embedding lookup (the tied head
    counts once, as a matmul); a mixture of experts those a token multiplies (``experts_per_token``
    MLPs and the router)."""
    d, f, q, kv = cfg.width, cfg.ffn, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    mlp = cfg.experts_per_token * 3 * d * f + d * cfg.experts if cfg.experts else 3 * d * f
    extra = (q + 2 * kv if cfg.qkv_bias else 0) + (2 * cfg.head_dim if cfg.qk_norm else 0)
    block = 2 * d * q + 2 * d * kv + mlp + 2 * d + extra
    return cfg.layers * block + d + d * cfg.vocab_size


def flops_per_token(cfg: LlamaConfig, seq_len: int | None = None) -> int:
    """Training FLOPs per token at a context of ``seq_len`` tokens (the run's sequence; default the
    config's ``seq_len``, which is a checkpoint's max_position_embeddings): ``6 N + 12 L T (H h)``
    (PaLM, appendix B)."""
    t = cfg.seq_len if seq_len is None else seq_len
    return 6 * matmul_params(cfg) + 12 * cfg.layers * t * cfg.heads * cfg.head_dim
