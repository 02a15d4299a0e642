"""How a Llama-family Hugging Face checkpoint (``meshkit.models.llama_hf``) says a mixture of experts:
each model type's names for it (``Experts``: Mixtral's, Qwen3-MoE's, Qwen2-MoE's with its shared expert), its ``config.json`` fields both ways
(``read``, ``write``) and where its router and experts lie among the tensors (``names``).

Experts read dropless (``capacity_factor=0``), as transformers runs them: every token its top-k
experts by softmax probability, the gates renormalised to sum to 1 (Mixtral always, Qwen3-MoE where
``norm_topk_prob``). Each expert is its own tensors in the checkpoint (``experts.{j}``), stacked into
meshkit's ``(E, D, F)`` leaves. Dense layers among the sparse ones (``mlp_only_layers``, ``decoder_sparse_step``)
read as ``LlamaConfig.dense_layers`` with ``intermediate_size`` their width, written as ``mlp_only_layers``. ``router_aux_loss_coef`` is read as the weight of meshkit's
load-balancing loss (``router_aux_weight``; Switch's, per sequence and layer, where transformers pools
the batch and the layers and counts each of the k choices: about k times meshkit's).
``output_router_logits`` (whether transformers returns the router's logits and adds its loss) changes
no logit: read and left aside, written false (4.57.6's ``generate`` fails on a Mixtral with it true).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshkit.models.family import InteropError, Names, Source, flag, need, positive, whole


@dataclass(frozen=True, slots=True)
class Experts:
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
    shared: str | None = None
    """The field of a shared expert's hidden width (Qwen2-MoE's ``shared_expert_intermediate_size``: its
    ``{prefix}.shared_expert`` beside the routed ones, gated by ``{prefix}.shared_expert_gate``); None: none."""
    deepseek: bool = False
    """DeepSeek-V3's (GLM-4.5's): a sigmoid router whose choice adds ``{prefix}.gate.e_score_correction_bias``, in
    groups (``n_group``, ``topk_group``), its gates scaled (``routed_scaling_factor``); ``shared`` the count of
    ungated shared experts (``{prefix}.shared_experts``, their width that count times an expert's); the first
    ``layers`` dense."""
    renormalize_default: bool = False
    """``renormalize``'s value where the config omits it (Qwen's false; DeepSeek-V3's true)."""
    oss: bool = False
    """GPT-OSS's: a router with a bias (``{prefix}.router``), the experts stacked in one tensor each with biases,
    gate and up interleaved in ``gate_up_proj`` ``(E, D, 2F)`` (untransposed), and the clamped SwiGLU
    (``swiglu_limit``, ``swiglu_alpha``: 5.x's fields; 4.57 computes 7.0 and 1.702 whatever they say)."""


MIXTRAL = Experts(("num_local_experts",), "intermediate_size", None, "block_sparse_moe", ("w1", "w3", "w2"))
"""Mixtral's: its gates always renormalised, every layer sparse."""
QWEN3_MOE = Experts(
    ("num_experts", "num_local_experts"),
    "moe_intermediate_size",
    "norm_topk_prob",
    "mlp",
    ("gate_proj", "up_proj", "down_proj"),
    ("decoder_sparse_step", "mlp_only_layers"),
)
"""Qwen3-MoE's: 4.x's and 5.x's names of the count, its gates renormalised where ``norm_topk_prob``."""
QWEN2_MOE = Experts(
    ("num_experts",),
    "moe_intermediate_size",
    "norm_topk_prob",
    "mlp",
    ("gate_proj", "up_proj", "down_proj"),
    ("decoder_sparse_step", "mlp_only_layers"),
    "shared_expert_intermediate_size",
)
"""Qwen2-MoE's: Qwen3-MoE's names, and a gated shared expert."""
GPT_OSS = Experts(
    ("num_local_experts",), "intermediate_size", None, "mlp", ("gate_up_proj", "", "down_proj"), oss=True
)
"""GPT-OSS's: the softmax of the top-k logits (the renormalised gates), biases, the clamped SwiGLU."""
GLM4_MOE = Experts(
    ("n_routed_experts",),
    "moe_intermediate_size",
    "norm_topk_prob",
    "mlp",
    ("gate_proj", "up_proj", "down_proj"),
    ("first_k_dense_replace",),
    "n_shared_experts",
    deepseek=True,
    renormalize_default=True,
)
"""GLM-4.5's: DeepSeek-V3's mixture of experts."""
_DEEPSEEK = ("n_group", "topk_group", "routed_scaling_factor", "num_nextn_predict_layers")
"""DeepSeek-V3's router fields, and its multi-token-prediction layers' count (``mtp_layers``)."""
SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}
"""GPT-OSS's clamped SwiGLU as 4.57 computes it (constants) and 5.x by default (fields)."""

_READ = frozenset({"num_experts_per_tok", "output_router_logits", "router_aux_loss_coef"})
"""Fields every mixture-of-experts row reads, besides those its ``Experts`` names."""


