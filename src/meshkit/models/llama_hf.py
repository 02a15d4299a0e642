"""The Llama family's Hugging Face format: one row per ``model_type`` it reads (``TYPES``, in ``llama_hf_types``:
Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, Qwen2-MoE, Phi-3, OLMo 2, GPT-OSS, GLM-4.5), each naming the
switches of ``meshkit.models.llama.LlamaConfig`` it sets (``qkv_bias``, ``qk_norm``, OLMo 2's norms after the
sublayers and over the heads' whole width, Phi-3's fused tensors and partial rotary, GPT-OSS's sinks and biases,
a mixture of experts), how its window reads, its defaults, and the ``config.json`` fields it may hold. A field
that no row names and that is not Hugging Face's own metadata (``family.HF_METADATA``) is refused by name:
meshkit reads only what it computes, so that a checkpoint it reads is the model transformers runs.

Rotary settings read and write as ``llama_hf_rope`` says, sliding windows as ``llama_hf_windows`` (as
transformers' ``masking_utils`` runs them: a query sees the keys ``q - k < sliding_window``, itself among them), a
mixture of experts (its fields and its tensors' names) as ``llama_hf_experts`` does, GPT-OSS's own rules as
``llama_hf_oss``.

Weights move by name, transpose, column range and stacking only: ``meshkit.models.llama`` follows
``LlamaForCausalLM``'s conventions (the other types' are its, plus biases, per-head norms, experts).
"""

from __future__ import annotations

from typing import Any

from meshkit._errors import MeshkitError
from meshkit.models import llama_hf_experts, llama_hf_oss, llama_hf_rope, llama_hf_windows
from meshkit.models.family import (
    HF_METADATA,
    NO_SPECIAL,
    InteropError,
    Names,
    Source,
    check_fields,
    check_values,
    flag,
    positive,
    whole,
    whole_or_null,
)
from meshkit.models.llama_hf_rope import PARTIAL
from meshkit.models.llama_hf_types import TYPES as TYPES
from meshkit.models.llama_hf_types import Type


def _llama() -> Any:
    from meshkit.models import llama

    return llama


_READ = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "tie_word_embeddings",
    }
)
"""Fields every row reads."""
_CHECKED = (("hidden_act", "silu"), ("attention_dropout", 0.0), ("pruned_heads", {}))
"""Fields every row may hold with the one value meshkit computes."""
_IGNORED = frozenset({"pretraining_tp"})
_ORIGINAL = "original_max_position_embeddings"
"""Fields that change no output: Llama 2's ``pretraining_tp`` split a matmul in older transformers."""


def _fields(row: Type) -> frozenset[str]:
    """Every field a row reads."""
    own = llama_hf_experts.fields(row.experts) | ({_ORIGINAL} if row.phi else set())
    own |= {PARTIAL} if row.partial is not None else set()
    own |= {f for f in (row.qkv_bias, row.qk_norm) if isinstance(f, str)}
    own |= llama_hf_oss.FIELDS if row.oss else set()
    return (
        _READ
        | set(llama_hf_windows.WINDOWS[row.window])
        | {k for k, _ in row.wants + _CHECKED}
        | _IGNORED
        | own
    )


