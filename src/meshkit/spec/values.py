"""Every set of allowed values a parallel spec takes (mesh axes, ZeRO stages, remat policies, pipeline
schedules, context attention, attention implementations, precisions) and the checks of one value; ``PlanError``, one line naming
the option to change."""

from __future__ import annotations

from typing import Any

from meshkit._errors import MeshkitError

DATA, MODEL, STAGE, REPLICA, CONTEXT = "data", "model", "stage", "replica", "context"
"""The mesh axes plans use: ZeRO/data parallelism, tensor parallelism, pipeline stages, the
replicas of hybrid sharding (HSDP: the batch split over ``replica`` x ``data``, ZeRO-3 within
``data``, replicated across ``replica``), and the sequence split of context parallelism."""
EXPERT = "expert"
"""Expert parallelism's axis: a mixture of experts' experts split over it, the batch split over it as
well (``data`` x ``expert``), its tokens sent to their experts' devices by ``all_to_all`` (``plans._experts``)."""
ADAPTER_RANK, ADAPTER_PAIR = "lora_rank", ("_lora_a", "_lora_b")
"""A low-rank adapter's logical rank dim (``models.lora``; whole on every axis: such a leaf multiplies its
partner, not the tokens) and the key suffixes of a weight's two adapters (``A``, ``B``), each the other's
partner: what the placement and the model axis's ledger read of LoRA."""
AXES = (STAGE, REPLICA, DATA, EXPERT, CONTEXT, MODEL)
"""Every axis a plan may use, in the order meshes are written (outermost first)."""

ZERO_STAGES = ("dp", "zero1", "zero2", "zero3")
"""What a plan shards over the data axis: nothing, optimizer state, + gradients, + parameters."""
ZERO_PARTS = ("params", "grads", "optimizer")
"""The persistent parts of training state, in the order the stages shard them last to first."""
FIRST_SHARDED = {"optimizer": 1, "grads": 2, "params": 3}
"""The first stage (index in ``ZERO_STAGES``) that shards each part over the data axis: the ZeRO
rule's "what", which ``meshkit.analysis.zero`` prices and every plan's placement follows."""
REMAT_POLICIES = ("none", "layer", "dots", "regather")
"""Activation checkpointing per layer: keep everything, recompute the layer from its input, keep
matmul outputs, or (ZeRO-3) keep everything but the gathered weights, which are gathered again."""
REMAT_ALIASES = {"full": "layer", "selective": "dots"}
"""Names other tools use: Megatron's full recompute is per-layer remat, its selective one saves matmuls."""
PIPELINE_REMAT = ("none", "dots", "layer")
"""The policies every plan takes (pipelines gather a stage's parameters once per step, so there is
nothing to re-gather), from the least recomputed to the most."""
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")
STEADY_SCHEDULES = PIPELINE_SCHEDULES[1:]
"""The schedules with a one-forward-one-backward steady state: at most p micro-batches in flight, so
they need at least p micro-batches (GPipe runs every forward first)."""
CONTEXT_ATTENTION = {"ring": "K/V passed round the ring by ppermute", "all-to-all": "Ulysses; heads divide"}
"""Context plans' attention: K/V blocks passed round the ring by ppermute (online softmax), or
Ulysses' all_to_all from a sequence split to a head split and back (heads must divide)."""
PRECISIONS = {"fp32": None, "bf16": "bfloat16"}
"""Compute precision -> the compute dtype (None: the parameters' own); parameters and optimizer
state stay in their dtype (float32 master weights)."""
PLATFORM_PRECISION = {"cpu": "fp32", "gpu": "bf16", "tpu": "bf16"}
"""The precision a run takes where none is given, by JAX's backend: bf16 compute with float32 master
weights on accelerators (their matmul units' rate), float32 on a CPU (the certificates' arithmetic)."""
ATTENTION_IMPLEMENTATIONS = {
    "auto": "a flash kernel where one takes the inputs, else einsum",
    "fused": "jax.nn.dot_product_attention: cuDNN on GPUs, splash on TPUs, else XLA",
    "einsum": "scores and softmax written out",
}
"""How attention runs on each device (``plans.attention``): the fused kernel of the platform, or
the written-out scores and softmax (the form the plans were first certified in)."""