def fields(moe: Experts | None) -> frozenset[str]:
    """The ``config.json`` fields a model type with experts ``moe`` reads for them (none for a dense one)."""
    if moe is None:
        return frozenset()
    own = ({moe.renormalize, moe.shared} - {None}) | (set(SWIGLU) if moe.oss else set())
    own |= set(_DEEPSEEK) if moe.deepseek else set()
    return frozenset({*moe.count, moe.ffn, *moe.layers, *_READ} | own)


def read(data: dict, where: str, moe: Experts | None, layers: int) -> dict[str, Any]:
    """The ``LlamaConfig`` fields of a mixture of experts named as ``moe`` names it (none for a dense model
    type): dropless."""
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
    dense = _dense(data, where, moe, layers)
    aux = positive(data.get("router_aux_loss_coef", 0.001), f"{where}: router_aux_loss_coef", zero=True)
    out = {
        "dense_layers": dense if any(dense) else None,
        "dense_ffn": whole(data, "intermediate_size", where) if any(dense) else 0,
        "experts": experts,
        "shared_ffn": whole(data, moe.shared, where, *((1,) if moe.deepseek else ())) if moe.shared else 0,
        "experts_per_token": whole(data, "num_experts_per_tok", where),
        "ffn": whole(data, moe.ffn, where),
        "capacity_factor": 0.0,
        "router_aux_weight": aux,
        "router_renormalize": moe.renormalize is None
        or flag(data, moe.renormalize, where, moe.renormalize_default),
    } | (_swiglu(data, where) if moe.oss else {})
    return out | _deepseek(data, where, out) if moe.deepseek else out


def _deepseek(data: dict, where: str, out: dict) -> dict[str, Any]:
    """DeepSeek-V3's router and its ungated shared experts (``n_shared_experts`` of an expert's width); its
    multi-token-prediction count checked here, by the config's name, and left aside (``mtp_layers``)."""
    whole(data, "num_nextn_predict_layers", where, 0, least=0)
    return {
        "sigmoid_router": True,
        "expert_groups": whole(data, "n_group", where, 1, least=1),
        "top_groups": whole(data, "topk_group", where, 1, least=1),
        "routed_scale": positive(data.get("routed_scaling_factor", 1.0), f"{where}: routed_scaling_factor"),
        "shared_gate": False,
        "shared_ffn": out["shared_ffn"] * out["ffn"],
    }


def _swiglu(data: dict, where: str) -> dict[str, Any]:
    """GPT-OSS's ``LlamaConfig`` switches: biases and the clamped SwiGLU, its fields as the writer computes them
    (5.x reads them; 4.57 computes ``SWIGLU`` whatever they say: a 4.x-written config that says otherwise is
    refused, as is one that says by no ``transformers_version`` which wrote it)."""
    said = {k: positive(data.get(k, v), f"{where}: {k}") for k, v in SWIGLU.items()}
    if said != SWIGLU and major_version(data) != 5:
        raise InteropError(
            f"{where}: {', '.join(f'{k}={v}' for k, v in said.items())} in a config transformers "
            f"{data.get('transformers_version', '(unnamed)')} wrote, and 4.57 computes {SWIGLU}: the checkpoint "
            f"has two meanings; give those values, or the transformers_version 5.x that computes these"
        )
    return {"moe_bias": True, **said}


def major_version(data: dict) -> int | None:
    """The major version of transformers that wrote a config (``transformers_version``), or None."""
    version = data.get("transformers_version")
    head = version.split(".")[0] if isinstance(version, str) else ""
    return int(head) if head.isdigit() else None


def _dense(data: dict, where: str, moe: Experts, layers: int) -> tuple[bool, ...]:
    """Which layers run a dense MLP of ``intermediate_size`` (transformers' rule: those ``mlp_only_layers``
    names, and each whose number plus one ``decoder_sparse_step`` does not divide)."""
    if not moe.layers:
        return (False,) * layers
    if moe.deepseek:  # the first first_k_dense_replace layers
        first = whole(data, "first_k_dense_replace", where, 1, least=0)
        dense = tuple(i < first for i in range(layers))
        if all(dense):
            raise InteropError(
                f"{where}: first_k_dense_replace={first} of {layers} layers makes every layer a dense MLP: give the "
                f"checkpoint as its dense model type"
            )
        return dense
    step, only = whole(data, "decoder_sparse_step", where, 1, least=1), data.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise InteropError(f"{where}: mlp_only_layers={only!r} is not a list of layer numbers: give one")
    dense = tuple(i in only or bool((i + 1) % step) for i in range(layers))
    if all(dense):
        raise InteropError(
            f"{where}: decoder_sparse_step={step!r}, mlp_only_layers={only!r} make every layer a dense MLP: give "
            f"the checkpoint as its dense model type"
        )
    return dense


def mtp_layers(data: dict, row: Any) -> int:
    """The multi-token-prediction layers a DeepSeek-V3-style checkpoint carries past its last layer
    (``num_nextn_predict_layers``: GLM-4.5's one), which transformers builds no module for and leaves unread:
    read and left aside too (0 for any other type)."""
    moe = getattr(row, "experts", None)
    if moe is None or not moe.deepseek:
        return 0
    return whole(data, "num_nextn_predict_layers", "config.json", 0, least=0)


