"""The Llama family's Hugging Face format: one row per ``model_type`` it reads (``TYPES``: Llama,
Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE), each naming the switches of
``meshkit.models.llama.LlamaConfig`` it sets (``qkv_bias``, ``qk_norm``, a mixture of experts), how
its window reads, its defaults, and the ``config.json`` fields it may hold. A field that no row names
and that is not Hugging Face's own metadata (``family.HF_METADATA``) is refused by name: meshkit reads
only what it computes, so that a checkpoint it reads is the model transformers runs.

Rotary settings are read in both forms transformers writes: 4.x's ``rope_theta`` + ``rope_scaling``
and 5.x's ``rope_parameters`` (the same settings in one dict, ``rope_theta`` among them); written in
4.x's. The rope types meshkit computes are ``ROPE_TYPES``' keys.

Sliding windows read as transformers runs them (its ``masking_utils``: a query sees the keys ``q - k <
sliding_window``, itself among them, ``LlamaConfig.window``): Mistral's and Mixtral's ``sliding_window``
binds in every layer where it is not null; Qwen2's and Qwen3's only with ``use_sliding_window``, and
then in the layers ``layer_types`` names ``sliding_attention`` (else those from ``max_window_layers``
on: ``LlamaConfig.sliding``); Qwen3-MoE's with ``use_sliding_window`` in every layer (its transformers
class reads no ``max_window_layers``). A window at least as long as the positions never binds within
them and reads as none.

Experts read dropless (``capacity_factor=0``), as transformers runs them: every token its top-k
experts by softmax probability, the gates renormalised to sum to 1 (Mixtral always, Qwen3-MoE where
``norm_topk_prob``). Each expert is its own tensors in the checkpoint (``experts.{j}``), stacked into
meshkit's ``(E, D, F)`` leaves. ``router_aux_loss_coef`` is read as the weight of meshkit's
load-balancing loss (``router_aux_weight``; Switch's, per sequence and layer, where transformers pools
the batch and the layers and counts each of the k choices: about k times meshkit's).
``output_router_logits`` (whether transformers returns the router's logits and adds its loss) changes
no logit: read and left aside, written false (4.57.6's ``generate`` fails on a Mixtral with it true).

Weights move by name, transpose and stacking only: ``meshkit.models.llama`` follows
``LlamaForCausalLM``'s conventions (the other types' are its, plus biases, per-head norms, experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshkit._errors import MeshkitError
from meshkit.models.family import (
    HF_METADATA,
    InteropError,
    Names,
    Source,
    check_fields,
    check_values,
    flag,
    need,
    positive,
    whole,
    whole_or_null,
)


def _llama() -> Any:
    from meshkit.models import llama

    return llama


@dataclass(frozen=True, slots=True)
class _Experts:
    """How a model type names its mixture of experts."""

    count: tuple[str, ...]
    """Fields that may give the number of experts (Qwen3-MoE's: 4.x writes ``num_experts``, 5.x
    ``num_local_experts``); the first is written."""
    ffn: str
    """The field of an expert's hidden width."""
    renormalize: str | None
    """The field saying whether the top-k gates are renormalised (None: always, Mixtral's)."""
    prefix: str
    """The layer's MLP module: its router is ``{prefix}.gate``, its experts ``{prefix}.experts.{j}``."""
    weights: tuple[str, str, str]
    """An expert's gate, up and down projections."""
    layers: tuple[str, ...] = ()
    """Fields saying which layers are sparse (Qwen3-MoE's ``decoder_sparse_step``, ``mlp_only_layers``)."""


_MIXTRAL = _Experts(("num_local_experts",), "intermediate_size", None, "block_sparse_moe", ("w1", "w3", "w2"))
_QWEN3_MOE = _Experts(("num_experts", "num_local_experts"), "moe_intermediate_size", "norm_topk_prob", "mlp",
                      ("gate_proj", "up_proj", "down_proj"), ("decoder_sparse_step", "mlp_only_layers"))  # fmt: skip

_WINDOWS = {
    "none": ("sliding_window",),
    "every": ("sliding_window",),
    "qwen": ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
    "gated": ("use_sliding_window", "sliding_window", "max_window_layers"),
}
"""How a row reads a window, and the fields it reads for it: none (Llama's: ``sliding_window`` null
only, which transformers' Llama would ignore); ``sliding_window`` in every layer
(Mistral's); gated by ``use_sliding_window``, per layer (Qwen2's, Qwen3's); gated, in every layer
(Qwen3-MoE's: ``max_window_layers`` read and left aside, as its transformers class does)."""


