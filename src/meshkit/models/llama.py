"""A Llama-family decoder (RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases,
optionally tied embeddings) as a plain pytree, in the reference GPT's two forms. Its switches make it
the decoders of other families (``docs/families.md``): ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3),
``rope_scaling`` (long contexts), ``window``/``sliding`` (Mistral, Qwen2), ``post_norms`` and
``qk_norm_whole`` (OLMo 2: leaves ``q_width_norm`` (H h,), ``k_width_norm`` (K h,)), ``rotary_dim``, ``fused``
(Phi-3), ``experts`` (Mixtral, Qwen3-MoE: read dropless, ``capacity_factor=0``, as transformers runs them),
``sinks``, ``o_bias``, ``moe_bias``, ``swiglu_limit`` (GPT-OSS: leaves ``sinks`` (H,), ``bo`` (D,), ``router_bias``,
``b_gate``, ``b_up``, ``b_down``), ``sigmoid_router`` and its groups, ``shared_gate`` (GLM-4.5, DeepSeek-V3's
mixture: leaf ``router_choice_bias``). The config is ``llama_config``'s; the sublayers (norm, projections, rotary,
MLP, experts) are ``llama_layers``'; this module builds blocks of them.

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

Layers of different windows (Qwen2's ``max_window_layers``) run as runs of consecutive layers of one
window each (``llama_windows``); the scanned form holds one window in every layer.

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

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from meshkit._errors import MeshkitError
from meshkit.models import llama_windows, stack
from meshkit.models.llama_config import LlamaConfig as LlamaConfig
from meshkit.models.llama_counts import flops_per_token as flops_per_token
from meshkit.models.llama_counts import matmul_params as matmul_params
from meshkit.models.llama_layers import (
    AXES,
    Params,
    cast_block,
    dropless_ffn,
    experts,
    init_block,
    mlp,
    normal,
    project_qkv,
    residual,
    rms_norm,
    shared_expert,
    token_positions,
    wide,
)
from meshkit.models.quantize import linear
from meshkit.models.rope import LinearRope as LinearRope
from meshkit.models.rope import Llama3Rope as Llama3Rope
from meshkit.models.rope import YarnRope as YarnRope
from meshkit.models.token_loss import batch_extras, head_loss, loss_of, stage_extras, whole_logits
from meshkit.plans import causal_attention, exchange_segments


@functools.partial(jax.jit, static_argnums=1)  # one program, independent of any mesh
def init(key: jax.Array, cfg: LlamaConfig) -> Params:
    """Weights ~ N(0, 0.02²), the residual projections (wo, w_down) scaled by 1/sqrt(2 layers),
    RMSNorm scales ones, biases zeros."""
    k_tok, k_un, k_blocks = jax.random.split(key, 3)
    out = {
        "tok_embed": normal(k_tok, (cfg.vocab_size, cfg.width), 0.02, cfg.dtype),
        "blocks": stack.layer_blocks(
            lambda k, i=None: init_block(k, cfg, i is not None and cfg.dense_layers[i]),
            k_blocks,
            cfg.layers,
            cfg.scan_layers,
            indexed=cfg.dense_layers is not None,
        ),
        "norm_f": {"scale": jnp.ones((cfg.width,), cfg.dtype)},
    }
    if not cfg.tie_embeddings:
        out["unembed"] = normal(k_un, (cfg.width, cfg.vocab_size), 0.02, cfg.dtype)
    return out


def _attention(
    p: Params, x_btd: jax.Array, cfg: LlamaConfig, window: int | None, seg=None, pos=None, attend=None
) -> jax.Array:
    """The residual after the block's attention over its whole causal sequence (``window``: the last
    ``window`` positions of each, itself among them; ``seg``: within each token's segment only; ``pos``:
    the tokens' positions, default ``0..T-1``), or ``attend(q, k, v, window)``'s (over a cache: ``decode``)."""
    b, t, _ = x_btd.shape
    pos = token_positions(x_btd, pos)

    def sublayer(h_btd: jax.Array) -> jax.Array:
        q, k, v = project_qkv(p["attn"], h_btd, pos, cfg)
        sinks = p["attn"].get("sinks")
        out = (
            causal_attention(q, k, v, window=window, segment_ids=seg, sinks=sinks)
            if attend is None
            else attend(q, k, v, window, sinks=sinks)
        )
        y = linear(out.reshape(b, t, cfg.heads * cfg.head_dim), p["attn"]["wo"])
        return y + p["attn"]["bo"] if cfg.o_bias else y

    return residual(p["attn_norm"], x_btd, sublayer, cfg)


def _block(
    p: Params, x_btd: jax.Array, cfg: LlamaConfig, window: int | None, seg=None, pos=None
) -> jax.Array:
    """One pre-norm block over a whole causal sequence (positions ``pos``, default 0..T-1; segments ``seg``)."""
    p = cast_block(p, cfg)
    x_btd = _attention(p, x_btd, cfg, window, seg, pos)
    return residual(p["mlp_norm"], x_btd, lambda h: mlp(p["mlp"], h), cfg)


def _moe_block(
    p: Params, carry: tuple[jax.Array, jax.Array], cfg: LlamaConfig, window: int | None, seg=None, pos=None
) -> tuple[jax.Array, jax.Array]:
    """``_block`` with a mixture of experts for its MLP (``gpt._moe_block``'s carry)."""
    x_btd, stats = carry
    p = cast_block(p, cfg)
    x_btd = _attention(p, x_btd, cfg, window, seg, pos)
    out = {}

    def routed(h_btd: jax.Array) -> jax.Array:
        y_btd, out["aux"], out["dropped"] = experts(p["moe"], h_btd, cfg, cfg.capacity_factor)
        return y_btd + shared_expert(p, h_btd)

    x_btd = residual(p["mlp_norm"], x_btd, routed, cfg)
    return x_btd, stats + jnp.stack([out["aux"], out["dropped"]]).astype(stats.dtype)


def _layers(
    blocks: Any, x_btd: jax.Array, cfg: LlamaConfig, extra: tuple = (None, None)
) -> tuple[jax.Array, jax.Array]:
    """The blocks over ``x_btd`` and the MoE stats summed over them, each run of layers of one window by
    ``stack.run_layers`` (a scan, or a loop marking each block with ``meshkit.layer``); ``extra``: the
    batch's ``(segment_ids, positions)``, each None where absent."""
    stats = None
    for window, dense, lo, hi in llama_windows.runs(cfg):

        def block(p, x, seg, pos, window=window):
            return _block(p, x, cfg, window, seg, pos)

        def moe_block(p, c, seg, pos, window=window):
            return _moe_block(p, c, cfg, window, seg, pos)

        run = blocks if cfg.scan_layers else blocks[lo:hi]
        routed = 0 if dense else cfg.experts
        x_btd, s = stack.run_layers(block, moe_block, x_btd, run, cfg.scan_layers, routed, extra)
        stats = s if stats is None else stats + s
    return x_btd, stats


def embed(top: Params, tokens_bt: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """Token embeddings in the compute dtype (a lookup: split over the vocabulary, each device
    contributes the rows it holds and the compiler sums them)."""
    return top["tok_embed"].astype(cfg.compute)[tokens_bt]


def head(top: Params, x_btd: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """Final RMSNorm and the output head: logits in at least float32."""
    final = jax.tree.map(lambda a: a.astype(cfg.compute), top["norm_f"])
    x_btd = rms_norm(final, x_btd, cfg.norm_eps, wide_scale=cfg.norms_wide)  # OLMo 2's, GPT-OSS's
    w = top["tok_embed"].T if cfg.tie_embeddings else top["unembed"]
    return jnp.matmul(x_btd, w.astype(cfg.compute), preferred_element_type=wide(cfg.compute))


def apply(
    params: Params, tokens_bt: jax.Array, cfg: LlamaConfig, *, segment_ids: Any = None, positions: Any = None
) -> jax.Array:
    """Next-token logits ``(B, T, V)`` (at least float32) for integer tokens ``(B, T)``; ``segment_ids``
    ``(B, T)``: packed documents (a token attends within its own); ``positions`` ``(B, T)``: each token's
    position for the rotary (default ``0..T-1``)."""
    return forward(params, tokens_bt, cfg, segment_ids=segment_ids, positions=positions)[0]


def forward(
    params: Params,
    tokens_bt: jax.Array,
    cfg: LlamaConfig,
    *,
    segment_ids: Any = None,
    positions: Any = None,
    out: Callable | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(logits, stats)``: the logits and the MoE ``[load-balancing loss, dropped slots]`` summed
    over the layers (zeros for a dense model); ``out(head, x)``: what of the last hidden states ``x`` and
    the head is returned instead of the logits (``make_loss``'s loss, ``token_loss.head_loss``)."""
    stack.check_form(params, cfg)
    top = {k: v for k, v in params.items() if k != "blocks"}
    extra = (exchange_segments(segment_ids), positions)  # context plans: the keys' ids, once for every layer
    x_btd, stats = _layers(params["blocks"], embed(top, tokens_bt, cfg), cfg, extra)
    return (out or whole_logits)(lambda x: head(top, x, cfg), x_btd), stats


def decode(
    params: Params, tokens_bt: jax.Array, pos_bt: jax.Array, attend: Callable, cfg: LlamaConfig
) -> jax.Array:
    """The logits ``(B, 1, V)`` after the last of ``tokens`` (at positions ``pos``), each layer ``i``
    attending through ``attend(i, q, k, v, window)`` (over a key/value cache: ``meshkit.models.generate``).
    A mixture of experts runs dropless (every token its k experts, as transformers runs it): a capacity
    counted over a prompt's padding or one new token would be no training run's."""
    top = {k: v for k, v in params.items() if k != "blocks"}
    x_btd = embed(top, tokens_bt, cfg)
    layers = stack.layer_list(params["blocks"], cfg.scan_layers)
    for i, (p, window) in enumerate(zip(layers, cfg.layer_windows, strict=True)):
        p = cast_block(p, cfg)
        x_btd = _attention(p, x_btd, cfg, window, pos=pos_bt, attend=functools.partial(attend, i))
        x_btd = residual(p["mlp_norm"], x_btd, functools.partial(dropless_ffn, p, cfg), cfg)
    return head(top, x_btd[:, -1:], cfg)


def make_loss(cfg: LlamaConfig, *, with_aux: bool = False, loss_chunk: int = 0) -> Callable:
    """``loss(params, batch)``: mean next-token cross-entropy (weighted by the batch's weights, packed
    documents and positions as it gives them: ``meshkit.spec.batch``), plus the weighted load-balancing
    loss for a mixture of experts; ``with_aux``: ``(loss, metrics)`` (``gpt.make_loss``); ``loss_chunk``:
    the head and the loss that many positions at a time (``token_loss.head_loss``)."""

    def loss(params: Params, batch: Any) -> Any:
        weights, seg, pos = batch_extras(batch)
        lossy = lambda h, x: head_loss(h, x, batch[1], weights, loss_chunk)  # noqa: E731
        value, stats = forward(params, batch[0], cfg, segment_ids=seg, positions=pos, out=lossy)
        metrics = (
            stack.moe_metrics(stats, batch[0].size, cfg.sparse_layers, cfg.experts_per_token)
            if cfg.experts
            else {}
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
    if len(set(cfg.layer_windows)) > 1:
        raise MeshkitError(
            f"pipeline plans run one block function in every layer, and this Llama's layers have different "
            f"windows (sliding={cfg.sliding}): use a plan without a stage axis"
        )
    window = cfg.layer_windows[0]

    def first(top: Params, batch: Any) -> jax.Array:
        stage_extras(batch)
        return embed(top, batch[0], cfg)

    return Stages(
        embed=first,
        block=lambda p, x_btd: _block(p, x_btd, cfg, window),
        head=lambda top, x_btd: head(top, x_btd, cfg),
        loss=loss_of,
    )


def logical_axes(params: Params) -> Any:
    """The structure of ``params`` with a tuple of logical axis names per dimension (``"layers"``
    first on the scanned form's stacked leaves)."""

    return jax.tree.map_with_path(lambda path, _: stack.leaf_axes(path, AXES), params)


def units(cfg: LlamaConfig) -> dict[str, int]:
    """Logical axes of whole units: the model axis must divide the query heads; key/value heads
    that do not divide over it stay whole on it (``tp_rules.WHERE_DIVIDES``)."""
    return {"heads": cfg.heads, "kv_heads": cfg.kv_heads}
