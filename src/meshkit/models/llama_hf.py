"""The Llama family's Hugging Face format: one row per ``model_type`` it reads (``TYPES``: Llama,
Mistral, Qwen2, Qwen3), each naming the switches of ``meshkit.models.llama.LlamaConfig`` it sets
(``qkv_bias``, ``qk_norm``), its defaults, and the ``config.json`` fields it may hold. A field that
no row names and that is not Hugging Face's own metadata (``family.HF_METADATA``) is refused by name:
meshkit reads only what it computes, so that a checkpoint it reads is the model transformers runs.

Rotary settings are read in both forms transformers writes: 4.x's ``rope_theta`` + ``rope_scaling``
and 5.x's ``rope_parameters`` (the same settings in one dict, ``rope_theta`` among them); written in
4.x's. The rope types meshkit computes are ``ROPE_TYPES``' keys.

Weights move by name and transpose only: ``meshkit.models.llama`` follows ``LlamaForCausalLM``'s
conventions (Qwen2's and Qwen3's are its, plus the biases and the per-head norms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshkit._errors import MeshkitError
from meshkit.models.family import HF_METADATA, InteropError, Names, Source, check_fields, check_values, need


def _llama() -> Any:
    from meshkit.models import llama

    return llama


@dataclass(frozen=True, slots=True)
class _Type:
    """One ``model_type`` the Llama reads and writes."""

    architecture: str
    positions: int
    """``max_position_embeddings`` where the config omits it (transformers' default for the type)."""
    head_dim: int | None
    """``head_dim`` where the config omits it (None: hidden_size / num_attention_heads)."""
    qkv_bias: bool
    qk_norm: bool
    wants: tuple[tuple[str, Any], ...]
    """Fields of its own, each with the one value meshkit computes."""
    window_off: bool = False
    """Its window is off unless ``use_sliding_window`` says so, and then binds only from layer
    ``max_window_layers`` on (Qwen's); else a ``sliding_window`` binds (Mistral's)."""


TYPES: dict[str, _Type] = {
    "llama": _Type("LlamaForCausalLM", 2048, None, False, False, (("attention_bias", False), ("mlp_bias", False))),
    "mistral": _Type("MistralForCausalLM", 131072, None, False, False, ()),
    "qwen2": _Type("Qwen2ForCausalLM", 32768, None, True, False, (), window_off=True),
    "qwen3": _Type("Qwen3ForCausalLM", 32768, 128, False, True, (("attention_bias", False),), window_off=True),
}  # fmt: skip
"""The model types read, the first written where no switch is on."""

_READ = frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                   "rope_scaling", "rope_parameters", "tie_word_embeddings", "sliding_window", "use_sliding_window",
                   "max_window_layers", "layer_types"})  # fmt: skip
"""Fields every row reads (the window's: a window that never binds is the model meshkit computes)."""
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
    kinds = {rope[k] for k in ("rope_type", "type") if isinstance(rope, dict) and k in rope}
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
    try:
        return _llama().Llama3Rope(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                                   high_freq_factor=float(rope["high_freq_factor"]),
                                   original_positions=int(rope["original_max_position_embeddings"]))  # fmt: skip
    except (MeshkitError, TypeError, ValueError) as e:
        raise InteropError(f"{said}: {e}") from None


def _rope(data: dict, where: str) -> tuple[float, Any]:
    """``(rope_theta, rope_scaling)`` of either form; both forms at once must say the same."""
    theta, scaling, key = data.get("rope_theta"), data.get("rope_scaling"), "rope_scaling"
    params = data.get("rope_parameters")
    if params is not None:
        flat = isinstance(params, dict) and all(not isinstance(v, dict) for v in params.values())
        if not flat:
            raise InteropError(
                f"{where}: rope_parameters={params!r} is not one set of rotary settings: meshkit's Llama uses one "
                f"rotary in every layer"
            )
        rest = {k: v for k, v in params.items() if k != "rope_theta"}
        both = (
            theta is not None and "rope_theta" in params and float(theta) != float(params["rope_theta"])
        ) or (_default_rope(scaling) is not None and _default_rope(scaling) != _default_rope(rest))
        if both:
            raise InteropError(
                f"{where}: rope_parameters={params!r} and rope_theta={theta!r}, rope_scaling={scaling!r} differ: "
                f"give one of the two forms"
            )
        theta, scaling, key = params.get("rope_theta", theta), rest, "rope_parameters"
    return float(10000.0 if theta is None else theta), _scaling(scaling, where, key)