@dataclass(frozen=True, slots=True)
class _Type:
    """One ``model_type`` the Llama reads and writes."""

    architecture: str
    positions: int
    """``max_position_embeddings`` where the config omits it (transformers' default for the type)."""
    head_dim: int | None
    """``head_dim`` where the config omits it (None: hidden_size / num_attention_heads)."""
    kv_heads: int | None
    """``num_key_value_heads`` where the config omits it (None: num_attention_heads)."""
    theta: float
    """``rope_theta`` where the config omits it."""
    eps: float
    """``rms_norm_eps`` where the config omits it."""
    qkv_bias: bool
    qk_norm: bool
    window: str
    """How its window reads (a key of ``_WINDOWS``)."""
    wants: tuple[tuple[str, Any], ...]
    """Fields of its own, each with the one value meshkit computes."""
    experts: _Experts | None = None
    """Its mixture of experts (None: a dense MLP)."""
    default_window: int | None = None
    """``sliding_window`` where the config omits it (and, for a gated row, turns it on): transformers'
    default for the type, 4096 in 4.57.6 and 5.25.0 alike, which binds from position 4096 on."""


TYPES: dict[str, _Type] = {
    "llama": _Type("LlamaForCausalLM", 2048, None, None, 1e4, 1e-6, False, False, "none",
                   (("attention_bias", False), ("mlp_bias", False))),
    "mistral": _Type("MistralForCausalLM", 131072, None, 8, 1e4, 1e-6, False, False, "every", (),
                     default_window=4096),
    "qwen2": _Type("Qwen2ForCausalLM", 32768, None, 32, 1e4, 1e-6, True, False, "qwen", (), default_window=4096),
    "qwen3": _Type("Qwen3ForCausalLM", 32768, 128, 32, 1e4, 1e-6, False, True, "qwen", (("attention_bias", False),),
                   default_window=4096),
    "mixtral": _Type("MixtralForCausalLM", 131072, None, 8, 1e6, 1e-5, False, False, "every",
                     (("router_jitter_noise", 0.0),), _MIXTRAL),
    "qwen3_moe": _Type("Qwen3MoeForCausalLM", 32768, None, 4, 1e4, 1e-6, False, True, "gated",
                       (("attention_bias", False),), _QWEN3_MOE, default_window=4096),
}  # fmt: skip
"""The model types read; a config is written as the first whose switches, window and experts it has."""

_READ = frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                   "rope_scaling", "rope_parameters", "tie_word_embeddings"})  # fmt: skip
"""Fields every row reads."""
_MOE_READ = frozenset({"num_experts_per_tok", "output_router_logits", "router_aux_loss_coef"})
"""Fields every mixture-of-experts row reads, besides those its ``_Experts`` names."""
_CHECKED = (("hidden_act", "silu"), ("attention_dropout", 0.0), ("pruned_heads", {}))
"""Fields every row may hold with the one value meshkit computes."""
_IGNORED = frozenset({"pretraining_tp"})
"""Fields that change no output: Llama 2's ``pretraining_tp`` split a matmul in older transformers."""

ROPE_TYPES: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
}
"""The rope types meshkit computes, each with the settings it needs (all of them, no more)."""


def _default_rope(rope: Any) -> Any:
    """A rope dict saying only ``default`` (as transformers writes it) reads as None, which it equals."""
    default = isinstance(rope, dict) and set(rope) <= {"rope_type", "type"}
    return None if default and all(v == "default" for v in rope.values()) else rope