class PlanError(MeshkitError):
    """A plan cannot be applied to this model, mesh, optimizer or batch."""


def one_of(values, last: str = "or", notes: dict[str, str] | None = None) -> str:
    """``a, b or c``: a list of allowed values for a help text or an error line; ``notes`` (or
    ``values`` itself, a dict) adds a few words in brackets after a value."""
    notes = values if isinstance(values, dict) and notes is None else notes or {}
    values = [f"{v} ({notes[v]})" if notes.get(v) else v for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} {last} {values[-1]}"


TASKS = {
    "pretrain": "the next-token loss on every token",
    "sft": "supervised fine-tuning: the loss on the assistant's tokens only, conversations packed with a "
    "mask per document",
    "dpo": "preference tuning on pairs of answers (prompt, chosen, rejected): --preference-loss against the "
    "frozen starting model",
    "grpo": "reinforcement learning on prompts: --generations completions each, scored by --reward",
}
"""What ``meshkit train --task`` trains (``meshkit.spec.batch``: the batch's fields each needs)."""

PREFERENCE_LOSSES = {
    "sigmoid": "DPO's loss",
    "ipo": "IPO: squared, on mean log-probs",
    "simpo": "SimPO: no reference, mean log-probs and a target margin",
}
"""The objectives of ``--task dpo`` (``meshkit.models.preference``)."""

GRPO_LOSSES = {
    "dapo": "the mean over every completion token of the batch",
    "bnpo": "as dapo",
    "grpo": "each completion's mean, then the mean over completions",
    "dr_grpo": "the sum over tokens over completions x --max-new-tokens",
}
"""How ``--task grpo`` aggregates its token losses (TRL's ``loss_type``; ``meshkit.models.grpo``)."""

QUANTIZE = {
    "none": "the compute dtype throughout",
    "int8": "the blocks' matmuls in int8, forward and backward, through Qwix",
}
"""``--quantize``'s values (``meshkit.models.quantize``)."""

AUTO = "auto"
"""A plan name that asks the planner to choose (resolved before a step is assembled)."""


def check_schedule(name: str, virtual_stages: int = 1) -> None:
    """A pipeline schedule's name, and whether it runs ``virtual_stages`` chunks per device."""
    _one_of("schedule", name, PIPELINE_SCHEDULES)
    _positive("virtual_stages", virtual_stages)
    if name != "interleaved" and virtual_stages != 1:
        raise PlanError(
            f"schedule {name} runs one chunk per device: use virtual_stages=1, or schedule='interleaved'"
        )


DETERMINISTIC_SHARDS = 8
"""Micro-shards per step of ``deterministic=True``: a run replays bit for bit on any mesh of up to
this many batch devices (1, 2, 4 or 8)."""


def check_deterministic(shards: Any) -> int | None:
    """Deterministic mode's micro-shard count (True: ``DETERMINISTIC_SHARDS``; None or False: off)."""
    if shards is None or shards is False:
        return None
    if shards is True:
        return DETERMINISTIC_SHARDS
    _positive("deterministic", shards)
    if shards & (shards - 1):
        raise PlanError(
            f"deterministic cuts the batch into a power-of-two number of micro-shards (summed as one binary "
            f"tree), got {shards}: use {1 << (shards.bit_length() - 1)} or {1 << shards.bit_length()}"
        )
    return shards


def _one_of(what: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise PlanError(f"unknown {what} {value!r}: choose one of {', '.join(map(str, allowed))}")


def _positive(what: str, value: Any, *, none_ok: bool = False) -> None:
    if none_ok and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{what} must be a whole number of at least 1, got {value!r}")
