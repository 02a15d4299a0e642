"""Rotary frequencies of the Llama family (``meshkit.models.llama``): the plain rotary's
``theta^(-2i/h)`` and its rescalings for long contexts as transformers computes them (its rope types),
written here in JAX: Llama 3.1's (``Llama3Rope``, ``llama3``), position interpolation (``LinearRope``,
``linear``) and YaRN (``YarnRope``, ``yarn``: Qwen2.5's and Qwen3's long contexts), whose attention factor
scales the cosines and sines (``attention_scaling``)."""

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


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class LinearRope:
    """Position interpolation (``rope_type: linear``): every frequency divided by ``factor``."""

    factor: float

    def __post_init__(self):
        if not self.factor > 0:
            raise MeshkitError(f"linear rotary scaling {self}: needs factor > 0")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class YarnRope:
    """YaRN (``rope_type: yarn``): frequencies that turn fewer than ``beta_slow`` times over the
    ``original_positions`` are divided by ``factor``, those turning more than ``beta_fast`` times kept,
    a linear ramp over the dimensions between (its ends floored and ceiled unless ``truncate`` is off);
    the cosines and sines scaled by ``attention_factor`` (transformers' default: ``0.1 ln(factor) + 1``,
    or with ``mscale`` and ``mscale_all_dim`` the ratio of two such terms)."""

    factor: float
    original_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if (
            not self.factor > 0
            or self.original_positions < 1
            or not self.beta_fast > 0
            or not self.beta_slow > 0
        ):
            raise MeshkitError(
                f"yarn rotary scaling {self}: needs factor, beta_fast and beta_slow > 0 and original_positions >= 1"
            )

    @property
    def scaling(self) -> float:
        """What the cosines and sines are multiplied by (transformers' ``attention_scaling``)."""
        if self.attention_factor is not None:
            return self.attention_factor

        def mscale(scale: float) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * scale * math.log(self.factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(mscale(self.mscale) / mscale(self.mscale_all_dim))
        return mscale(1.0)


def rotary_width(cfg: Any) -> int:
    """How many of each head's dims the rotary turns: a config's ``rotary_dim`` where it has one (Phi-3's
    ``partial_rotary_factor x head_dim``), else the whole head."""
    return getattr(cfg, "rotary_dim", 0) or cfg.head_dim


def attention_scaling(cfg: Any) -> float:
    """The factor on the rotary's cosines and sines: YaRN's, else 1."""
    r = getattr(cfg, "rope_scaling", None)
    return r.scaling if isinstance(r, YarnRope) else 1.0


def _yarn(r: YarnRope, cfg: Any, wide) -> jax.Array:
    """transformers' ``_compute_yarn_parameters``, operation for operation."""
    dim, base = rotary_width(cfg), cfg.rope_theta

    def correction(rotations: float) -> float:
        return (dim * math.log(r.original_positions / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction(r.beta_fast), correction(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (jnp.arange(0, dim, 2, dtype=wide) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (r.factor * pos_freqs)
    kept = 1 - jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1).astype(wide)
    return interpolation * (1 - kept) + extrapolation * kept


def inv_frequencies(cfg: Any, wide) -> jax.Array:
    """The rotary's ``rotary_width / 2`` angular frequencies (radians per position) in ``wide``: ``theta^(-2i/h)``,
    rescaled by ``cfg.rope_scaling`` as transformers' rope type of it does, operation for operation
    in the same dtype. They agree to float32 rounding, not to the bit: XLA folds and reassociates some
    of it (a constant divisor becomes its reciprocal), so a few frequencies differ by an ulp or three
    (at most 3.7e-7 relative at head_dim 128; the logits agree within 1e-6)."""
    dim = rotary_width(cfg)
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=wide) / dim))
    r = cfg.rope_scaling
    if r is None:
        return inv_freq
    if isinstance(r, LinearRope):
        return inv_freq / r.factor
    if isinstance(r, YarnRope):
        return _yarn(r, cfg, wide)
    wavelength = 2 * math.pi / inv_freq
    long, short = r.original_positions / r.low_freq_factor, r.original_positions / r.high_freq_factor
    # between the two bounds: (1 - s) f / factor + s f, s = 0 at the long bound and 1 at the short one
    s = (r.original_positions / wavelength - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    between = (1 - s) * inv_freq / r.factor + s * inv_freq
    scaled = jnp.where(wavelength > long, inv_freq / r.factor, inv_freq)
    return jnp.where((wavelength >= short) & (wavelength <= long), between, scaled)
