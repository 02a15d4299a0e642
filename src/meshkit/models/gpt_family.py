"""The GPT's row in the registry (``meshkit.models.registry``): meshkit's reference GPT
(``meshkit.models.gpt``), read from and written as GPT-2 (``GPT2LMHeadModel``).

GPT-2 to meshkit's GPT: the key bias of ``c_attn`` is dropped (softmax is invariant to adding
``q . b_k`` to every score of a query, so it changes no output; meshkit's GPT has none), and a
tied ``lm_head`` becomes the ``unembed`` leaf (``wte`` transposed). Written, a GPT whose
``unembed`` is exactly ``tok_embed.T`` is tied, any other untied (``lm_head.weight``).
"""

from __future__ import annotations

from typing import Any

from meshkit.models.family import (
    HF_METADATA,
    Family,
    HFFormat,
    InteropError,
    Names,
    Source,
    check_fields,
    check_values,
    flag,
    whole,
)


def _gpt() -> Any:
    from meshkit.models import gpt

    return gpt


_WANTS = (
    ("activation_function", "gelu_new"),
    ("layer_norm_epsilon", 1e-5),
    ("scale_attn_weights", True),
    ("scale_attn_by_inverse_layer_idx", False),
)
"""GPT-2's fields that change the computation, each with the one value meshkit's GPT computes (its GELU is
the tanh approximation, its LayerNorm's epsilon 1e-5, its attention scaled by ``1/sqrt(head_dim)``)."""
_READ = frozenset(
    {"vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "tie_word_embeddings"}
)
_IGNORED = frozenset(
    {
        # dropout: no logit changes (meshkit trains without it)
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        # GPT2DoubleHeadsModel's classification head, which GPT2LMHeadModel has not
        "summary_type",
        "summary_use_proj",
        "summary_activation",
        "summary_proj_to_labels",
        "summary_first_dropout",
        # the scores in float32 with the scale applied before the product: float32's rounding, not another model
        "reorder_and_upcast_attn",
        # older releases' fields no GPT-2 class reads now (n_ctx: n_positions' copy; OpenAI GPT's special tokens)
        "n_ctx",
        "n_special",
        "predict_special_tokens",
        "gradient_checkpointing",
    }
)
"""GPT-2's fields that change no logit of ``GPT2LMHeadModel``: read and left aside."""


def read(data: dict, where: str, scan_layers: bool) -> Any:
    """meshkit's GPT of a GPT-2 ``config.json``: its own fields read (``_READ``), those that change the
    computation checked (``_WANTS``), those that change no logit left aside (``_IGNORED``), any other refused
    by name, as the Llama's and the Gemma's formats do."""
    check_fields(data, where, _READ | {k for k, _ in _WANTS} | _IGNORED | HF_METADATA, "GPT (gpt2)")
    check_values(data, where, _WANTS, "GPT")
    flag(data, "tie_word_embeddings", where, True)  # which head is read: the checkpoint's tensors say (names)
    width = whole(data, "n_embd", where)
    ffn = whole(data, "n_inner", where) if data.get("n_inner") is not None else 4 * width
    if ffn % width:
        raise InteropError(f"{where}: n_inner {ffn} is no multiple of n_embd {width}, as meshkit's GPT needs")
    try:
        return _gpt().GPTConfig(
            vocab_size=whole(data, "vocab_size", where),
            seq_len=whole(data, "n_positions", where),
            layers=whole(data, "n_layer", where),
            width=width,
            heads=whole(data, "n_head", where),
            mlp_ratio=ffn // width,
            scan_layers=scan_layers,
        )
    except ValueError as e:  # the GPT's own check (heads dividing the width)
        raise InteropError(f"{where}: {e}") from None


def write(cfg: Any, tied: bool) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.seq_len,
        "n_ctx": cfg.seq_len,
        "n_embd": cfg.width,
        "n_layer": cfg.layers,
        "n_head": cfg.heads,
        "n_inner": cfg.mlp_width,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": tied,
        "torch_dtype": cfg.dtype,
    }


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
    for path, name in (
        (("attn", "wo"), "attn.c_proj.weight"),
        (("attn", "bo"), "attn.c_proj.bias"),
        (("mlp", "w_in"), "mlp.c_fc.weight"),
        (("mlp", "b_in"), "mlp.c_fc.bias"),
        (("mlp", "w_out"), "mlp.c_proj.weight"),
        (("mlp", "b_out"), "mlp.c_proj.bias"),
    ):
        yield ("blocks", *path), Source(layer + name)


def head(cfg: Any, data: dict, stored: frozenset[str], where: str) -> tuple[str, str] | None:
    """GPT-2's head is read as the checkpoint stores it (``names``): ``lm_head.weight`` where there is one,
    else ``wte``. A config that ties it (the default) beside a stored head must hold the embedding there
    (``HFFormat.head``); one that unties it must store it: transformers would make a random head."""
    tie = flag(data, "tie_word_embeddings", where, True)
    if "lm_head.weight" not in stored:
        if not tie:
            raise InteropError(
                f"{where}: tie_word_embeddings=false but the checkpoint has no lm_head.weight: transformers would "
                f"make a random head; give the checkpoint's lm_head.weight, or tie_word_embeddings true"
            )
        return None
    prefix = "transformer." if "transformer.wte.weight" in stored else ""
    return ("lm_head.weight", prefix + "wte.weight") if tie else None


def tied(params: Any) -> bool:
    """Written tied when the head is exactly the embedding, transposed."""
    import jax
    import numpy as np

    host = lambda x: np.asarray(jax.device_get(x))  # noqa: E731
    return bool(np.array_equal(host(params["unembed"]), host(params["tok_embed"]).T))


def small(*, layers: int, heads: int, experts: int, scan_layers: bool) -> Any:
    """The GPT ``meshkit verify`` certifies plans on: width 32, 16 positions, 64 tokens."""
    return _gpt().GPTConfig(
        vocab_size=64,
        seq_len=16,
        layers=layers,
        width=32,
        heads=heads,
        scan_layers=scan_layers,
        experts=experts,
    )


FAMILY = Family(
    name="gpt",
    module_name="meshkit.models.gpt",
    config_name="GPTConfig",
    learned_positions=True,
    small=small,
    hf=HFFormat(
        label="GPT-2", model_types=("gpt2",), read=read, write=write, names=names, tied=tied, head=head
    ),
)
