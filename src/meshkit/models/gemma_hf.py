"""The Gemma family's Hugging Face format: one row per ``model_type`` it reads (``TYPES``: Gemma 1,
Gemma 2, Gemma 3's text model), each with the switches of ``meshkit.models.gemma.GemmaConfig`` it
sets and transformers' defaults for the fields a ``config.json`` may omit (Gemma 2's soft caps of 50
and 30 among them: an omitted cap is not no cap). A field no row reads and that is not Hugging Face's
own metadata (``family.HF_METADATA``) is refused by name, as the Llama's format does.

Rotary settings are read in both forms transformers writes: 4.x's ``rope_theta`` + ``rope_scaling`` (+
Gemma 3's ``rope_local_base_freq``) and 5.x's ``rope_parameters`` (Gemma 3's keyed by layer type,
``full_attention`` and ``sliding_attention``); written in 4.x's. The rope types read are ``default``
and ``linear`` (Gemma 3 4B-27B's global layers).

Where transformers' releases compute different things from the same file, the file is refused, naming
it: Gemma 1's legacy ``hidden_act: gelu`` is exact GELU in 4.57 and the tanh approximation in 5.x.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshkit._errors import MeshkitError
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


def _gemma() -> Any:
    from meshkit.models import gemma

    return gemma


@dataclass(frozen=True, slots=True)
class _Type:
    """One ``model_type`` the Gemma reads and writes, with transformers' defaults for it."""

    architecture: str
    positions: int
    rope_theta: float
    sandwich: bool
    """Norms after attention and after the MLP (Gemma 2, 3)."""
    qk_norm: bool
    local_rope: bool
    """Local layers have a rotary of their own (``rope_local_base_freq``, Gemma 3)."""
    softcaps: tuple[float | None, float | None]
    """Default ``attn_logit_softcapping``, ``final_logit_softcapping``."""
    pattern: int
    """Default layer kinds: layer i is global when ``(i + 1) % pattern == 0``, else local (0: no window)."""
    kv_heads: int
    """``num_key_value_heads`` where the config omits it (null: as many as the heads)."""


TYPES: dict[str, _Type] = {
    "gemma2": _Type("Gemma2ForCausalLM", 8192, 10000.0, True, False, False, (50.0, 30.0), 2, 4),
    "gemma3_text": _Type("Gemma3ForCausalLM", 131072, 1_000_000.0, True, True, True, (None, None), 6, 4),
    "gemma": _Type("GemmaForCausalLM", 8192, 10000.0, False, False, False, (None, None), 0, 16),
}
"""The model types read; each config is written as the one its switches make (``type_of``)."""

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
_WINDOWED = frozenset(
    {
        "query_pre_attn_scalar",
        "sliding_window",
        "layer_types",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "hidden_activation",
    }
)
"""Gemma 2's and 3's own fields."""
_IGNORED = {
    "gemma": frozenset({"hidden_activation"}),
    "gemma2": frozenset({"hidden_act", "sliding_window_size", "cache_implementation"}),
    "gemma3_text": frozenset(
        {
            "hidden_act",
            "sliding_window_size",
            "cache_implementation",
            "sliding_window_pattern",
            "_sliding_window_pattern",
        }
    ),
}
"""Fields that change no output of the type: Gemma 2 and 3 read ``hidden_activation``, not ``hidden_act``
(nor Gemma 1 the other way round); ``sliding_window_size`` is Gemma 2's first release's copy of
``sliding_window``; ``cache_implementation`` a generation setting; ``sliding_window_pattern`` only builds
``layer_types`` where a config lacks them (read there), and 4.x writes its private copy
``_sliding_window_pattern`` beside them."""
_CHECKED = (("attention_bias", False), ("attention_dropout", 0.0))
_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")
TANH = "gelu_pytorch_tanh"
ROPE_TYPES = {"default": frozenset(), "linear": frozenset({"factor"})}
"""The rope types meshkit's Gemma computes, each with the settings it needs."""