def _scaling(rope: Any, where: str, key: str) -> Any:
    """The ``Llama3Rope`` of a ``rope_scaling`` (or ``rope_parameters`` less its theta), or None."""
    rope = _default_rope(rope)
    if rope is None:
        return None
    said = f"{where}: {key}={rope!r}"
    kinds = {
        rope[k] for k in ("rope_type", "type") if isinstance(rope, dict) and isinstance(rope.get(k), str)
    }
    if not isinstance(rope, dict) or len(kinds) != 1:
        raise InteropError(f"{said} names no single rope_type: give one of {', '.join(ROPE_TYPES)}")
    (kind,) = kinds
    if kind not in ROPE_TYPES:
        raise InteropError(
            f"{said}: rope_type {kind!r} is not one meshkit's Llama computes ({', '.join(ROPE_TYPES)}): "
            f"give a checkpoint with one of those"
        )
    given, needs = set(rope) - {"rope_type", "type"}, ROPE_TYPES[kind]
    if given != needs:
        lacks, extra = sorted(needs - given), sorted(given - needs)
        wrong = f"lacks {', '.join(lacks)}" if lacks else f"takes no {', '.join(extra)}"
        raise InteropError(
            f"{said}: rope_type {kind} {wrong}: give exactly {', '.join(sorted(needs)) or 'rope_type'}"
        )
    factors = {
        k: positive(rope[k], f"{said}: {k}") for k in ("factor", "low_freq_factor", "high_freq_factor")
    }
    original = whole(rope, "original_max_position_embeddings", said)
    try:
        return _llama().Llama3Rope(**factors, original_positions=original)
    except MeshkitError as e:
        raise InteropError(f"{said}: {e}") from None


def _rope(data: dict, where: str, default: float) -> tuple[float, Any]:
    """``(rope_theta, rope_scaling)`` of either form; both forms at once must say the same."""
    theta, scaling, key = data.get("rope_theta"), data.get("rope_scaling"), "rope_scaling"
    theta = None if theta is None else positive(theta, f"{where}: rope_theta")
    params = data.get("rope_parameters")
    if params is not None:
        flat = isinstance(params, dict) and all(not isinstance(v, dict) for v in params.values())
        if not flat:
            raise InteropError(
                f"{where}: rope_parameters={params!r} is not one set of rotary settings: meshkit's Llama uses one "
                f"rotary in every layer"
            )
        rest = {k: v for k, v in params.items() if k != "rope_theta"}
        five = params.get("rope_theta")
        five = None if five is None else positive(five, f"{where}: rope_parameters.rope_theta")
        both = (theta is not None and five is not None and theta != five) or (
            _default_rope(scaling) is not None and _default_rope(scaling) != _default_rope(rest)
        )
        if both:
            raise InteropError(
                f"{where}: rope_parameters={params!r} and rope_theta={theta!r}, rope_scaling={scaling!r} differ: "
                f"give one of the two forms"
            )
        theta, scaling, key = theta if five is None else five, rest, "rope_parameters"
    return float(default if theta is None else theta), _scaling(scaling, where, key)


def _fields(row: _Type) -> frozenset[str]:
    """Every field a row reads."""
    moe = row.experts
    own = (
        set()
        if moe is None
        else {*moe.count, moe.ffn, *moe.layers, *_MOE_READ} | ({moe.renormalize} - {None})
    )
    return _READ | set(_WINDOWS[row.window]) | {k for k, _ in row.wants + _CHECKED} | _IGNORED | own


def _layer_types(data: dict, where: str, layers: int) -> list | None:
    """Qwen's ``layer_types``, checked: one kind per layer, full or sliding attention."""
    kinds = data.get("layer_types")
    if kinds is not None and (
        not isinstance(kinds, list)
        or not all(isinstance(kind, str) for kind in kinds)
        or set(kinds) - {"full_attention", "sliding_attention"}
        or len(kinds) != layers
    ):
        raise InteropError(
            f"{where}: layer_types={kinds!r} is not what meshkit's Llama computes: give {layers} layers, each "
            f"full_attention or sliding_attention"
        )
    return kinds


def _window(
    data: dict, where: str, row: _Type, layers: int, positions: int
) -> tuple[int | None, tuple[bool, ...] | None]:
    """``(window, sliding)`` of the config as transformers runs it (the module docstring); an omitted
    ``sliding_window`` is the type's default (``_Type.default_window``), not none."""
    kinds = _layer_types(data, where, layers) if row.window == "qwen" else None
    window = data.get("sliding_window", row.default_window)
    if row.window in ("qwen", "gated") and not flag(data, "use_sliding_window", where, False):
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise InteropError(
            f"{where}: sliding_window={window!r} is not a whole number of tokens: give one, or null"
        )
    if window is not None and row.window == "none":
        raise InteropError(
            f"{where}: sliding_window={window} in a {row.architecture} config, whose transformers class attends to "
            f"every earlier position: give null, or the model_type that slides (mistral)"
        )
    if window is None or window >= positions:
        return None, None
    if row.window != "qwen":
        return window, None
    if kinds is not None:
        return window, tuple(kind == "sliding_attention" for kind in kinds)
    first = whole(data, "max_window_layers", where, 28, least=0)
    return window, tuple(i >= first for i in range(layers))