def fits(moe: Experts | None, cfg: Any) -> bool:
    """Whether a type with experts ``moe`` (None: a dense type) can say ``cfg``'s router: DeepSeek-V3's (its
    sigmoid scores, groups, scale, ungated shared experts of whole experts' width, dense layers first) only
    in a DeepSeek-V3 type, and no other type's router there."""
    deepseek = moe is not None and moe.deepseek
    if cfg.sigmoid_router != deepseek:
        return False
    if not deepseek:
        return (cfg.expert_groups, cfg.top_groups, cfg.routed_scale) == (1, 1, 1.0) and cfg.shared_gate
    dense = cfg.dense_layers or ()
    first = sum(dense)
    whole_experts = cfg.shared_ffn > 0 and cfg.shared_ffn % cfg.ffn == 0
    return (
        whole_experts and not cfg.shared_gate and tuple(dense) == tuple(i < first for i in range(len(dense)))
    )


def write(cfg: Any, moe: Experts | None) -> dict[str, Any]:
    """The mixture-of-experts fields of ``cfg`` named as ``moe`` names them (none for a dense model type;
    every layer sparse; written dropless, as transformers runs it, whatever capacity the model trained with)."""
    if moe is None:
        return {}
    out = {
        moe.count[0]: cfg.experts,
        "num_experts_per_tok": cfg.experts_per_token,
        moe.ffn: cfg.ffn,
        "output_router_logits": False,
        "router_aux_loss_coef": cfg.router_aux_weight,
    }
    if moe.renormalize is not None:
        out[moe.renormalize] = cfg.router_renormalize
    if moe.shared is not None:
        out[moe.shared] = cfg.shared_ffn
    if moe.oss:
        out |= {"swiglu_limit": cfg.swiglu_limit, "swiglu_alpha": cfg.swiglu_alpha}
    if moe.deepseek:
        first = sum(cfg.dense_layers or ())
        out |= {
            "n_group": cfg.expert_groups,
            "topk_group": cfg.top_groups,
            "routed_scaling_factor": cfg.routed_scale,
            "num_nextn_predict_layers": 0,  # an export carries none
        }
        out |= {moe.shared: cfg.shared_ffn // cfg.ffn, "first_k_dense_replace": first}
        return out | ({"intermediate_size": cfg.dense_ffn} if first else {})
    if not moe.layers:
        return out
    dense = [i for i, d in enumerate(cfg.dense_layers or ()) if d]
    return (
        out
        | {"decoder_sparse_step": 1, "mlp_only_layers": dense}
        | ({"intermediate_size": cfg.dense_ffn} if dense else {})
    )


def names(moe: Experts, layer: str, ffn: int) -> Names:
    """Where a layer's router and experts lie (``layer``: the layer's prefix, ``{i}`` for its number; ``ffn``:
    an expert's hidden width)."""
    if moe.oss:
        yield from _oss_names(f"{layer}{moe.prefix}.", ffn)
        return
    yield ("blocks", "moe", "router"), Source(f"{layer}{moe.prefix}.gate.weight", transpose=True)
    if moe.deepseek:
        yield (
            ("blocks", "moe", "router_choice_bias"),
            Source(f"{layer}{moe.prefix}.gate.e_score_correction_bias"),
        )
    for leaf, name in zip(("w_gate", "w_up", "w_down"), moe.weights, strict=True):
        yield (
            ("blocks", "moe", leaf),
            Source(f"{layer}{moe.prefix}.experts.{{j}}.{name}.weight", True, experts=True),
        )
    if moe.shared is None:
        return
    shared = "shared_experts" if moe.deepseek else "shared_expert"
    for leaf, name in zip(("w_gate", "w_up", "w_down"), moe.weights, strict=True):
        yield (
            ("blocks", "shared", leaf),
            Source(f"{layer}{moe.prefix}.{shared}.{name}.weight", transpose=True),
        )
    if moe.deepseek:
        return
    yield (
        ("blocks", "shared", "w_shared_gate"),
        Source(f"{layer}{moe.prefix}.shared_expert_gate.weight", transpose=True),
    )


def _oss_names(mlp: str, ffn: int) -> Names:
    """GPT-OSS's router and experts (``mlp``: the layer's MLP prefix): each a whole stacked tensor, gate and up
    the even and odd columns of ``gate_up_proj`` and of its bias."""
    yield ("blocks", "moe", "router"), Source(f"{mlp}router.weight", transpose=True)
    yield ("blocks", "moe", "router_bias"), Source(f"{mlp}router.bias")
    for suffix, kind in (("", "w"), ("_bias", "b")):
        for half, lo in (("gate", 0), ("up", 1)):
            columns = Source(f"{mlp}experts.gate_up_proj{suffix}", columns=(lo, 2 * ffn), step=2)
            yield ("blocks", "moe", f"{kind}_{half}"), columns
        yield ("blocks", "moe", f"{kind}_down"), Source(f"{mlp}experts.down_proj{suffix}")
