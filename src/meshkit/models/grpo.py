"""GRPO's loss (``meshkit train --task grpo``) as TRL's ``GRPOTrainer`` defines it
(``tests/test_grpo_reference.py`` checks it against TRL itself), over rollout batches: each row a prompt
and one sampled completion (segment 1, positions from 0), the completion's targets marked by the weights.

With ``r_t = exp(logp_t - logp_sampled_t)`` (the ratio to the policy that sampled the completion) and the
row's group-normalised advantage ``A``, each completion token's loss is

    -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta k3_t,
    k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1    (the KL to the reference, Schulman's k3)

and the loss is the mean over every token of the batch of ``token_loss x weight``: the weights carry the
aggregation (``--grpo-loss``, TRL's ``loss_type``), each a completion mask scaled on the host
(``weights``), so that the mean is the same under every plan (rows split over devices or micro-batches
average equal pieces of one mean, as the fine-tuning weights of ``meshkit.spec.batch`` do):

- ``grpo``: each completion's mean over its tokens, then the mean over completions (weight ``T / n_b``);
- ``bnpo`` and ``dapo``: the mean over every completion token of the global batch (``B T / N``);
- ``dr_grpo``: the sum over tokens over ``B x max_completion_length`` (``T / L``).

Log-probs are of the logits divided by the sampling temperature, as TRL computes them. The batch's
``reference`` field (``spec.batch``) holds what the policy is compared with, each row's: ``advantages``
``(B,)``, ``sampled`` ``(B, T)`` (the sampling policy's log-probs of the targets: the parameters before
this rollout's first update), ``reference`` ``(B, T)`` (the frozen reference's; only where beta > 0)
and ``tokens`` ``(B, T)`` (the completion mask scaled by ``B T / N``, for the metrics' means over
completion tokens). Metrics: ``kl``, ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
``clip_ratio/region_mean`` (TRL's names; means over completion tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshkit._errors import MeshkitError
from meshkit.models.token_loss import batch_extras, token_logprobs
from meshkit.spec import GRPO_LOSSES, one_of

METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
"""What a GRPO step logs beside its loss (TRL's names)."""


class GRPOError(MeshkitError):
    """A GRPO objective or rollout batch that cannot be trained as given."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPO:
    """GRPO's settings (TRL's ``GRPOConfig`` defaults where it has them)."""

    loss: str = "dapo"
    """How token losses are aggregated: one of ``GRPO_LOSSES`` (module docstring)."""
    beta: float = 0.0
    """The weight of the KL to the reference (0: no reference model is run)."""
    epsilon: float = 0.2
    """The ratio's lower clip: ``1 - epsilon``."""
    epsilon_high: float | None = None
    """The ratio's upper clip, ``1 + epsilon_high`` (DAPO's clip-higher); None: ``epsilon``."""
    temperature: float = 1.0
    """The sampling temperature; the loss's log-probs are of the logits divided by it."""
    scale_rewards: bool = True
    """Advantages divided by their group's standard deviation (Dr. GRPO: off)."""

    def __post_init__(self) -> None:
        if self.loss not in GRPO_LOSSES:
            raise GRPOError(f"unknown GRPO loss {self.loss!r}: use {one_of(GRPO_LOSSES)}")
        if not self.beta >= 0:
            raise GRPOError(f"the KL weight beta must be at least 0, got {self.beta}")
        if not 0 < self.epsilon < 1 or not (self.epsilon_high is None or self.epsilon_high > 0):
            raise GRPOError(
                f"clip epsilons must be in (0, 1) (low) and above 0 (high), got {self.epsilon} and "
                f"{self.epsilon_high}: TRL's default is 0.2"
            )
        if not self.temperature > 0:
            raise GRPOError(f"the sampling temperature must be above 0, got {self.temperature}")

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def advantages(rewards: np.ndarray, group: int, scale: bool) -> np.ndarray:
    """Each completion's reward less its group's mean (``group`` consecutive completions of one prompt),
    divided by the group's standard deviation (unbiased, as torch's ``std``) + 1e-4 where ``scale``."""
    r = np.asarray(rewards, np.float64).reshape(-1, group)
    centred = r - r.mean(1, keepdims=True)
    if scale:
        std = r.std(1, ddof=1, keepdims=True) if group > 1 else np.zeros_like(r[:, :1])
        centred = centred / (std + 1e-4)
    return centred.reshape(-1)


