"""GPT-OSS's own ``config.json`` rules (``meshkit.models.llama_hf``'s ``gpt_oss`` row): OpenAI's quantized experts
refused, the aliases its own configs carry, and its YaRN where a config names no rotary, read as the transformers
version that wrote it computes."""

from __future__ import annotations

from meshkit.models.family import InteropError
from meshkit.models.llama_hf_experts import major_version

OSS_YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
"""GPT-OSS's rotary where its config names none (4.57's default ``rope_scaling``, 5.x's ``rope_parameters``)."""

ALIASES = {"experts_per_token": "num_experts_per_tok", "initial_context_length": None}
"""Fields of OpenAI's own GPT-OSS configs that transformers reads no value from: ``experts_per_token`` must equal
the field it copies, ``initial_context_length`` (the YaRN's original context, which ``rope_scaling`` says) is
left aside."""


def read(data: dict, where: str) -> dict:
    """GPT-OSS's own checks: float weights (OpenAI's MXFP4 experts refused), its aliases, its rotary."""
    if "quantization_config" in data:
        method = (
            data["quantization_config"].get("quant_method")
            if isinstance(data["quantization_config"], dict)
            else None
        )
        raise InteropError(
            f"{where}: quantization_config (quant_method {method!r}): meshkit reads float weights, not quantized "
            f"experts; give the checkpoint dequantized to bfloat16 (transformers' Mxfp4Config(dequantize=True))"
        )
    for alias, field in ALIASES.items():
        if field is not None and alias in data and data[alias] != data.get(field):
            raise InteropError(
                f"{where}: {alias}={data[alias]!r} and {field}={data.get(field)!r} differ: transformers reads "
                f"{field}; give them equal"
            )
    return _oss_rope(data, where)


def _oss_rope(data: dict, where: str) -> dict:
    """``data`` with GPT-OSS's YaRN (``OSS_YARN``) where both versions compute it: no rotary field at all. A null
    ``rope_scaling`` is the plain rotary to 4.57 and that YaRN to 5.x: read as the ``transformers_version`` that
    wrote it computes, refused where none is named."""
    if data.get("rope_parameters") is not None or data.get("rope_scaling") is not None:
        return data
    if "rope_scaling" not in data:
        return data | {"rope_scaling": OSS_YARN}
    version = major_version(data)
    if version is None:
        raise InteropError(
            f"{where}: rope_scaling null in a GptOssForCausalLM config that names no transformers_version: 4.57 "
            f"computes the plain rotary and 5.x YaRN (factor 32); give rope_scaling, or the transformers_version"
        )
    return data | {"rope_scaling": OSS_YARN} if version >= 5 else data


FIELDS = frozenset(ALIASES)
"""The fields of ``ALIASES``, which the row reads besides its own."""
