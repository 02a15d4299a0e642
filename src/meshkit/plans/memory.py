"""The memory model of a plan's step: the rules that say what the plan adds to a step's peak, each
written once and read by both models of the peak.

Two callers describe the same compiled step from different sides: ``plans.peak`` from a real loss
and its placement (activations read from a one-device compile), the planner's
``planner.runtime`` from a model's shape alone (activations counted from the block's residuals,
for clusters far larger than this machine). What the plan adds does not depend on which side
describes it: parameters and optimizer state at rest, the micro-batch loop's accumulator, ZeRO-3's
gathered leaves and gradient shards, a scan's loop buffers, and the update. Each rule is a function
of byte counts per device (a leaf split on ``model`` counts 1/model of itself) and of how the step
runs; measured against ``memory_analysis()`` by ``tests/test_peak.py`` (a loss's step) and
``tests/test_planner_compile.py`` (the planner's shapes).

Terms: P the parameter bytes, P_top the leaves outside layers, P_layers the per-layer leaves, P_1
one layer's, N the data-axis size, m the micro-batches.

The ZeRO rule itself (what each stage shards, its bytes at rest, its collectives per step) is
``ZeroStage``, re-exported here from ``meshkit.analysis.zero``, where it sits below both the
chapter's formulas (``analysis.cost``) and the plans; every rule below that asks whether a part is
sharded asks it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshkit.analysis.zero import PARTS, ZeroCollective, ZeroStage, split_bytes, zero_stage

__all__ = [
    "PARTS",
    "PeakModel",
    "ZeroCollective",
    "ZeroStage",
    "accumulator",
    "accumulator_beside_gradients",
    "at_rest",
    "deterministic_phases",
    "experts_beyond_device",
    "gathered_top",
    "scan_loop_buffers",
    "update_phase",
    "zero3_all_shards_alive",
    "zero3_layers_held",
    "zero_stage",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class PeakModel:
    """Predicted per-device bytes at a step's peak."""

    persistent: float
    """Parameters and optimizer state as the plan keeps them at rest, and the batch (the arguments)."""
    backward: float
    """Temporaries of the gradient phase: gradients in flight, gathered parameters, activations."""
    update: float
    """Temporaries of the update phase: gradients with the update tree, and ZeRO-1/2's gathered new
    parameters."""
    activations: float
    """The part of ``backward`` that is activations."""

    @property
    def total(self) -> float:
        return self.persistent + max(self.backward, self.update)

    def to_json(self) -> dict:
        return {**asdict(self), "total": self.total}


def at_rest(nbytes: float, sharded: float, n: int, on: bool) -> float:
    """Bytes of a tree at rest when the plan shards it (``on``) over N: its ``sharded`` part is split,
    the rest (leaves kept whole on data) stays whole. Parameters: ZeRO-3; optimizer state and
    gradient shards: ZeRO-1 on."""
    return split_bytes(nbytes, sharded, n) if on and n > 1 else nbytes


def accumulator(total: float, sharded: float, n: int, *, microbatches: int, shards_gradients: bool) -> float:
    """The gradient accumulator the micro-batch loop carries (m > 1): whole under dp and ZeRO-1
    (reduced once, after the loop), a shard under ZeRO-2 and ZeRO-3 (reduce-scattered per
    micro-batch)."""
    if microbatches <= 1:
        return 0.0
    return at_rest(total, sharded, n, shards_gradients)


def accumulator_beside_gradients(*, scan: bool, zero: int, microbatches: int) -> bool:
    """Whether the accumulator is alive beside a micro-batch's own gradients: where those are complete
    at once before they are added (a scan's stacked gradients, one output of the backward loop;
    ZeRO-2's bucketed reduce-scatter). In the loop form XLA adds each leaf's gradient into the carry
    as it is made, so the accumulator takes their place (GPT width 128, 4 layers, data=8, m=2, loop
    form: dp and zero1 0.89 / 0.84 measured / predicted counting it beside them, 1.00 / 1.00 not)."""
    return microbatches > 1 and (scan or zero == 2)


def scan_loop_buffers(one_layer: float, *, zero3: bool, remat: str) -> float:
    """A scan's loop keeps one layer's slice of the stacked parameters and of their gradient in its
    buffers besides the stacked arrays (2 P_1); under ZeRO-3 with remat the body's parameter slice is
    a shard and only the gathered layer's buffer stays (1 P_1)."""
    return (1 if zero3 and remat != "none" else 2) * one_layer