def weights(mask: np.ndarray, how: GRPO, max_completion: int) -> tuple[np.ndarray, np.ndarray]:
    """``(weights, tokens)`` of a global batch's completion mask ``(B, T)``: the loss's aggregation as weights
    of a mean over every token (module docstring), and the mask scaled to average over completion tokens."""
    mask = np.asarray(mask, np.float64)
    b, t = mask.shape
    total = mask.sum()
    share = mask * (b * t / total) if total else mask * 0.0
    if how.loss == "grpo":
        per_row = np.maximum(mask.sum(1, keepdims=True), 1.0)
        return mask * (t / per_row), share
    if how.loss == "dr_grpo":
        return mask * (t / max_completion), share
    return share, share


def token_logps(logits_btv: jax.Array, batch: Any, temperature: float) -> jax.Array:
    """Each target's log-prob ``(B, T)`` under the logits divided by ``temperature`` (TRL's convention)."""
    return token_logprobs(logits_btv / temperature if temperature != 1.0 else logits_btv, batch[1])


def objective(logp: jax.Array, batch: Any, how: GRPO) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss (a mean over every token of ``token_loss x weight``) and TRL's metrics, from the policy's
    log-probs ``(B, T)`` and the batch's weights and ``reference`` values (module docstring)."""
    weights_bt = batch_extras(batch)[0]
    got = getattr(batch, "reference", None)
    if weights_bt is None or not isinstance(got, dict) or not {"advantages", "sampled", "tokens"} <= set(got):
        raise GRPOError(
            "a GRPO batch needs weights and its reference values (advantages, sampled, tokens): build it "
            "with meshkit.train.rollout"
        )
    adv = got["advantages"].astype(logp.dtype)[:, None]
    ratio = jnp.exp(logp - got["sampled"].astype(logp.dtype))
    clipped = jnp.clip(ratio, 1.0 - how.epsilon, 1.0 + how.high)
    token = -jnp.minimum(ratio * adv, clipped * adv)
    share = got["tokens"].astype(logp.dtype)
    metrics = {}
    if how.beta:
        gap = got["reference"].astype(logp.dtype) - logp
        kl = jnp.exp(gap) - gap - 1.0
        token = token + how.beta * kl
        metrics["kl"] = jnp.mean(jax.lax.stop_gradient(kl) * share)
    low = ((ratio < 1.0 - how.epsilon) & (adv < 0)).astype(logp.dtype)
    high = ((ratio > 1.0 + how.high) & (adv > 0)).astype(logp.dtype)
    metrics |= {
        "clip_ratio/low_mean": jnp.mean(low * share),
        "clip_ratio/high_mean": jnp.mean(high * share),
        "clip_ratio/region_mean": jnp.mean(jnp.maximum(low, high) * share),
    }
    return jnp.mean(token * weights_bt.astype(logp.dtype)), metrics


def make_loss(apply: Callable, how: GRPO) -> Callable:
    """``loss(params, batch) -> (loss, metrics)`` of a token model's ``apply(params, tokens, segment_ids=,
    positions=) -> logits`` on rollout batches (module docstring)."""

    def loss(params: Any, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        _, seg, pos = batch_extras(batch)
        logits = apply(params, batch[0], segment_ids=seg, positions=pos)
        return objective(token_logps(logits, batch, how.temperature), batch, how)

    return loss


def logps_fn(apply: Callable, temperature: float) -> Callable:
    """``(params, batch) -> (B, T)``: every target's log-prob under ``params`` at ``temperature``, with no
    gradient (the sampling policy's, and the reference's)."""

    def logps(params: Any, batch: Any) -> jax.Array:
        _, seg, pos = batch_extras(batch)
        logits = apply(jax.lax.stop_gradient(params), batch[0], segment_ids=seg, positions=pos)
        return token_logps(logits, batch, temperature)

    return logps
