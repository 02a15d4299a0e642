"""The model types the Llama family reads and writes (``meshkit.models.llama_hf``): one row each, naming the
switches of ``meshkit.models.llama.LlamaConfig`` it sets, its window's kind, its experts and its defaults. Kept
apart from the reading and writing, which ask it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshkit.models.llama_hf_experts import GLM4_MOE, GPT_OSS, MIXTRAL, QWEN2_MOE, QWEN3_MOE, Experts


@dataclass(frozen=True, slots=True)
class Type:
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
    qkv_bias: bool | str
    """Biases on q/k/v (a str: the config field that says whether, false where omitted: GLM-4.5's
    ``attention_bias``)."""
    qk_norm: bool | str
    """Per-head q/k norms (a str: the field that says whether: GLM-4.5's ``use_qk_norm``)."""
    window: str
    """How its window reads (a key of ``llama_hf_windows.WINDOWS``)."""
    wants: tuple[tuple[str, Any], ...]
    """Fields of its own, each with the one value meshkit computes."""
    experts: Experts | None = None
    """Its mixture of experts (None: a dense MLP)."""
    default_window: int | None = None
    """``sliding_window`` where the config omits it (and, for a gated row, turns it on): transformers'
    default for the type, 4096 in 4.57.6 and 5.25.0 alike, which binds from position 4096 on."""
    slides: bool = True
    """Whether its window reads (Qwen2-MoE's does not: with ``use_sliding_window`` 4.57.6 slides every layer
    under sdpa and eager attention and those from ``max_window_layers`` under flash attention, 5.x those
    ``layer_types`` names: the checkpoint has no one meaning)."""
    olmo: bool = False
    """OLMo 2's block: norms after the sublayers (``post_norms``) and q/k norms over the heads' whole width
    (``qk_norm_whole``), stored as ``post_attention_layernorm``, ``post_feedforward_layernorm``, ``q_norm``,
    ``k_norm``."""
    phi: bool = False
    """Phi-3's: q/k/v and gate/up stored fused (``qkv_proj``, ``gate_up_proj``, ``LlamaConfig.fused``), a partial
    rotary (``partial_rotary_factor``), no rope scaling but longrope (which its transformers class alone
    takes, in 4.57 and 5.x), and ``original_max_position_embeddings``, which only longrope reads."""
    partial: float | None = None
    """The share of each head the rotary turns where the config omits ``partial_rotary_factor`` (None: the type
    reads none, the whole head); a type with a partial rotary takes no rope scaling (none checked against
    transformers)."""
    oss: bool = False
    """GPT-OSS's: attention sinks, a bias on the output projection, norms scaled in float32, its experts'
    (``llama_hf_experts.GPT_OSS``), and its YaRN where the config names no rotary (``llama_hf_oss``)."""


TYPES: dict[str, Type] = {
    "llama": Type(
        architecture="LlamaForCausalLM",
        positions=2048,
        head_dim=None,
        kv_heads=None,
        theta=1e4,
        eps=1e-6,
        qkv_bias=False,
        qk_norm=False,
        window="none",
        wants=(("attention_bias", False), ("mlp_bias", False)),
    ),
    "mistral": Type(
        architecture="MistralForCausalLM",
        positions=131072,
        head_dim=None,
        kv_heads=8,
        theta=1e4,
        eps=1e-6,
        qkv_bias=False,
        qk_norm=False,
        window="every",
        wants=(),
        default_window=4096,
    ),
    "qwen2": Type(
        architecture="Qwen2ForCausalLM",
        positions=32768,
        head_dim=None,
        kv_heads=32,
        theta=1e4,
        eps=1e-6,
        qkv_bias=True,
        qk_norm=False,
        window="qwen",
        wants=(),
        default_window=4096,
    ),
    "qwen3": Type(
        architecture="Qwen3ForCausalLM",
        positions=32768,
        head_dim=128,
        kv_heads=32,
        theta=1e4,
        eps=1e-6,
        qkv_bias=False,
        qk_norm=True,
        window="qwen",
        wants=(("attention_bias", False),),
        default_window=4096,
    ),
    "mixtral": Type(
        architecture="MixtralForCausalLM",
        positions=131072,
        head_dim=None,
        kv_heads=8,
        theta=1e6,
        eps=1e-5,
        qkv_bias=False,
        qk_norm=False,
        window="every",
        wants=(("router_jitter_noise", 0.0),),
        experts=MIXTRAL,
    ),
    "qwen3_moe": Type(
        architecture="Qwen3MoeForCausalLM",
        positions=32768,
        head_dim=None,
        kv_heads=4,
        theta=1e4,
        eps=1e-6,
        qkv_bias=False,
        qk_norm=True,
        window="gated",
        wants=(("attention_bias", False),),
        experts=QWEN3_MOE,
        default_window=4096,
    ),
    "qwen2_moe": Type(
        architecture="Qwen2MoeForCausalLM",
        positions=32768,
        head_dim=None,
        kv_heads=16,
        theta=1e4,
        eps=1e-6,
        qkv_bias=True,
        qk_norm=False,
        window="qwen",
        wants=(("qkv_bias", True),),
        experts=QWEN2_MOE,
        default_window=4096,
        slides=False,
    ),
    "phi3": Type(
        architecture="Phi3ForCausalLM",
        positions=4096,
        head_dim=None,
        kv_heads=None,
        theta=1e4,
        eps=1e-5,
        qkv_bias=False,
        qk_norm=False,
        window="every",
        wants=(("resid_pdrop", 0.0), ("embd_pdrop", 0.0), ("attention_bias", False)),
        phi=True,
        partial=1.0,
    ),
    "olmo2": Type(
        architecture="Olmo2ForCausalLM",
        positions=2048,
        head_dim=None,
        kv_heads=None,
        theta=1e4,
        eps=1e-5,
        qkv_bias=False,
        qk_norm=False,
        window="none",
        wants=(("attention_bias", False),),
        olmo=True,
    ),
    "gpt_oss": Type(
        architecture="GptOssForCausalLM",
        positions=131072,
        head_dim=64,
        kv_heads=8,
        theta=150000.0,
        eps=1e-5,
        qkv_bias=True,
        qk_norm=False,
        window="layers",
        wants=(("attention_bias", True),),
        experts=GPT_OSS,
        default_window=128,
        oss=True,
    ),
    "glm4_moe": Type(
        architecture="Glm4MoeForCausalLM",
        positions=131072,
        head_dim=None,
        kv_heads=8,
        theta=1e4,
        eps=1e-5,
        qkv_bias="attention_bias",
        qk_norm="use_qk_norm",
        window="none",
        wants=(),
        experts=GLM4_MOE,
        partial=0.5,
    ),
}
"""The model types read; a config is written as the first whose switches, window and experts it has."""
