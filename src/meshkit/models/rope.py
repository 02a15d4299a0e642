"""Rotary frequencies of the Llama family (``meshkit.models.llama``): the plain rotary's
``theta^(-2i/h)`` and Llama 3.1's rescaling of them for long contexts (``Llama3Rope``), as
transformers computes them (its ``llama3`` rope type), written here in JAX."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from meshkit._errors import MeshkitError


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Llama3Rope:
    """Llama 3.1's rotary frequencies for long contexts (``rope_type: llama3``): wavelengths longer than
    ``original_positions / low_freq_factor`` are stretched ``factor`` times, those shorter than
    ``original_positions / high_freq_factor`` kept, and those between interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_positions: int
    """The context the model was pretrained at (``original_max_position_embeddings``)."""

    def __post_init__(self):
        if (
            not self.high_freq_factor > self.low_freq_factor > 0
            or self.factor <= 0
            or self.original_positions < 1
        ):
            raise MeshkitError(
                f"llama3 rotary scaling {self}: needs factor > 0, high_freq_factor > low_freq_factor > 0 and "
                f"original_positions >= 1"
            )


def inv_frequencies(cfg: Any, wide) -> jax.Array:
    """The rotary's ``head_dim / 2`` angular frequencies (radians per position) in ``wide``: ``theta^(-2i/h)``,
    rescaled by ``cfg.rope_scaling`` as transformers' ``llama3`` rope type does, operation for operation
    in the same dtype. They agree to float32 rounding, not to the bit: XLA folds and reassociates some
    of it (a constant divisor becomes its reciprocal), so a few frequencies differ by an ulp or three
    (at most 3.7e-7 relative at head_dim 128; the logits agree within 1e-6)."""
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, cfg.head_dim, 2, dtype=wide) / cfg.head_dim))
    r = cfg.rope_scaling
    if r is None:
        return inv_freq
    wavelength = 2 * math.pi / inv_freq
    long, short = r.original_positions / r.low_freq_factor, r.original_positions / r.high_freq_factor
    # between the two bounds: (1 - s) f / factor + s f, s = 0 at the long bound and 1 at the short one
    s = (r.original_positions / wavelength - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    between = (1 - s) * inv_freq / r.factor + s * inv_freq
    scaled = jnp.where(wavelength > long, inv_freq / r.factor, inv_freq)
    return jnp.where((wavelength >= short) & (wavelength <= long), between, scaled)