def _check_window(data: dict, where: str, kind: str) -> None:
    """A sliding window shorter than the model's positions changes attention: meshkit's Llama attends
    to every earlier position, so it is refused by name (a window as long as the positions, or one no
    layer uses, never binds). Qwen's window is off unless ``use_sliding_window``, and then only in the
    layers from ``max_window_layers`` on (or those ``layer_types`` names)."""
    window, positions = data.get("sliding_window"), data.get("max_position_embeddings", TYPES[kind].positions)
    kinds = data.get("layer_types")
    if kinds is not None and (
        not isinstance(kinds, list) or set(kinds) - {"full_attention", "sliding_attention"}
    ):
        raise InteropError(f"{where}: layer_types={kinds!r} is not what meshkit's Llama computes: give full_attention layers")  # fmt: skip
    if TYPES[kind].window_off:
        layers = data.get("num_hidden_layers", 0)
        slides = (
            "sliding_attention" in kinds if kinds is not None else data.get("max_window_layers", 28) < layers
        )
        on = bool(data.get("use_sliding_window", False)) and slides
    else:
        on = bool(data.get("use_sliding_window", True))
    if window is not None and on and window < positions:
        raise InteropError(
            f"{where}: sliding_window={window} (of {positions} positions) is not what meshkit's Llama computes: it "
            f"attends to every earlier position; give a checkpoint whose sliding_window is null"
        )


def read(data: dict, where: str, scan_layers: bool) -> Any:
    """meshkit's Llama of a Llama-family ``config.json`` (any model type of ``TYPES``)."""
    kind = data["model_type"]
    row = TYPES[kind]
    mine = {k for k, _ in row.wants} | {k for k, _ in _CHECKED} | _READ | _IGNORED
    check_fields(data, where, mine | HF_METADATA, f"Llama ({kind})")
    _check_window(data, where, kind)
    check_values(data, where, _CHECKED + row.wants, "Llama")
    theta, scaling = _rope(data, where)
    heads = need(data, "num_attention_heads", where)
    return _llama().LlamaConfig(
        vocab_size=need(data, "vocab_size", where), seq_len=data.get("max_position_embeddings", row.positions),
        layers=need(data, "num_hidden_layers", where), width=need(data, "hidden_size", where), heads=heads,
        kv_heads=data.get("num_key_value_heads") or heads, head_dim=data.get("head_dim", row.head_dim) or 0,
        ffn=need(data, "intermediate_size", where), rope_theta=theta, rope_scaling=scaling,
        qkv_bias=row.qkv_bias, qk_norm=row.qk_norm, norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(data.get("tie_word_embeddings", False)), scan_layers=scan_layers,
    )  # fmt: skip


def type_of(cfg: Any) -> str:
    """The model type a config is written as: the row whose switches are the config's."""
    for kind, row in TYPES.items():
        if (row.qkv_bias, row.qk_norm) == (cfg.qkv_bias, cfg.qk_norm):
            return kind
    raise InteropError(
        f"a Llama with qkv_bias={cfg.qkv_bias} and qk_norm={cfg.qk_norm} is no Hugging Face model type meshkit "
        f"writes ({', '.join(TYPES)}): turn one of the two off"
    )


def write(cfg: Any, tied: bool) -> dict:
    kind = type_of(cfg)
    r = cfg.rope_scaling
    rope = None if r is None else {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                                   "high_freq_factor": r.high_freq_factor,
                                   "original_max_position_embeddings": r.original_positions}  # fmt: skip
    window = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.layers}
    own = dict(TYPES[kind].wants) | (window if TYPES[kind].window_off else {})
    return {"architectures": [TYPES[kind].architecture], "model_type": kind, "vocab_size": cfg.vocab_size,
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
    for leaf, name in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        yield ("blocks", "mlp", leaf), Source(f"{layer}mlp.{name}.weight", transpose=True)


def unread(cfg: Any) -> frozenset[str]:
    """A tied Llama reads no head: a checkpoint may still carry one (the embedding's copy)."""
    return frozenset({"lm_head.weight"}) if cfg.tie_embeddings else frozenset()
