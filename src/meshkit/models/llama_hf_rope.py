"""The Llama family's rotary settings in a Hugging Face ``config.json`` (``meshkit.models.llama_hf``), both
ways: read in both forms transformers writes, 4.x's ``rope_theta`` + ``rope_scaling`` and 5.x's
``rope_parameters`` (the same settings in one dict, ``rope_theta`` among them); written in 4.x's. The rope
types meshkit computes are ``ROPE_TYPES``' keys: the plain rotary, Llama 3.1's (``rope.Llama3Rope``),
position interpolation (``rope.LinearRope``) and YaRN (``rope.YarnRope``). YaRN's
``original_max_position_embeddings`` defaults to the config's ``max_position_embeddings``, as 4.57 reads it
(5.x fills it in the same way when it standardises the settings).

A partial rotary (Phi-3's ``partial_rotary_factor``: the rotary turns that fraction of each head) reads from
the config's top level, where 4.x keeps it, or from ``rope_parameters``, where 5.x puts it, for a type whose
transformers class applies it (``partial`` in ``read``); it is written at the top level, and only where
it is not the whole head.
"""

from __future__ import annotations

from typing import Any

from meshkit._errors import MeshkitError
from meshkit.models.family import InteropError, positive, whole

ROPE_TYPES: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "default": (frozenset(), frozenset()),
    "llama3": (
        frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
        frozenset(),
    ),
    "linear": (frozenset({"factor"}), frozenset()),
    "yarn": (
        frozenset({"factor"}),
        frozenset(
            {
                "original_max_position_embeddings",
                "beta_fast",
                "beta_slow",
                "attention_factor",
                "mscale",
                "mscale_all_dim",
                "truncate",
            }
        ),
    ),
}
"""The rope types meshkit computes, each with the settings it needs and those it may take (no others)."""
PARTIAL = "partial_rotary_factor"
_YARN_NUMBERS = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")
"""YaRN's optional numbers: ``rope.YarnRope``'s fields of the same names."""


def _default_rope(rope: Any) -> Any:
    """A rope dict saying only ``default`` (as transformers writes it) reads as None, which it equals."""
    default = isinstance(rope, dict) and set(rope) <= {"rope_type", "type"}
    return None if default and all(v == "default" for v in rope.values()) else rope


def _scaling(rope: Any, where: str, key: str, positions: Any) -> Any:
    """The ``rope`` scaling of a ``rope_scaling`` (or ``rope_parameters`` less its theta), or None;
    ``positions``: the config's ``max_position_embeddings`` (YaRN's default original context)."""
    rope = _default_rope(rope)
    if rope is None:
        return None
    said = f"{where}: {key}={rope!r}"
    kinds = {
        rope[k] for k in ("rope_type", "type") if isinstance(rope, dict) and isinstance(rope.get(k), str)
    }
    if not isinstance(rope, dict) or len(kinds) != 1:
        raise InteropError(f"{said} names no single rope_type: give one of {', '.join(ROPE_TYPES)}")
    (kind,) = kinds
    if kind not in ROPE_TYPES:
        raise InteropError(
            f"{said}: rope_type {kind!r} is not one meshkit's Llama computes ({', '.join(ROPE_TYPES)}): "
            f"give a checkpoint with one of those"
        )
    given, (needs, may) = set(rope) - {"rope_type", "type"}, ROPE_TYPES[kind]
    if not needs <= given <= needs | may:
        lacks, extra = sorted(needs - given), sorted(given - needs - may)
        wrong = f"lacks {', '.join(lacks)}" if lacks else f"takes no {', '.join(extra)}"
        takes = ", ".join(sorted(needs)) or "rope_type"
        raise InteropError(
            f"{said}: rope_type {kind} {wrong}: give {takes}"
            + (f" (and any of {', '.join(sorted(may))})" if may else "")
        )
    from meshkit.models import rope as R  # JAX, imported on first use: the registry's rows need none

    try:
        return _made(R, kind, rope, said, positions)
    except InteropError:  # a field's own refusal, already naming it
        raise
    except MeshkitError as e:  # the scaling's own check (rope.py)
        raise InteropError(f"{said}: {e}") from None


def _made(R: Any, kind: str, rope: dict, said: str, positions: Any) -> Any:
    factor = positive(rope.get("factor"), f"{said}: factor")
    if kind == "linear":
        return R.LinearRope(factor=factor)
    if kind == "yarn":
        key = "original_max_position_embeddings"  # absent: max_position_embeddings, as 4.57 reads it
        original = whole({key: rope.get(key) or positions}, key, said)
        numbers = {k: positive(rope[k], f"{said}: {k}") for k in _YARN_NUMBERS if rope.get(k) is not None}
        truncate = rope.get("truncate", True)
        if not isinstance(truncate, bool):
            raise InteropError(f"{said}: truncate={truncate!r} is not true or false: give one")
        return R.YarnRope(factor=factor, original_positions=original, truncate=truncate, **numbers)
    factors = {k: positive(rope[k], f"{said}: {k}") for k in ("low_freq_factor", "high_freq_factor")}
    original = whole(rope, "original_max_position_embeddings", said)
    return R.Llama3Rope(factor=factor, **factors, original_positions=original)