def _experts(data: dict, where: str, row: _Type, layers: int) -> dict[str, Any]:
    """The ``LlamaConfig`` fields of a mixture of experts (none for a dense row): dropless."""
    moe = row.experts
    if moe is None:
        return {}
    counts = {k: data[k] for k in moe.count if k in data}
    if len(set(counts.values())) > 1:
        said = ", ".join(f"{k}={v!r}" for k, v in counts.items())
        raise InteropError(f"{where}: {said} differ: give the number of experts once")
    key = next(iter(counts), moe.count[-1])
    experts = need(data, key, where)
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise InteropError(f"{where}: {key}={experts!r}: meshkit reads a mixture of at least 1 expert")
    if moe.layers:
        step, only = whole(data, "decoder_sparse_step", where, 1), data.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in only
        ):
            raise InteropError(f"{where}: mlp_only_layers={only!r} is not a list of layer numbers: give one")
        dense = [i for i in range(layers) if i in only or (i + 1) % step]
        if dense:
            raise InteropError(
                f"{where}: decoder_sparse_step={step!r}, mlp_only_layers={only!r} make layers {dense[:4]} dense MLPs: "
                f"meshkit's Llama has experts in every layer; give a checkpoint whose every layer is sparse"
            )
    aux = positive(data.get("router_aux_loss_coef", 0.001), f"{where}: router_aux_loss_coef", zero=True)
    return {"experts": experts, "experts_per_token": whole(data, "num_experts_per_tok", where),
            "ffn": whole(data, moe.ffn, where), "capacity_factor": 0.0, "router_aux_weight": aux,
            "router_renormalize": moe.renormalize is None or flag(data, moe.renormalize, where, False)}  # fmt: skip


def read(data: dict, where: str, scan_layers: bool) -> Any:
    """meshkit's Llama of a Llama-family ``config.json`` (any model type of ``TYPES``)."""
    kind = data["model_type"]
    row = TYPES[kind]
    check_fields(data, where, _fields(row) | HF_METADATA, f"Llama ({kind})")
    check_values(data, where, _CHECKED + row.wants, "Llama")
    layers, positions = (
        whole(data, "num_hidden_layers", where),
        whole(data, "max_position_embeddings", where, row.positions),
    )
    window, sliding = _window(data, where, row, layers, positions)
    theta, scaling = _rope(data, where, row.theta)
    heads = whole(data, "num_attention_heads", where)
    fields = {"ffn": whole(data, "intermediate_size", where)} | _experts(data, where, row, layers)
    try:
        return _llama().LlamaConfig(
            vocab_size=whole(data, "vocab_size", where), seq_len=positions, layers=layers,
            width=whole(data, "hidden_size", where), heads=heads,
            kv_heads=whole_or_null(data, "num_key_value_heads", where, row.kv_heads) or heads,
            head_dim=whole_or_null(data, "head_dim", where, row.head_dim) or 0, rope_theta=theta, rope_scaling=scaling,
            qkv_bias=row.qkv_bias, qk_norm=row.qk_norm, window=window, sliding=sliding,
            norm_eps=positive(data.get("rms_norm_eps", row.eps), f"{where}: rms_norm_eps"),
            tie_embeddings=flag(data, "tie_word_embeddings", where, False), scan_layers=scan_layers, **fields,
        )  # fmt: skip
    except InteropError:
        raise
    except MeshkitError as e:
        raise InteropError(f"{where}: {e}") from None


def _fits(row: _Type, cfg: Any) -> bool:
    """Whether ``row`` writes ``cfg``: its switches, its experts (Mixtral's gates always renormalised) and
    a window it can say (in every layer, or per layer for Qwen's)."""
    moe = row.experts
    if (row.qkv_bias, row.qk_norm, moe is not None) != (cfg.qkv_bias, cfg.qk_norm, cfg.experts > 0):
        return False
    if moe is not None and moe.renormalize is None and not cfg.router_renormalize:
        return False
    return cfg.window is None or row.window == "qwen" or (row.window != "none" and cfg.sliding is None)


