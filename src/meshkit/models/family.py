"""A model family's row, the contract between a family and the rest of meshkit: what a family
says of itself (``Family``), its Hugging Face format (``HFFormat``: ``config.json`` both ways, its
weights' names as ``Source``s), and the helpers its hooks share. ``meshkit.models.registry`` lists
the rows; each family's row module (``gpt_family.py``, ``llama_family.py``) fills one in.

Nothing here imports JAX: a row names its model module, imported on first use.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from meshkit._errors import MeshkitError


class InteropError(MeshkitError):
    """A checkpoint cannot be read or written as asked."""


@dataclass(frozen=True, slots=True)
class Source:
    """Where one meshkit tensor (one layer's, for a stacked leaf) lives in a Hugging Face checkpoint."""

    name: str
    transpose: bool = False
    columns: tuple[int, int] | None = None
    """A column range of the stored tensor (after any transpose): GPT-2's fused ``c_attn``."""
    step: int = 1
    """Every ``step``-th column of that range (GPT-OSS's ``gate_up_proj``: gate and up interleaved)."""
    experts: bool = False
    """One tensor per expert (``{j}`` in the name), stacked as the leaf's first dim (its expert dim)."""


Names = Iterator[tuple[tuple, Source]]
"""(meshkit path within one layer or at the top, source); layer paths start with ``"blocks"``."""


def _never_tied(params: Any) -> bool:
    return False


def _nothing_unread(cfg: Any, data: dict) -> frozenset[str]:
    return frozenset()


def tied_lm_head(cfg: Any, data: dict, stored: frozenset[str], where: str) -> tuple[str, str] | None:
    """``HFFormat.head`` of a format named as ``LlamaForCausalLM``'s (the Llama's and the Gemma's): a tied
    config's ``lm_head.weight`` where the checkpoint stores one, beside ``model.embed_tokens.weight``."""
    tied = getattr(cfg, "tie_embeddings", False) and "lm_head.weight" in stored
    return ("lm_head.weight", "model.embed_tokens.weight") if tied else None


def _no_head(cfg: Any, data: dict, stored: frozenset[str], where: str) -> tuple[str, str] | None:
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class HFFormat:
    """A family's Hugging Face checkpoint format, as ``meshkit.interop`` asks it."""

    label: str
    """How messages name a checkpoint of it ('GPT-2', 'Llama')."""
    model_types: tuple[str, ...]
    """``config.json`` ``model_type`` values read as this family; the first is written."""
    read: Callable[[dict, str, bool], Any]
    """``(config.json, where, scan_layers) -> config``; raises ``InteropError`` naming what differs."""
    write: Callable[[Any, bool], dict]
    """``(config, tied) -> config.json`` (``tied``: the head written as the embedding)."""
    names: Callable[[Any, frozenset[str] | None, bool], Names]
    """``(config, tensor names of the checkpoint read, or None when writing, tied)`` -> where each
    leaf lives."""
    tied: Callable[[Any], bool] = _never_tied
    """Parameters (loop form) -> whether they are written with the head tied to the embedding."""
    unread: Callable[[Any, dict], frozenset[str]] = _nothing_unread
    """Config -> tensor names a checkpoint of it may hold that no leaf reads (a tied model's head)."""
    head: Callable[[Any, dict, frozenset[str], str], tuple[str, str] | None] = _no_head
    """``(config, config.json, the checkpoint's tensor names, where)`` -> ``(head, embedding)``: a head the
    config ties to the embedding but the checkpoint stores too, which must equal it (transformers 4.x
    computes the embedding, 5.x the stored head); None where there is none. Raises where the config unties a
    head the checkpoint lacks (transformers would make a random one)."""


def _heads(cfg: Any) -> dict[str, int]:
    return {"heads": cfg.heads}


def _no_check(run: Any) -> str | None:
    return None


def _no_options(cfg: Any) -> dict[str, Any]:
    return {}


def _vocab_rules(pipeline: bool) -> dict[str, str]:
    from meshkit.plans.tp_rules import vocab_rules

    return vocab_rules(pipeline)


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """One decoder family: everything meshkit asks of it by name."""

    name: str
    """``--model``'s value, ``ModelShape.name``."""
    about: str = ""
    """What ``--model``'s help says of it beside its name ('': nothing)."""
    module_name: str
    """The model module: ``init``, ``apply``, ``make_loss``, ``stages``, ``logical_axes``, ``flops_per_token``,
    ``decode`` (generation's forward over a key/value cache)."""
    config_name: str
    """The config class in that module (``from_shape(shape, precision=, scan_layers=)``, ``shape()``)."""
    config_module: str = ""
    """The module defining that class where it is not the model module ('': the model module)."""
    gated: bool = False
    """``ModelShape.gated``: a SwiGLU MLP (the planner's formulas follow it)."""
    options: tuple[str, ...] = ()
    """``meshkit train`` options only this family takes, each a ``ModelShape`` field of the same name."""
    options_of: Callable[[Any], dict[str, Any]] = _no_options
    """Config -> the values of ``options`` it fixes, as the run writes them (``--init-from`` compares)."""
    learned_positions: bool = False
    """Its positions end at ``seq_len`` (a learned table): a run's sequence may not be longer."""
    check: Callable[[Any], str | None] = _no_check
    """A run's model options (``TrainConfig.model``) -> why the family cannot train them, or None."""
    units: Callable[[Any], dict[str, int]] = _heads
    """Config -> logical axes of whole units (``{"heads": 8}``), checked against the model axis."""
    rules: Callable[[bool], dict[str, str]] = _vocab_rules
    """Pipeline or not -> tensor-parallel rules (logical axis -> mesh axis)."""
    small: Callable[..., Any]
    """``(layers=, heads=, experts=, scan_layers=)`` -> the small config ``meshkit verify`` certifies plans on."""
    hf: HFFormat | None = None
    """Its Hugging Face format (None: no checkpoint is read or written for it)."""

    @property
    def module(self) -> Any:
        return importlib.import_module(self.module_name)

    def training_loss(
        self, model: Any, *, pipeline: bool, loss_chunk: int = 0, quantize: str = "none"
    ) -> tuple[Callable, bool]:
        """``(loss, has_aux)``: what a run trains ``model`` (this family's config) with, as ``meshkit train``
        and the planner's compile check build its step. Under a pipeline plan the model as ``Stages``; else
        its loss, which for a mixture of experts returns the dropped slots as metrics (``has_aux``), its head
        and loss ``loss_chunk`` positions at a time where given (``--loss-chunk``), its blocks' matmuls in
        ``quantize`` (``--quantize``: ``models.quantize``)."""
        if pipeline:
            return self.module.stages(model), False
        from meshkit.models import quantize as quantized  # JAX, on first use: the registry's rows need none

        aux = bool(getattr(model, "experts", 0))
        return quantized.wrap(
            self.module.make_loss(model, with_aux=aux, loss_chunk=loss_chunk), quantize
        ), aux

    @property
    def config(self) -> type:
        return getattr(self.module, self.config_name)


def need(data: dict, key: str, where: str) -> Any:
    """``data[key]`` of a ``config.json``; its absence raises, naming the key."""
    if key not in data:
        raise InteropError(f"{where} lacks {key!r}: it is not a complete Hugging Face config")
    return data[key]


REQUIRED: Any = object()
"""``whole``'s default for a field the config must hold."""


def whole(data: dict, key: str, where: str, default: Any = REQUIRED, *, least: int = 1) -> int:
    """An integer field of a ``config.json`` (a count, a width, a length): ``default`` where the config omits
    it. A string, a bool, a fraction, null or a number under ``least`` is refused by name: transformers would
    fail on it somewhere else, or build another model."""
    value = need(data, key, where) if default is REQUIRED else data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InteropError(f"{where}: {key}={value!r} is not a whole number of at least {least}: give one")
    return value


def whole_or_null(data: dict, key: str, where: str, default: int | None) -> int | None:
    """A whole-number field whose null (or absence, where the type has no default) transformers computes
    from others (``num_key_value_heads``: the heads; ``head_dim``: the width over the heads): None there."""
    value = data.get(key, default)
    return None if value is None else whole({key: value}, key, where)


def positive(value: Any, said: str, *, zero: bool = False) -> float:
    """A number the computation uses (an epsilon, a rotary base or factor, a soft cap, a scale), checked:
    finite and above 0 (at least 0 where ``zero``). NaN, an infinity or a sign no model has would be
    computed without a word and give NaN or another model; ``said`` names the field ('config.json:
    rms_norm_eps')."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not (value >= 0 if zero else value > 0)
    ):
        raise InteropError(
            f"{said}={value!r} is not a finite number {'of at least' if zero else 'above'} 0: give the model's own"
        )
    return float(value)


def flag(data: dict, key: str, where: str, default: bool) -> bool:
    """A true/false field of a ``config.json`` (null reads as false, as transformers tests it). A string or a
    number is refused: ``"false"`` is true to transformers."""
    value = data.get(key, default)
    if value is not None and not isinstance(value, bool):
        raise InteropError(f"{where}: {key}={value!r} is not true or false: give one")
    return bool(value)


NO_SPECIAL = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
"""Written by a model type whose transformers config defaults to special ids (Gemma's eos 1, bos 2, pad 0;
Phi-3's pad 32000; OLMo 2's pad 1, eos 50279) unless the export names its own (``interop.save(special=)``):
else transformers' ``generate`` stops at an id meshkit never meant, or a pad id past a small vocabulary
does not load."""

HF_METADATA = frozenset(
    {
        "_name_or_path",
        "architectures",
        "auto_map",  # the Hub repository's own code, which transformers runs only with trust_remote_code
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_bfloat16",
        "use_cache",
        "initializer_range",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "tokenizer_class",
        "prefix",
        "id2label",
        "label2id",
        "num_labels",
        "problem_type",
        "finetuning_task",
        "task_specific_params",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "torchscript",
        "tf_legacy_loss",
        "chunk_size_feed_forward",
        "is_decoder",
        "is_encoder_decoder",
        "add_cross_attention",
        "cross_attention_hidden_size",
        "tie_encoder_decoder",
        "_num_labels",  # num_labels as releases before 4.0 wrote it (distilgpt2's config.json)
        # generation settings older transformers kept in config.json: they change no logit
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "output_scores",
        "return_dict_in_generate",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
    }
)
"""``config.json`` fields of every Hugging Face model (``PretrainedConfig``'s own) that change no output
of a decoder: ids, labels, dtypes, generation settings. A family reads these and its own; any other
field is refused (``check_fields``)."""


def check_fields(data: dict, where: str, known: frozenset[str], who: str) -> None:
    """Refuse, by name, the first field of a ``config.json`` outside ``known``: meshkit would ignore it,
    and it may change what the model computes (a rope setting, a quantization, a window)."""
    odd = sorted(set(data) - known)
    if odd:
        shown = repr(data[odd[0]])
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        more = (
            f" (and {len(odd) - 1} more: {', '.join(odd[1:4])}{', ...' if len(odd) > 4 else ''})"
            if len(odd) > 1
            else ""
        )
        raise InteropError(
            f"{where}: {odd[0]}={shown}{more} is not a field meshkit's {who} reads, so it cannot compute what it "
            f"asks: give a checkpoint without it (drop it from config.json if it changes nothing)"
        )


def check_values(data: dict, where: str, wants: tuple[tuple[str, Any], ...], who: str) -> None:
    """Each ``(key, value)`` the family computes: a ``config.json`` saying otherwise is refused by name."""
    for key, want in wants:
        if data.get(key, want) != want:
            raise InteropError(
                f"{where}: {key}={data[key]!r} is not what meshkit's {who} computes ({want!r})"
            )