def _rope_type(rope: Any, said: str) -> tuple[float | None, float]:
    """``(rope_theta or None, linear factor)`` of one rope dict (or None: the default rotary)."""
    if rope is None:
        return None, 1.0
    kinds = {
        rope[k] for k in ("rope_type", "type") if isinstance(rope, dict) and isinstance(rope.get(k), str)
    }
    if not isinstance(rope, dict) or len(kinds) != 1 or (kind := kinds.pop()) not in ROPE_TYPES:
        raise InteropError(
            f"{said}={rope!r} is not a rope_type meshkit's Gemma computes: give {' or '.join(ROPE_TYPES)}"
        )
    given, needs = set(rope) - {"rope_type", "type", "rope_theta"}, ROPE_TYPES[kind]
    if given != needs:
        raise InteropError(
            f"{said}={rope!r}: rope_type {kind} takes exactly {', '.join(sorted(needs)) or 'rope_theta'}"
        )
    theta = None if rope.get("rope_theta") is None else positive(rope["rope_theta"], f"{said}.rope_theta")
    return theta, positive(rope.get("factor", 1.0), f"{said}.factor")


def _rotary(data: dict, where: str, row: _Type) -> tuple[float, float, float]:
    """``(rope_theta, rope_factor, local_rope_theta)`` of either form; both at once must say the same."""
    theta, factor = _rope_type(data.get("rope_scaling"), f"{where}: rope_scaling")
    theta = theta if data.get("rope_theta") is None else positive(data["rope_theta"], f"{where}: rope_theta")
    local = data.get("rope_local_base_freq") if row.local_rope else None
    local = None if local is None else positive(local, f"{where}: rope_local_base_freq")
    params = data.get("rope_parameters")
    if params is not None:
        if row.local_rope:
            if not isinstance(params, dict) or set(params) - {"full_attention", "sliding_attention"}:
                raise InteropError(
                    f"{where}: rope_parameters={params!r} is not keyed by layer type (full_attention, sliding_attention) as Gemma 3's are"
                )
            five, five_factor = _rope_type(
                params.get("full_attention"), f"{where}: rope_parameters.full_attention"
            )
            five_local, local_factor = _rope_type(
                params.get("sliding_attention"), f"{where}: rope_parameters.sliding_attention"
            )
            if local_factor != 1.0:
                raise InteropError(
                    f"{where}: rope_parameters.sliding_attention is scaled: meshkit's Gemma scales the global layers' rotary only"
                )
        else:
            (five, five_factor), five_local = _rope_type(params, f"{where}: rope_parameters"), None
        said = {"rope_theta": (theta, five), "rope_local_base_freq": (local, five_local)}
        said["rope_scaling"] = (factor if data.get("rope_scaling") is not None else None, five_factor)
        for key, (four, new) in said.items():
            if four is not None and new is not None and float(four) != float(new):
                raise InteropError(
                    f"{where}: rope_parameters={params!r} and {key}={data[key]!r} differ: give one of the two forms"
                )
        theta, factor = five if five is not None else theta, five_factor
        local = five_local if five_local is not None else local
    local_theta = float(10000.0 if local is None else local) if row.local_rope else 0.0
    return float(row.rope_theta if theta is None else theta), factor, local_theta