def type_of(cfg: Any) -> str:
    """The model type a config is written as: the first row that writes it (``_fits``)."""
    for kind, row in TYPES.items():
        if _fits(row, cfg):
            return kind
    raise InteropError(
        f"a Llama with qkv_bias={cfg.qkv_bias} and qk_norm={cfg.qk_norm}, experts={cfg.experts} (router_renormalize="
        f"{cfg.router_renormalize}), window={cfg.window} (sliding={cfg.sliding}) is no Hugging Face model type "
        f"meshkit writes ({', '.join(TYPES)}): give the switches of one (docs/families.md)"
    )


def _window_fields(cfg: Any, row: _Type) -> dict[str, Any]:
    """The row's window fields for ``cfg``'s window."""
    if row.window == "every":
        return {"sliding_window": cfg.window}
    if row.window == "none":
        return {}
    on = {"use_sliding_window": cfg.window is not None, "sliding_window": cfg.window}
    if row.window == "gated":
        return on
    windows = cfg.layer_windows
    first = next((i for i, w in enumerate(windows) if w is not None), cfg.layers)
    kinds = ["full_attention" if w is None else "sliding_attention" for w in windows]
    return on | {"max_window_layers": first} | ({"layer_types": kinds} if cfg.window is not None else {})


def _experts_fields(cfg: Any, row: _Type) -> dict[str, Any]:
    """The row's mixture-of-experts fields for ``cfg`` (every layer sparse; written dropless, as
    transformers runs it, whatever capacity the model trained with)."""
    moe = row.experts
    if moe is None:
        return {}
    out = {moe.count[0]: cfg.experts, "num_experts_per_tok": cfg.experts_per_token, moe.ffn: cfg.ffn,
           "output_router_logits": False, "router_aux_loss_coef": cfg.router_aux_weight}  # fmt: skip
    if moe.renormalize is not None:
        out[moe.renormalize] = cfg.router_renormalize
    return out | ({"decoder_sparse_step": 1, "mlp_only_layers": []} if moe.layers else {})


def write(cfg: Any, tied: bool) -> dict:
    kind = type_of(cfg)
    row = TYPES[kind]
    r = cfg.rope_scaling
    rope = None if r is None else {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                                   "high_freq_factor": r.high_freq_factor,
                                   "original_max_position_embeddings": r.original_positions}  # fmt: skip
    own = dict(row.wants) | _window_fields(cfg, row) | _experts_fields(cfg, row)
    return {"architectures": [row.architecture], "model_type": kind, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.width, "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": rope, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
            "torch_dtype": cfg.dtype, **own}  # fmt: skip


def names(cfg: Any, stored: frozenset[str] | None, tied: bool) -> Names:
    yield ("tok_embed",), Source("model.embed_tokens.weight")
    yield ("norm_f", "scale"), Source("model.norm.weight")
    if not cfg.tie_embeddings:
        yield ("unembed",), Source("lm_head.weight", transpose=True)
    layer = "model.layers.{i}."
    for path, name in ((("attn_norm", "scale"), "input_layernorm.weight"), (("mlp_norm", "scale"), "post_attention_layernorm.weight")):  # fmt: skip
        yield ("blocks", *path), Source(layer + name)
    for leaf, name in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
        yield ("blocks", "attn", leaf), Source(f"{layer}self_attn.{name}.weight", transpose=True)
    if cfg.qkv_bias:
        for leaf, name in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
            yield ("blocks", "attn", leaf), Source(f"{layer}self_attn.{name}.bias")
    if cfg.qk_norm:
        for leaf in ("q_norm", "k_norm"):
            yield ("blocks", "attn", leaf), Source(f"{layer}self_attn.{leaf}.weight")
    if not cfg.experts:
        for leaf, name in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            yield ("blocks", "mlp", leaf), Source(f"{layer}mlp.{name}.weight", transpose=True)
        return
    moe = TYPES[type_of(cfg)].experts
    yield ("blocks", "moe", "router"), Source(f"{layer}{moe.prefix}.gate.weight", transpose=True)
    for leaf, name in zip(("w_gate", "w_up", "w_down"), moe.weights, strict=True):
        yield (
            ("blocks", "moe", leaf),
            Source(f"{layer}{moe.prefix}.experts.{{j}}.{name}.weight", True, experts=True),
        )


def unread(cfg: Any) -> frozenset[str]:
    """A tied Llama reads no head: a checkpoint may still carry one (the embedding's copy)."""
    return frozenset({"lm_head.weight"}) if cfg.tie_embeddings else frozenset()
