"""Model shapes by name for ``meshkit plan --model``, each with where its sizes come from."""

from __future__ import annotations

from meshkit._errors import MeshkitError
from meshkit.planner.layout import ModelShape

PRESETS: dict[str, ModelShape] = {
    # GPT-2 (Radford et al. 2019, Table 2; openai/gpt-2 hparams): vocab 50257, context 1024.
    "gpt2-124m": ModelShape(name="gpt2-124m", layers=12, width=768, heads=12, vocab=50257, seq=1024),
    "gpt2-355m": ModelShape(name="gpt2-355m", layers=24, width=1024, heads=16, vocab=50257, seq=1024),
    "gpt2-774m": ModelShape(name="gpt2-774m", layers=36, width=1280, heads=20, vocab=50257, seq=1024),
    "gpt2-1.5b": ModelShape(name="gpt2-1.5b", layers=48, width=1600, heads=25, vocab=50257, seq=1024),
    # GPT-3 (Brown et al. 2020, Table 2.1): context 2048, GPT-2's vocabulary.
    "gpt-1.3b": ModelShape(name="gpt-1.3b", layers=24, width=2048, heads=16, vocab=50257, seq=2048),
    "gpt-2.7b": ModelShape(name="gpt-2.7b", layers=32, width=2560, heads=32, vocab=50257, seq=2048),
    "gpt-6.7b": ModelShape(name="gpt-6.7b", layers=32, width=4096, heads=32, vocab=50257, seq=2048),
    # (13B: the table's d_model 5140 is not 40 heads x d_head 128; 5120 is)
    "gpt-13b": ModelShape(name="gpt-13b", layers=40, width=5120, heads=40, vocab=50257, seq=2048),
    # LLaMA (Touvron et al. 2023, Table 2; SwiGLU MLP 2/3 * 4d rounded to 256): vocab 32000, context 2048,
    # RMSNorm epsilon 1e-6 (the released params.json). Each gated preset is meshkit's Llama:
    # meshkit.models.llama.LlamaConfig.from_shape(PRESETS[name]).
    "llama-7b": ModelShape(name="llama-7b", layers=32, width=4096, heads=32, vocab=32000, seq=2048,
                           ffn=11008, gated=True, norm_eps=1e-6),
    "llama-13b": ModelShape(name="llama-13b", layers=40, width=5120, heads=40, vocab=32000, seq=2048,
                            ffn=13824, gated=True, norm_eps=1e-6),
    "llama-65b": ModelShape(name="llama-65b", layers=80, width=8192, heads=64, vocab=32000, seq=2048,
                            ffn=22016, gated=True, norm_eps=1e-6),
    # Llama 2 70B (Touvron et al. 2023b; GQA with 8 key/value heads, context 4096, epsilon 1e-5).
    "llama2-70b": ModelShape(name="llama2-70b", layers=80, width=8192, heads=64, vocab=32000, seq=4096,
                             ffn=28672, gated=True, kv_heads=8),
    # Llama 3 8B (meta-llama/llama3 model card and params.json; context 8192, vocab 128256, GQA 8,
    # rotary base 500000).
    "llama3-8b": ModelShape(name="llama3-8b", layers=32, width=4096, heads=32, vocab=128256, seq=8192,
                            ffn=14336, gated=True, kv_heads=8, rope_theta=500000.0),
    # Mixtral-8x7B (Jiang et al. 2024, "Mixtral of Experts", arXiv 2401.04088, Table 1, and
    # mistralai/Mixtral-8x7B-v0.1 config.json): every layer's MLP 8 SwiGLU experts of width 14336,
    # each token routed to 2; GQA 8, vocab 32000, context 32768, rope_theta 1e6. 46.7 B parameters,
    # 12.9 B active per token (the paper's figures; tests/test_planner_axes.py counts them).
    "mixtral-8x7b": ModelShape(name="mixtral-8x7b", layers=32, width=4096, heads=32, vocab=32000, seq=32768,
                               ffn=14336, gated=True, kv_heads=8, rope_theta=1e6, experts=8,
                               experts_per_token=2),
    # Mixtral-8x22B (mistralai/Mixtral-8x22B-v0.1 config.json; Mistral AI's announcement "Cheaper,
    # Better, Faster, Stronger", 2024: 141 B parameters, 39 B active): 56 layers, width 6144, 48 heads,
    # GQA 8, ffn 16384, vocab 32768, context 65536, 8 experts top-2.
    "mixtral-8x22b": ModelShape(name="mixtral-8x22b", layers=56, width=6144, heads=48, vocab=32768, seq=65536,
                                ffn=16384, gated=True, kv_heads=8, rope_theta=1e6, experts=8,
                                experts_per_token=2),
}  # fmt: skip


def preset(name: str) -> ModelShape:
    key = name.strip().lower()
    if key not in PRESETS:
        raise MeshkitError(
            f"unknown model {name!r}: choose one of {', '.join(PRESETS)}, or give --layers --width --heads --vocab --seq"
        )
    return PRESETS[key]
