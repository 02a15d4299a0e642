"""The GPT's row in the registry (``meshkit.models.registry``): meshkit's reference GPT
(``meshkit.models.gpt``), read from and written as GPT-2 (``GPT2LMHeadModel``).

GPT-2 to meshkit's GPT: the key bias of ``c_attn`` is dropped (softmax is invariant to adding
``q . b_k`` to every score of a query, so it changes no output; meshkit's GPT has none), and a
tied ``lm_head`` becomes the ``unembed`` leaf (``wte`` transposed). Written, a GPT whose
``unembed`` is exactly ``tok_embed.T`` is tied, any other untied (``lm_head.weight``).
"""

from __future__ import annotations

from typing import Any

from meshkit.models.family import Family, HFFormat, InteropError, Names, Source, check_values, need


def _gpt() -> Any:
    from meshkit.models import gpt

    return gpt


def read(data: dict, where: str, scan_layers: bool) -> Any:
    """meshkit's GPT of a GPT-2 ``config.json``."""
    wants = (("activation_function", "gelu_new"), ("layer_norm_epsilon", 1e-5), ("scale_attn_by_inverse_layer_idx", False))  # fmt: skip
    check_values(data, where, wants, "GPT")
    width = need(data, "n_embd", where)
    ffn = data.get("n_inner") or 4 * width
    if ffn % width:
        raise InteropError(f"{where}: n_inner {ffn} is no multiple of n_embd {width}, as meshkit's GPT needs")
    return _gpt().GPTConfig(vocab_size=need(data, "vocab_size", where), seq_len=need(data, "n_positions", where),
                            layers=need(data, "n_layer", where), width=width, heads=need(data, "n_head", where),
                            mlp_ratio=ffn // width, scan_layers=scan_layers)  # fmt: skip


def write(cfg: Any, tied: bool) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len, "n_ctx": cfg.seq_len, "n_embd": cfg.width, "n_layer": cfg.layers,
            "n_head": cfg.heads, "n_inner": cfg.mlp_width, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "tie_word_embeddings": tied, "torch_dtype": cfg.dtype}  # fmt: skip


def names(cfg: Any, stored: frozenset[str] | None, tied: bool) -> Names:
    """GPT-2's names: read, with the prefix and the head the checkpoint has; written, as
    ``GPT2LMHeadModel.save_pretrained`` writes them (``transformer.``)."""
    if stored is not None:
        prefix = "transformer." if "transformer.wte.weight" in stored else ""
        tied = "lm_head.weight" not in stored
    else:
        prefix = "transformer."
    d = cfg.width
    yield ("tok_embed",), Source(prefix + "wte.weight")
    yield ("pos_embed",), Source(prefix + "wpe.weight")
    yield ("ln_f", "scale"), Source(prefix + "ln_f.weight")
    yield ("ln_f", "bias"), Source(prefix + "ln_f.bias")
    yield ("unembed",), Source(prefix + "wte.weight" if tied else "lm_head.weight", transpose=True)
    layer = prefix + "h.{i}."
    for ln, name in (("ln1", "ln_1"), ("ln2", "ln_2")):
        yield ("blocks", ln, "scale"), Source(f"{layer}{name}.weight")
        yield ("blocks", ln, "bias"), Source(f"{layer}{name}.bias")
    for leaf, at in (("wq", 0), ("wk", 1), ("wv", 2)):
        yield ("blocks", "attn", leaf), Source(layer + "attn.c_attn.weight", columns=(at * d, (at + 1) * d))
    for leaf, at in (("bq", 0), ("bv", 2)):
        yield ("blocks", "attn", leaf), Source(layer + "attn.c_attn.bias", columns=(at * d, (at + 1) * d))
    for path, name in ((("attn", "wo"), "attn.c_proj.weight"), (("attn", "bo"), "attn.c_proj.bias"),
                       (("mlp", "w_in"), "mlp.c_fc.weight"), (("mlp", "b_in"), "mlp.c_fc.bias"),
                       (("mlp", "w_out"), "mlp.c_proj.weight"), (("mlp", "b_out"), "mlp.c_proj.bias")):  # fmt: skip
        yield ("blocks", *path), Source(layer + name)


def tied(params: Any) -> bool:
    """Written tied when the head is exactly the embedding, transposed."""
    import jax
    import numpy as np

    host = lambda x: np.asarray(jax.device_get(x))  # noqa: E731
    return bool(np.array_equal(host(params["unembed"]), host(params["tok_embed"]).T))


def small(*, layers: int, heads: int, experts: int, scan_layers: bool) -> Any:
    """The GPT ``meshkit verify`` certifies plans on: width 32, 16 positions, 64 tokens."""
    return _gpt().GPTConfig(vocab_size=64, seq_len=16, layers=layers, width=32, heads=heads,
                            scan_layers=scan_layers, experts=experts)  # fmt: skip


FAMILY = Family(
    name="gpt",
    module_name="meshkit.models.gpt",
    config_name="GPTConfig",
    learned_positions=True,
    small=small,
    hf=HFFormat(label="GPT-2", model_types=("gpt2",), read=read, write=write, names=names, tied=tied),
)