def _layers(data: dict, where: str, kind: str, layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """``(window, which layers are local)``: ``layer_types`` where given, else the type's pattern."""
    row = TYPES[kind]
    if not row.pattern:
        return None, ()
    kinds = data.get("layer_types")
    if kinds is None:
        every = (
            whole(data, "sliding_window_pattern", where, row.pattern)
            if kind == "gemma3_text"
            else row.pattern
        )
        kinds = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    known = {"full_attention", "sliding_attention"}
    if (
        not isinstance(kinds, list)
        or len(kinds) != layers
        or not all(isinstance(k, str) for k in kinds)
        or set(kinds) - known
    ):
        raise InteropError(
            f"{where}: layer_types={kinds!r} is not one of full_attention, sliding_attention per layer of {layers}"
        )
    local = tuple(k == "sliding_attention" for k in kinds)
    window = data.get("sliding_window", 4096)
    if any(local) and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise InteropError(
            f"{where}: sliding_window={window!r} with sliding_attention layers: give the window's length in tokens"
        )
    return (window if any(local) else None), local


def _activation(data: dict, where: str, kind: str) -> None:
    key = "hidden_act" if kind == "gemma" else "hidden_activation"
    act = data.get(key, TANH)
    if kind == "gemma" and act == "gelu":
        raise InteropError(
            f"{where}: hidden_act='gelu' is exact GELU in transformers 4.x and the tanh approximation in 5.x (its "
            f"legacy value for Gemma): set hidden_act to {TANH!r}, what Gemma was trained with"
        )
    if act != TANH:
        raise InteropError(f"{where}: {key}={act!r} is not what meshkit's Gemma computes ({TANH!r})")


def read(data: dict, where: str, scan_layers: bool) -> Any:
    """meshkit's Gemma of a Gemma-family ``config.json`` (any model type of ``TYPES``)."""
    kind = data["model_type"]
    row = TYPES[kind]
    own = (
        (_WINDOWED | ({"rope_local_base_freq"} if row.local_rope else set()))
        if row.pattern
        else {"hidden_act"}
    )
    known = _READ | own | _IGNORED[kind] | {k for k, _ in _CHECKED} | {"use_bidirectional_attention"}
    check_fields(data, where, known | HF_METADATA, f"Gemma ({kind})")
    check_values(data, where, _CHECKED, "Gemma")
    if flag(data, "use_bidirectional_attention", where, False):
        raise InteropError(
            f"{where}: use_bidirectional_attention=True is not what meshkit's Gemma computes (a causal decoder)"
        )
    _activation(data, where, kind)
    if kind == "gemma3_text" and data.get("attn_logit_softcapping") is not None:
        raise InteropError(
            f"{where}: attn_logit_softcapping={data['attn_logit_softcapping']!r}: transformers' Gemma 3 does not "
            f"apply it (its attention takes no cap), so it is no model meshkit can match; give null"
        )
    theta, factor, local_theta = _rotary(data, where, row)
    layers, heads = whole(data, "num_hidden_layers", where), whole(data, "num_attention_heads", where)
    window, local = _layers(data, where, kind, layers)
    caps = {k: data.get(k, d) for k, d in zip(_CAPS, row.softcaps, strict=True)}
    attn_cap, final_cap = (None if v is None else positive(v, f"{where}: {k}") for k, v in caps.items())
    scalar = data.get("query_pre_attn_scalar", 256)
    try:
        return _gemma().GemmaConfig(
            vocab_size=whole(data, "vocab_size", where),
            seq_len=whole(data, "max_position_embeddings", where, row.positions),
            layers=layers,
            width=whole(data, "hidden_size", where),
            heads=heads,
            kv_heads=whole_or_null(data, "num_key_value_heads", where, row.kv_heads) or heads,
            head_dim=whole_or_null(data, "head_dim", where, 256) or 256,
            ffn=whole(data, "intermediate_size", where),
            rope_theta=theta,
            rope_factor=factor,
            local_rope_theta=local_theta,
            query_scalar=positive(scalar, f"{where}: query_pre_attn_scalar") if row.pattern else 0.0,
            window=window,
            local_layers=local,
            attn_softcap=attn_cap,
            final_softcap=final_cap,
            qk_norm=row.qk_norm,
            sandwich=row.sandwich,
            norm_eps=positive(data.get("rms_norm_eps", 1e-6), f"{where}: rms_norm_eps"),
            tie_embeddings=flag(data, "tie_word_embeddings", where, True),
            scan_layers=scan_layers,
        )
    except InteropError:
        raise
    except MeshkitError as e:
        raise InteropError(f"{where}: {e}") from None


def type_of(cfg: Any) -> str:
    """The model type a config is written as, or a refusal naming what no type computes."""
    kind = "gemma" if not cfg.sandwich else "gemma3_text" if cfg.qk_norm else "gemma2"
    why = {
        "gemma": (
            cfg.qk_norm
            or cfg.local_layers
            or cfg.attn_softcap
            or cfg.final_softcap
            or cfg.local_rope_theta
            or cfg.query_scalar != cfg.head_dim
        )
        and "q/k norms, local layers, soft caps or a query scale",
        "gemma2": cfg.local_rope_theta and "a local rotary of its own (local_rope_theta)",
        "gemma3_text": (cfg.attn_softcap and "an attention soft cap")
        or (
            cfg.rope_factor != 1
            and cfg.local_layers
            and not cfg.local_rope_theta
            and "local layers scaled by rope_factor"
        ),
    }[kind]
    if why:
        raise InteropError(
            f"a Gemma {'with' if cfg.sandwich else 'without'} sandwich norms and with {why} is no Hugging Face model "
            f"type meshkit writes (gemma: none of them, gemma2: no local rotary, gemma3_text: no attention cap)"
        )
    return kind


def _number(x: float) -> int | float:
    """A whole number as an int (transformers 5.x types ``query_pre_attn_scalar`` as one)."""
    return int(x) if float(x).is_integer() else x


def write(cfg: Any, tied: bool) -> dict:
    kind = type_of(cfg)
    row = TYPES[kind]
    rope = None if cfg.rope_factor == 1 else {"rope_type": "linear", "factor": cfg.rope_factor}
    out = {
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
        "rope_scaling": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": cfg.dtype,
        **NO_SPECIAL,  # transformers' Gemma configs default to eos 1, bos 2, pad 0
    }
    if kind == "gemma":
        return out | {"hidden_act": TANH}
    kinds = ["sliding_attention" if k else "full_attention" for k in cfg.kinds]
    out |= {
        "hidden_activation": TANH,
        "query_pre_attn_scalar": _number(cfg.query_scalar),
        "layer_types": kinds,
        "sliding_window": cfg.window or cfg.seq_len,
        "attn_logit_softcapping": cfg.attn_softcap,
        "final_logit_softcapping": cfg.final_softcap,
    }
    if kind == "gemma3_text":
        out |= {
            "rope_local_base_freq": cfg.local_rope_theta or cfg.rope_theta,
            "use_bidirectional_attention": False,
        }
    return out


def names(cfg: Any, stored: frozenset[str] | None, tied: bool) -> Names:
    yield ("tok_embed",), Source("model.embed_tokens.weight")
    yield ("norm_f", "scale"), Source("model.norm.weight")
    if not cfg.tie_embeddings:
        yield ("unembed",), Source("lm_head.weight", transpose=True)
    layer = "model.layers.{i}."
    norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    if cfg.sandwich:  # Gemma 2's names: post_attention_layernorm is the attention's output norm
        norms = {
            "attn_norm": "input_layernorm",
            "attn_post_norm": "post_attention_layernorm",
            "mlp_norm": "pre_feedforward_layernorm",
            "mlp_post_norm": "post_feedforward_layernorm",
        }
    for leaf, name in norms.items():
        yield ("blocks", leaf, "scale"), Source(f"{layer}{name}.weight")
    for leaf, name in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
        yield ("blocks", "attn", leaf), Source(f"{layer}self_attn.{name}.weight", transpose=True)
    if cfg.qk_norm:
        for leaf in ("q_norm", "k_norm"):
            yield ("blocks", "attn", leaf), Source(f"{layer}self_attn.{leaf}.weight")
    for leaf, name in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        yield ("blocks", "mlp", leaf), Source(f"{layer}mlp.{name}.weight", transpose=True)


def unread(cfg: Any, data: dict) -> frozenset[str]:
    """A tied Gemma reads no head: a checkpoint may still carry one (the embedding's copy)."""
    return frozenset({"lm_head.weight"}) if cfg.tie_embeddings else frozenset()