def read(data: dict, where: str, scan_layers: bool) -> Any:
    """meshkit's Llama of a Llama-family ``config.json`` (any model type of ``TYPES``)."""
    kind = data["model_type"]
    row = TYPES[kind]
    if row.oss:  # before the fields: its quantized experts are refused by what they are
        data = llama_hf_oss.read(data, where)
    check_fields(data, where, _fields(row) | HF_METADATA, f"Llama ({kind})")
    check_values(data, where, _CHECKED + row.wants, "Llama")
    layers, positions = (
        whole(data, "num_hidden_layers", where),
        whole(data, "max_position_embeddings", where, row.positions),
    )
    window, sliding = llama_hf_windows.window(data, where, row, layers, positions)
    theta, scaling, fraction = llama_hf_rope.read(data, where, row.theta, partial=row.partial)
    if row.partial is not None:
        _partial(data, where, row, scaling)
    heads = whole(data, "num_attention_heads", where)
    width = whole(data, "hidden_size", where)
    head_dim = whole_or_null(data, "head_dim", where, row.head_dim) or 0  # 0: width / heads, checked there
    rotary = 0 if fraction == 1 else llama_hf_rope.rotary_dim(fraction, head_dim or width // heads)
    fields = {"ffn": whole(data, "intermediate_size", where)} | llama_hf_experts.read(
        data, where, row.experts, layers
    )
    try:
        return _llama().LlamaConfig(
            vocab_size=whole(data, "vocab_size", where),
            seq_len=positions,
            layers=layers,
            width=width,
            heads=heads,
            kv_heads=whole_or_null(data, "num_key_value_heads", where, row.kv_heads) or heads,
            head_dim=head_dim,
            rotary_dim=rotary,
            qk_norm_whole=row.olmo,
            post_norms=row.olmo,
            fused=row.phi,
            o_bias=row.oss,
            sinks=row.oss,
            wide_norms=row.oss,
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=_switch(data, where, row.qkv_bias),
            qk_norm=_switch(data, where, row.qk_norm),
            window=window,
            sliding=sliding,
            norm_eps=positive(data.get("rms_norm_eps", row.eps), f"{where}: rms_norm_eps"),
            tie_embeddings=flag(data, "tie_word_embeddings", where, False),
            scan_layers=scan_layers,
            **fields,
        )
    except InteropError:
        raise
    except MeshkitError as e:
        raise InteropError(f"{where}: {e}") from None


def _switch(data: dict, where: str, said: bool | str) -> bool:
    """A row's switch: its value, or the config field's (false where omitted)."""
    return flag(data, said, where, False) if isinstance(said, str) else said


def _partial(data: dict, where: str, row: Type, scaling: Any) -> None:
    """A partial rotary's type: no scaling (Phi-3's transformers class takes longrope only; GLM-4.5's scaled
    partial rotary is not checked against transformers), Phi-3's original context whole."""
    if row.phi:
        whole(data, _ORIGINAL, where, 4096)
    if scaling is not None:
        why = (
            "whose transformers class takes longrope only (4.57 and 5.x)"
            if row.phi
            else "a partial rotary meshkit does not scale"
        )
        raise InteropError(
            f"{where}: a {type(scaling).__name__} rotary in a {row.architecture} config, {why}: give rope_scaling null"
        )


def _fits(row: Type, cfg: Any) -> bool:
    """Whether ``row`` writes ``cfg``: its switches, its experts (Mixtral's gates always renormalised) and
    a window it can say (in every layer, or per layer for Qwen's)."""
    moe = row.experts
    said = [
        (s if isinstance(s, bool) else c)
        for s, c in ((row.qkv_bias, cfg.qkv_bias), (row.qk_norm, cfg.qk_norm))
    ]
    switches = (cfg.qkv_bias, cfg.qk_norm, cfg.experts > 0, cfg.post_norms and cfg.qk_norm_whole, cfg.fused)
    if (*said, moe is not None, row.olmo, row.phi) != switches:
        return False
    if cfg.post_norms != cfg.qk_norm_whole or (cfg.rotary_dim != cfg.head_dim and row.partial is None):
        return False
    if row.partial is not None and cfg.rope_scaling is not None:
        return False
    if not llama_hf_experts.fits(moe, cfg):
        return False
    if moe is not None and moe.renormalize is None and not cfg.router_renormalize:
        return False
    if (moe is not None and moe.shared is not None) != (cfg.shared_ffn > 0) or (
        cfg.window and not row.slides
    ):
        return False
    if cfg.dense_layers and not (moe and moe.layers):
        return False
    oss = (cfg.sinks, cfg.o_bias, cfg.moe_bias, cfg.swiglu_limit > 0, cfg.wide_norms)
    if all(oss) != row.oss or (any(oss) and not all(oss)):
        return False
    per_layer = row.window in ("qwen", "layers")
    return cfg.window is None or per_layer or (row.window != "none" and cfg.sliding is None)


def type_of(cfg: Any) -> str:
    """The model type a config is written as: the first row that writes it (``_fits``)."""
    for kind, row in TYPES.items():
        if _fits(row, cfg):
            return kind
    raise InteropError(
        f"a Llama with qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}, qk_norm_whole={cfg.qk_norm_whole}, "
        f"post_norms={cfg.post_norms}, fused={cfg.fused}, sinks={cfg.sinks}, rotary_dim={cfg.rotary_dim} of "
        f"{cfg.head_dim}, "
        f"rope_scaling={cfg.rope_scaling and type(cfg.rope_scaling).__name__}, experts={cfg.experts} (router_renormalize="
        f"{cfg.router_renormalize}), window={cfg.window} (sliding={cfg.sliding}) is no Hugging Face model type "
        f"meshkit writes ({', '.join(TYPES)}): give the switches of one (docs/families.md)"
    )


def write(cfg: Any, tied: bool) -> dict:
    kind = type_of(cfg)
    row = TYPES[kind]
    own = (
        dict(row.wants) | llama_hf_windows.window_fields(cfg, row) | llama_hf_experts.write(cfg, row.experts)
    )
    if row.phi:
        own |= {_ORIGINAL: cfg.seq_len}
    if row.partial is not None:
        own |= llama_hf_rope.written_fraction(cfg.rotary_dim, cfg.head_dim, always=row.partial != 1.0)
    own |= {f: v for f, v in ((row.qkv_bias, cfg.qkv_bias), (row.qk_norm, cfg.qk_norm)) if isinstance(f, str)}
    if row.phi or row.olmo:
        own |= NO_SPECIAL
    return {
        "architectures": [row.architecture],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.width,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": llama_hf_rope.written(cfg.rope_scaling)
        or ({"rope_type": "default"} if row.oss else None),
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": cfg.dtype,
        **own,
    }


def names(cfg: Any, stored: frozenset[str] | None, tied: bool) -> Names:
    yield ("tok_embed",), Source("model.embed_tokens.weight")
    yield ("norm_f", "scale"), Source("model.norm.weight")
    if not cfg.tie_embeddings:
        yield ("unembed",), Source("lm_head.weight", transpose=True)
    layer = "model.layers.{i}."
    norms = ("post_attention", "post_feedforward") if cfg.post_norms else ("input", "post_attention")
    for path, name in zip((("attn_norm", "scale"), ("mlp_norm", "scale")), norms, strict=True):
        yield ("blocks", *path), Source(f"{layer}{name}_layernorm.weight")
    if cfg.fused:
        yield from _fused(cfg, layer)
        return
    for leaf, name in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
        yield ("blocks", "attn", leaf), Source(f"{layer}self_attn.{name}.weight", transpose=True)
    if cfg.qkv_bias:
        for leaf, name in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
            yield ("blocks", "attn", leaf), Source(f"{layer}self_attn.{name}.bias")
    if cfg.o_bias:
        yield ("blocks", "attn", "bo"), Source(f"{layer}self_attn.o_proj.bias")
    if cfg.sinks:
        yield ("blocks", "attn", "sinks"), Source(f"{layer}self_attn.sinks")
    if cfg.qk_norm or cfg.qk_norm_whole:
        for leaf in ("q_norm", "k_norm"):
            mine = leaf.replace("_", "_width_") if cfg.qk_norm_whole else leaf
            yield ("blocks", "attn", mine), Source(f"{layer}self_attn.{leaf}.weight")
    if not cfg.experts or cfg.dense_layers:  # a dense model's MLP, or a dense layer's among sparse ones
        for leaf, name in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            yield ("blocks", "mlp", leaf), Source(f"{layer}mlp.{name}.weight", transpose=True)
    if cfg.experts:
        yield from llama_hf_experts.names(TYPES[type_of(cfg)].experts, layer, cfg.ffn)


def _fused(cfg: Any, layer: str) -> Names:
    """Phi-3's attention and MLP: q, k, v the column ranges of ``qkv_proj`` and gate, up those of
    ``gate_up_proj`` (transformers' ``chunk(2)``: the gate first), ``o_proj`` and ``down_proj`` apart."""
    q, kv, f = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.ffn
    for leaf, columns in (("wq", (0, q)), ("wk", (q, q + kv)), ("wv", (q + kv, q + 2 * kv))):
        yield (
            ("blocks", "attn", leaf),
            Source(f"{layer}self_attn.qkv_proj.weight", transpose=True, columns=columns),
        )
    yield ("blocks", "attn", "wo"), Source(f"{layer}self_attn.o_proj.weight", transpose=True)
    for leaf, columns in (("w_gate", (0, f)), ("w_up", (f, 2 * f))):
        yield (
            ("blocks", "mlp", leaf),
            Source(f"{layer}mlp.gate_up_proj.weight", transpose=True, columns=columns),
        )
    yield ("blocks", "mlp", "w_down"), Source(f"{layer}mlp.down_proj.weight", transpose=True)


def unread(cfg: Any, data: dict) -> frozenset[str]:
    """A tied Llama reads no head: a checkpoint may still carry one (the embedding's copy); nor the
    multi-token-prediction layers a DeepSeek-V3-style checkpoint carries past its last (``model.layers.{L + i}.``
    for ``num_nextn_predict_layers``, as transformers leaves them)."""
    head = frozenset({"lm_head.weight"}) if cfg.tie_embeddings else frozenset()
    extra = llama_hf_experts.mtp_layers(data, TYPES.get(data.get("model_type"), None))
    return head | {f"model.layers.{cfg.layers + i}." for i in range(extra)}
