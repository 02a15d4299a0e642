"""Preference tuning's losses (``meshkit train --task dpo``): DPO's sigmoid loss, IPO, and SimPO, as TRL
defines them (``tests/test_dpo_reference.py`` checks each against TRL's own trainers), over the pair
batches of :mod:`meshkit.data.packing` (``PairRows``): one row per pair, the chosen answer's document
(segment 1) then the rejected one's (segment 2), the weights a 0/1 mask of the completions' targets.

A sequence's log-probability is the sum of its completion's target log-probs (the prompt's last token
predicts the first answer token; the prompt itself is never learnt); IPO and SimPO use its mean per
completion token. With ``r(y) = logp(y) - logp_ref(y)`` (SimPO: ``logp(y)``, no reference) and
``z = r(chosen) - r(rejected)``:

- ``sigmoid`` (DPO): ``-(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)`` (``eps``: label smoothing);
- ``ipo``: ``(z - 1 / (2 beta))^2`` on the mean log-probs;
- ``simpo``: the sigmoid loss of ``z - gamma / beta`` on the mean log-probs, without a reference.

The loss is the mean over the batch's pairs. A pair is one row, so every plan that splits rows (data,
ZeRO, micro-batches) keeps its two sequences together and averages equal-sized pieces of that mean; the
context axis would split a sequence's sum across devices, and is refused (``meshkit.train.task``).

The reference log-probs of a pair (``TokenBatch.reference``, ``(B, 2)``: chosen, rejected) come from the
frozen starting model, computed before each step by ``reference_fn`` (under LoRA the base weights without
the adapters: no second copy). Metrics carry TRL's names: ``rewards/chosen``, ``rewards/rejected`` (``beta
r(y)``), ``rewards/margins``, ``rewards/accuracies`` (the share of pairs whose chosen reward is the higher),
``logps/chosen``, ``logps/rejected``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from meshkit._errors import MeshkitError
from meshkit.models.token_loss import batch_extras, token_logprobs
from meshkit.spec import PREFERENCE_LOSSES, one_of

CHOSEN, REJECTED = 1, 2
"""The segment ids of a pair's two documents in its row."""
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
"""What a preference step logs beside its loss (TRL's names)."""