def _fraction(data: dict, where: str, params: Any, default: float = 1.0) -> float:
    """The partial rotary's fraction of each head, from either place (both at once must agree; ``default``
    where neither says it)."""
    said = {k: v.get(PARTIAL) for k, v in (("", data), ("rope_parameters.", params)) if isinstance(v, dict)}
    given = {k: v for k, v in said.items() if v is not None}
    if len(set(given.values())) > 1:
        raise InteropError(
            f"{where}: {PARTIAL} differs between the config and rope_parameters ({said}): give one"
        )
    if not given:
        return default
    key, value = next(iter(given.items()))
    fraction = positive(value, f"{where}: {key}{PARTIAL}")
    if fraction > 1:
        raise InteropError(f"{where}: {key}{PARTIAL}={value} turns more than a head: give at most 1")
    return fraction


def read(data: dict, where: str, default: float, partial: float | None = None) -> tuple[float, Any, float]:
    """``(rope_theta, rope_scaling, fraction)`` of either form (``default``: the type's theta where the config
    gives none; ``fraction``: of each head the rotary turns, 1 unless the type reads it, ``partial`` its
    default); both forms at once must say the same."""
    fraction = 1.0 if partial is None else _fraction(data, where, data.get("rope_parameters"), partial)
    theta, scaling, key = data.get("rope_theta"), data.get("rope_scaling"), "rope_scaling"
    theta = None if theta is None else positive(theta, f"{where}: rope_theta")
    params = data.get("rope_parameters")
    if params is not None:
        flat = isinstance(params, dict) and all(not isinstance(v, dict) for v in params.values())
        if not flat:
            raise InteropError(
                f"{where}: rope_parameters={params!r} is not one set of rotary settings: meshkit's Llama uses one "
                f"rotary in every layer"
            )
        rest = {
            k: v
            for k, v in params.items()
            if k != "rope_theta" and not (partial is not None and k == PARTIAL)
        }
        five = params.get("rope_theta")
        five = None if five is None else positive(five, f"{where}: rope_parameters.rope_theta")
        both = (theta is not None and five is not None and theta != five) or (
            _default_rope(scaling) is not None and _default_rope(scaling) != _default_rope(rest)
        )
        if both:
            raise InteropError(
                f"{where}: rope_parameters={params!r} and rope_theta={theta!r}, rope_scaling={scaling!r} differ: "
                f"give one of the two forms"
            )
        theta, scaling, key = theta if five is None else five, rest, "rope_parameters"
    positions = data.get("max_position_embeddings")
    return float(default if theta is None else theta), _scaling(scaling, where, key, positions), fraction


def rotary_dim(fraction: float, head_dim: int) -> int:
    """The dims a partial rotary turns, as transformers counts them: ``int(head_dim x fraction)``."""
    return int(head_dim * fraction)


def written_fraction(rotary: int, head_dim: int, always: bool = False) -> dict:
    """``{partial_rotary_factor}`` for a rotary of ``rotary`` dims of each head (none for the whole head unless
    ``always``: a type whose default is part of it), one that transformers reads back as those dims."""
    if rotary == head_dim:
        return {PARTIAL: 1.0} if always else {}
    fraction = rotary / head_dim
    if rotary_dim(fraction, head_dim) != rotary:
        raise InteropError(
            f"a rotary of {rotary} of {head_dim} dims has no {PARTIAL} transformers reads back as it: give another"
        )
    return {PARTIAL: fraction}


def written(r: Any) -> dict | None:
    """``rope_scaling`` as 4.x writes it for a config's ``rope_scaling`` (one of ``rope``'s, or None)."""
    if r is None:
        return None
    kind = type(r).__name__
    if kind == "LinearRope":
        return {"rope_type": "linear", "factor": r.factor}
    if kind == "YarnRope":
        optional = {k: getattr(r, k) for k in _YARN_NUMBERS if getattr(r, k) is not None}
        return {"rope_type": "yarn", "factor": r.factor, "original_max_position_embeddings": r.original_positions,
                **optional, "truncate": r.truncate}  # fmt: skip
    return {
        "rope_type": "llama3",
        "factor": r.factor,
        "low_freq_factor": r.low_freq_factor,
        "high_freq_factor": r.high_freq_factor,
        "original_max_position_embeddings": r.original_positions,
    }