def gathered_top(
    bucketed: float, alone: float, whole: float, *, gather_ratio: float = 1.0, gradients: bool = True
) -> float:
    """ZeRO-3's leaves outside layers, gathered once for the step, with their whole gradients.

    A leaf gathered in its dtype's bucket: the bucket and the leaf's whole gradient (2x; the leaf is a
    view of the bucket); gathered in the compute dtype (``gather_ratio`` < 1: bf16 gathers of float32
    parameters, ``Plan.gathers_in_compute_dtype``) its slice is a cast copy: bucket, slice and gradient
    in that dtype (3 ratio x). A leaf also split on ``model``, gathered by itself: its value and its
    gradient (2 ratio x). A leaf kept whole on data: its gradient (1x).

    Measured (``memory_analysis()``, zero3 on data=8, GPT 4 layers, float32): counting the bucketed
    leaves 3x, their slices as copies, over-predicted the peak by one P_top (vocab 256, width 64:
    measured/predicted 0.80-0.93 in both forms and every remat policy; with 2x 0.87-0.97); the
    planner's 1.3 B GPT in bf16 at 64 devices holds the bucket, the cast slices and the gradient.
    Frozen leaves (``gradients=False``, ``plans._frozen``): the same less the gradient."""
    grad = 1.0 if gradients else 0.0
    per_leaf = 1.0 + grad if gather_ratio == 1.0 else (2.0 + grad) * gather_ratio
    return per_leaf * bucketed + (1.0 + grad) * gather_ratio * alone + grad * whole


def zero3_all_shards_alive(
    *, global_norm: bool, scan: bool, remat: str, microbatches: int, hybrid: bool = False
) -> bool:
    """Whether every layer's gradient shard is alive at once under ZeRO-3: where the step takes their
    global norm before updating, a scan writes them as one stacked output, ``regather``'s per-leaf
    reduce-scatters are scheduled at the step's end, they are summed into the micro-batch loop's
    accumulator, or (``hybrid``, hsdp) all-reduced across the replicas after the backward pass, which
    XLA combines into one all-reduce of every shard. Otherwise XLA updates each layer's shards into the donated parameter and optimizer
    buffers as they arrive, and one layer's shard is alive at a time (its live range spans ~17 of
    ~1300 instructions at 4 layers)."""
    return global_norm or scan or remat == "regather" or microbatches > 1 or hybrid


def zero3_layers_held(layers_b: float, one_layer: float, n: int, *, scan: bool, remat: str) -> float:
    """ZeRO-3's per-layer leaves (gathered leaf by leaf, no bucket) beyond their shards: without remat
    every layer's gathered leaves, held for the backward pass (P_layers, both forms; a scan saves them
    as stacked residuals); with remat one layer at a time: in the loop form nothing on top (its
    gathered leaves and whole gradient share memory with the recomputed values the activation term
    holds), in a scan its whole gradient (P_1), and under ``regather`` its gathered leaves too and
    every layer's barrier output shards (P_layers / N), which the policy lets the scan save as a
    stacked residual for the re-gather to read."""
    if remat == "none":
        return layers_b
    if not scan:
        return 0.0
    return one_layer + (one_layer + layers_b / n if remat == "regather" else 0.0)


def update_phase(total: float, shards: float, *, zero: int, scan: bool, partial: float = 0.0) -> float:
    """The update: the gradients with the optimizer's update tree (2 P; a scanned dp step updates in
    the gradients' buffers, P); ZeRO-1/2 also gather the new parameters (bucket + slices, 2 P);
    ZeRO-3 the gradient shards and their update tree, less ``partial`` (the shards of layers already
    updated as they arrived, where not all are alive at once)."""
    if zero == 3:
        return 2 * (shards - partial)
    if zero == 0 and scan:
        return total
    return 2 * total


def deterministic_phases(
    total: float, activations: float, *, shards_per_device: int, devices: int, zero3: bool
) -> float:
    """Deterministic mode's gradient-phase temporaries, the larger of its two phases
    (``plans._deterministic``). In the shard loop: one micro-shard's ``activations``, the shard's whole
    gradient, the ``TreeAdder``'s ``log2(k) + 1`` partial sums of a device's ``k`` shards, and under ZeRO-3
    the whole parameters (gathered once for the step). After it, the all-gather of every device's block
    sum: ``N`` gradients (the activations are gone by then). Measured on a GPT (2 layers, width 64, batch
    16, 8 shards, P = 0.47 MB), measured/model with this rule on 1, 2 and 8 devices: dp 0.96 / 1.03 / 1.02,
    zero3 0.96 / 0.92 / 1.02; the normal model, which knew no micro-shards, read 0.45-2.14."""
    loop = activations + total * (1 + shards_per_device.bit_length()) + (total if zero3 else 0.0)
    return max(loop, devices * total if devices > 1 else 0.0)


def experts_beyond_device(one_layer_experts: float, expert_devices: int) -> float:
    """Expert plans: what the one-device compile of the loss (``peak.compiled_activations``) holds
    beyond a device of the plan: one MoE layer's expert gradients are alive at once there, for all
    ``E`` experts, where the plan's device makes ``E / N`` of them (the rest of its gradients the
    backward phase counts). Measured: the GPT of 2 layers, width 32, 8 experts under ep expert=8
    held 137 KB more than the model without it, one layer's experts being 134 KB."""
    return one_layer_experts * (1 - 1 / expert_devices)