class PreferenceError(MeshkitError):
    """A preference objective or batch that cannot be trained as given."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Preference:
    """A preference objective and its settings (TRL's defaults)."""

    loss: str = "sigmoid"
    """One of ``PREFERENCE_LOSSES``."""
    beta: float = 0.1
    """How far the policy may move from the reference (DPO's inverse temperature; SimPO's reward scale)."""
    label_smoothing: float = 0.0
    """The share of pairs taken to be mislabelled (the sigmoid and SimPO losses; conservative DPO)."""
    gamma: float = 0.5
    """SimPO's target reward margin (TRL's ``simpo_gamma``)."""

    def __post_init__(self) -> None:
        if self.loss not in PREFERENCE_LOSSES:
            raise PreferenceError(f"unknown preference loss {self.loss!r}: use {one_of(PREFERENCE_LOSSES)}")
        if not self.beta > 0:
            raise PreferenceError(f"beta must be above 0, got {self.beta}: DPO's default is 0.1")
        if not 0 <= self.label_smoothing < 0.5:
            raise PreferenceError(
                f"label smoothing must be in [0, 0.5), got {self.label_smoothing} (0.5 learns nothing)"
            )
        if self.loss == "ipo" and self.label_smoothing:
            raise PreferenceError("the ipo loss takes no label smoothing: drop it, or use the sigmoid loss")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with the reference model (SimPO does not)."""
        return self.loss != "simpo"

    @property
    def mean_per_token(self) -> bool:
        """Whether a sequence's log-prob is its mean per completion token (IPO, SimPO) rather than its sum."""
        return self.loss in ("ipo", "simpo")


def sequence_logps(logits_btv: jax.Array, batch: Any) -> tuple[jax.Array, jax.Array]:
    """``(logps, tokens)``, each ``(B, 2)``: the summed log-probs of each row's chosen and rejected
    completions (the targets its weights mark, in segments 1 and 2) and their counts of tokens."""
    weights, seg, _ = batch_extras(batch)
    if weights is None or seg is None:
        raise PreferenceError(
            "a preference batch needs weights (the completions' targets) and segment ids (1: chosen, 2: "
            "rejected): prepare pairs with meshkit data prepare --chat on rows of prompt, chosen and rejected"
        )
    lp = token_logprobs(logits_btv, batch[1])
    w = weights.astype(lp.dtype)
    sides = jnp.stack([seg == CHOSEN, seg == REJECTED], -1).astype(lp.dtype)  # (B, T, 2)
    return jnp.einsum("bt,bts->bs", lp * w, sides), jnp.einsum("bt,bts->bs", w, sides)


def objective(
    policy: jax.Array, reference: jax.Array | None, tokens: jax.Array, pref: Preference
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The mean loss over pairs and TRL's metrics, from ``(B, 2)`` summed log-probs of the policy and the
    reference (None under SimPO) and the completions' token counts."""
    if pref.mean_per_token:
        count = jnp.maximum(tokens, 1.0)
        policy = policy / count
        reference = None if reference is None else reference / count
    ratio = policy if reference is None or not pref.needs_reference else policy - reference
    z = ratio[:, 0] - ratio[:, 1]
    if pref.loss == "ipo":
        losses = (z - 1.0 / (2.0 * pref.beta)) ** 2
    else:
        logits = pref.beta * (z - (pref.gamma / pref.beta if pref.loss == "simpo" else 0.0))
        eps = pref.label_smoothing
        losses = -(1.0 - eps) * jax.nn.log_sigmoid(logits) - eps * jax.nn.log_sigmoid(-logits)
    rewards = pref.beta * jax.lax.stop_gradient(ratio)
    metrics = {
        "rewards/chosen": jnp.mean(rewards[:, 0]),
        "rewards/rejected": jnp.mean(rewards[:, 1]),
        "rewards/margins": jnp.mean(rewards[:, 0] - rewards[:, 1]),
        "rewards/accuracies": jnp.mean((rewards[:, 0] > rewards[:, 1]).astype(rewards.dtype)),
        "logps/chosen": jnp.mean(jax.lax.stop_gradient(policy[:, 0])),
        "logps/rejected": jnp.mean(jax.lax.stop_gradient(policy[:, 1])),
    }
    return jnp.mean(losses), metrics


def reference_of(batch: Any) -> jax.Array:
    """A batch's reference log-probs ``(B, 2)``, refused by name where absent or misshapen."""
    ref = getattr(batch, "reference", None)
    rows = batch[0].shape[0]
    if ref is None or tuple(ref.shape) != (rows, 2):
        got = "none" if ref is None else f"shape {tuple(ref.shape)}"
        raise PreferenceError(
            f"a preference batch needs the reference model's log-probs of its pairs, ({rows}, 2), got {got}: "
            "fill TokenBatch.reference with reference_fn"
        )
    return ref


def make_loss(apply: Callable, pref: Preference) -> Callable:
    """``loss(params, batch) -> (loss, metrics)`` of a token model's ``apply(params, tokens, segment_ids=,
    positions=) -> logits`` on pair batches (module docstring); the batch's ``reference`` field holds the
    reference log-probs where the objective needs them."""

    def loss(params: Any, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        _, seg, pos = batch_extras(batch)
        policy, tokens = sequence_logps(apply(params, batch[0], segment_ids=seg, positions=pos), batch)
        reference = reference_of(batch).astype(policy.dtype) if pref.needs_reference else None
        return objective(policy, reference, tokens, pref)

    return loss


def reference_fn(apply: Callable) -> Callable:
    """``(params, batch) -> (B, 2)``: the summed log-probs of each pair under ``params`` (the frozen
    reference model), with no gradient."""

    def reference(params: Any, batch: Any) -> jax.Array:
        _, seg, pos = batch_extras(batch)
        logits = apply(jax.lax.stop_gradient(params), batch[0], segment_ids=seg, positions=pos)
        return sequence_logps(logits, batch)[0]

    return reference
