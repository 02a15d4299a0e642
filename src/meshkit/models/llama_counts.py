"""What a Llama (``meshkit.models.llama``) counts for its cost: the parameters that multiply activations
(a mixture of experts: those a token's routed experts, its shared expert and a dense layer's MLP hold)
and the training FLOPs per token (PaLM's ``6 N + 12 L T (H h)``, a window counting the keys it sees)."""

from __future__ import annotations

from typing import Any


def matmul_params(cfg: Any) -> int:
    """Parameters that multiply activations: every matrix but the embedding lookup (the tied head
    counts once, as a matmul); a mixture of experts those a token multiplies (``experts_per_token``
    MLPs and the router)."""
    d, f, q, kv = cfg.width, cfg.ffn, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    routed = (
        cfg.experts_per_token * 3 * d * f
        + d * cfg.experts
        + (3 * d * cfg.shared_ffn + d if cfg.shared_ffn else 0)
    )
    dense = (
        3 * d * (cfg.dense_ffn if cfg.experts else f)
    )  # a dense model's MLP, or a dense layer's among routed
    extra = (q + 2 * kv if cfg.qkv_bias else 0) + (2 * cfg.head_dim if cfg.qk_norm else 0)
    extra += q + kv if cfg.qk_norm_whole else 0
    block = 2 * d * q + 2 * d * kv + 2 * d + extra
    mlps = cfg.sparse_layers * routed + (cfg.layers - cfg.sparse_layers) * dense
    return cfg.layers * block + mlps + d + d * cfg.vocab_size


def flops_per_token(cfg: Any, seq_len: int | None = None) -> int:
    """Training FLOPs per token at a context of ``seq_len`` tokens (the run's sequence; default the
    config's ``seq_len``, which is a checkpoint's max_position_embeddings): ``6 N + 12 L T (H h)``
    (PaLM, appendix B), a layer with a window counting the ``min(T, window)`` keys a query may see."""
    t = cfg.seq_len if seq_len is None else seq_len
    seen = sum(t if w is None else min(t, w) for w in cfg.layer_windows)
    return 6 * matmul_params(cfg) + 12 * seen * cfg.heads * cfg.head_dim
