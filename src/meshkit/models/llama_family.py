"""The Llama's row in the registry (``meshkit.models.registry``): ``meshkit.models.llama``, read
from and written as ``LlamaForCausalLM`` (Llama-family checkpoints: model_type llama, mistral).

Weights move by name and transpose only: ``meshkit.models.llama`` follows ``LlamaForCausalLM``'s
conventions.
"""

from __future__ import annotations

from typing import Any

from meshkit.models.family import Family, HFFormat, InteropError, Names, Source, check_values, need


def _llama() -> Any:
    from meshkit.models import llama

    return llama


def _check_window(data: dict, where: str) -> None:
    """A sliding window shorter than the model's positions changes attention: meshkit's Llama attends
    to every earlier position, so it is refused by name (a window as long as the positions never binds)."""
    window, positions = data.get("sliding_window"), data.get("max_position_embeddings", 2048)
    if window is not None and data.get("use_sliding_window", True) and window < positions:
        raise InteropError(
            f"{where}: sliding_window={window} (of {positions} positions) is not what meshkit's Llama computes: it "
            f"attends to every earlier position; give a checkpoint whose sliding_window is null"
        )


def _rope_scaling(rope: Any) -> Any:
    """``rope_scaling`` with the default rotary (``{"rope_type": "default"}``, as transformers writes
    it) read as None, which it equals; anything else is returned as it is, to be checked."""
    default = isinstance(rope, dict) and rope and set(rope) <= {"rope_type", "type"}
    return None if default and all(v == "default" for v in rope.values()) else rope


def read(data: dict, where: str, scan_layers: bool) -> Any:
    """meshkit's Llama of a Llama-family ``config.json``."""
    _check_window(data, where)
    data = {**data, "rope_scaling": _rope_scaling(data.get("rope_scaling"))}
    wants = (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("rope_scaling", None))
    check_values(data, where, wants, "Llama")
    heads = need(data, "num_attention_heads", where)
    return _llama().LlamaConfig(
        vocab_size=need(data, "vocab_size", where), seq_len=data.get("max_position_embeddings", 2048),
        layers=need(data, "num_hidden_layers", where), width=need(data, "hidden_size", where), heads=heads,
        kv_heads=data.get("num_key_value_heads") or heads, head_dim=data.get("head_dim") or 0,
        ffn=need(data, "intermediate_size", where), rope_theta=float(data.get("rope_theta", 10000.0)),
        norm_eps=float(data.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(data.get("tie_word_embeddings", False)),
        scan_layers=scan_layers,
    )  # fmt: skip


def write(cfg: Any, tied: bool) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.width, "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": None, "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "torch_dtype": cfg.dtype}  # fmt: skip


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
    for leaf, name in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        yield ("blocks", "mlp", leaf), Source(f"{layer}mlp.{name}.weight", transpose=True)


def unread(cfg: Any) -> frozenset[str]:
    """A tied Llama reads no head: a checkpoint may still carry one (the embedding's copy)."""
    return frozenset({"lm_head.weight"}) if cfg.tie_embeddings else frozenset()


def options_of(cfg: Any) -> dict[str, Any]:
    """``--kv-heads`` (0: as many as the heads) and ``--tie-embeddings`` as a run writes them."""
    return {
        "kv_heads": cfg.kv_heads if cfg.kv_heads != cfg.heads else 0,
        "tie_embeddings": cfg.tie_embeddings,
    }


def check(run: Any) -> str | None:
    """Rotary embeddings rotate pairs: a head's width must be even (from a checkpoint, its head_dim
    decides, checked by the config when it is read)."""
    if run.init_from is None and (run.width // run.heads) % 2:
        return f"--model llama needs an even head width (--width / --heads = {run.width // run.heads}) for rotary embeddings"  # fmt: skip
    return None


def units(cfg: Any) -> dict[str, int]:
    return _llama().units(cfg)


def small(*, layers: int, heads: int, experts: int, scan_layers: bool) -> Any:
    """The Llama ``meshkit verify`` certifies plans on: width 32, ``heads`` query heads and half as many
    key/value heads (grouped-query attention), MLP width 64."""
    return _llama().LlamaConfig(vocab_size=64, seq_len=16, layers=layers, width=32, heads=heads,
                                kv_heads=max(heads // 2, 1), ffn=64, scan_layers=scan_layers, experts=experts)  # fmt: skip


FAMILY = Family(
    name="llama",
    about="rotary, RMSNorm, SwiGLU, grouped-query attention",
    module_name="meshkit.models.llama",
    config_name="LlamaConfig",
    gated=True,
    options=("kv_heads", "tie_embeddings"),
    options_of=options_of,
    check=check,
    units=units,
    kv_cache=True,
    small=small,
    hf=HFFormat(
        label="Llama", model_types=("llama", "mistral"), read=read, write=write, names=names, unread=unread
    ),
)
