"""One prediction's shared quantities (``Step``, set once by ``setup``): micro-batches, layers and
parameters on the busiest device, the matmul efficiency the compute time assumes, and the seconds
of one micro-batch's compute. ``planner.predict`` prices memory and the step from it, each mesh
axis's module (``plans.axes``) says what the axis moves and ``planner.traffic`` what that costs
(conventions: ``planner.predict``'s docstring)."""

from __future__ import annotations

from dataclasses import dataclass

from meshkit.planner.cluster import Cluster, Job
from meshkit.planner.hardware import Hardware
from meshkit.planner.layout import Layout, ModelShape
from meshkit.planner.sizes import (
    elementwise_bytes,
    embed_params,
    expert_params,
    head_flops,
    head_params,
    layer_activation_bytes,
    layer_flops,
    layer_params,
)
from meshkit.planner.stacks import CALIBRATION, STACKS, Calibration, stack_for

N_HALF = 128
"""Per-device matmul dimension at which matmul efficiency falls to half its large-matrix value
(chosen from the shape of bf16 GEMM efficiency curves, not fitted)."""


def efficiency(
    shape: ModelShape, layout: Layout, hardware: Hardware, job: Job, calibration: Calibration | None = None
) -> tuple[float, str]:
    """(the stack's calibrated matmul efficiency on this family, scaled down for narrow per-device
    matmuls; where that efficiency comes from)."""
    base, source = (calibration or CALIBRATION).efficiency_of(job.stack, hardware.family, hardware.name)
    tokens = layout.microbatch_size * shape.seq / layout.sequence_ways
    n = min(shape.width / layout.tp, tokens)
    if shape.experts:  # an expert's matmuls: its width, and the tokens it takes from the whole ep group
        n = min(n, shape.ffn / layout.tp, tokens * shape.experts_per_token * layout.ep / shape.experts)
    return base * n / (n + N_HALF), source


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """The quantities every part of one prediction reads (set once by ``setup``)."""

    shape: ModelShape
    layout: Layout
    cluster: Cluster
    job: Job
    m: int
    per_stage: int
    """Layers on the busiest device (uneven splits round up)."""
    tokens_mb: int
    phi: float
    """Parameters on the busiest device (one tensor-parallel shard)."""
    experts_phi: float
    """Of ``phi``, the expert weights (``experts / ep`` of each layer's; 0 for a dense model)."""
    top_params: float
    top_split: int
    """The ways the embedding and unembedding are split over tp (meshkit's runtime: ``vocab_split``)."""
    stage_layers: float
    shard: int
    """The data-parallel devices ZeRO-3 shards over (dp, or the hybrid group)."""
    recompute: int
    layer_fwd: float
    """Forward FLOPs of one layer and one micro-batch on one device."""
    peak_flops: float
    eff: float
    eff_source: str
    t_mb: float
    """Compute seconds of one micro-batch on the busiest stage."""
    activations: tuple[float, float, float]
    """``layer_activation_bytes``: (all saved, those dots keeps, the layer's input)."""

    @property
    def meshkit(self) -> bool:
        """meshkit's own programs (``runtime``), which price no context or expert axis yet."""
        return self.job.runtime == "meshkit" and self.layout.cp == 1 and self.layout.ep == 1

    def inner(self, axis: str) -> int:
        """Devices between two neighbours on mesh ``axis`` (``Layout.inner``): a group's stride."""
        return self.layout.inner(axis)

    @property
    def flops_per_s(self) -> float:
        """The matmul FLOP/s the compute time assumes: peak x efficiency."""
        return self.peak_flops * self.eff

    @property
    def zero3_per_tensor(self) -> bool:
        """Whether the stack's ZeRO-3 gathers and reduces each parameter tensor by itself (``Stack``)."""
        return STACKS[self.job.stack].zero3_per_tensor

    @property
    def batch_group(self) -> int:
        """Devices holding the same dense parameters: dp x cp x ep (``Layout.batch_group``)."""
        return self.layout.batch_group

    @property
    def window(self) -> float:
        """Seconds of one micro-batch's backward pass (what hides a gradient reduce)."""
        return (2 + self.recompute) * self.per_stage * self.layer_fwd / self.flops_per_s


def setup(shape, layout, cluster, job, calibration) -> Step:
    hw, lay = cluster.hardware, layout
    stack_for(job, hw)
    tp, pp, v = lay.tp, lay.pp, lay.virtual_stages
    m = job.global_batch // (lay.batch_ways * lay.microbatch_size)
    per_stage = -(-shape.layers // (pp * v)) * v
    tokens_mb = lay.microbatch_size * shape.seq // lay.sequence_ways
    stage_layers = per_stage * layer_params(shape, tp, lay.ep)
    if job.runtime == "meshkit" and lay.cp == 1 and lay.ep == 1:  # the embedding and unembedding on
        # every device (every stage), the vocabulary split over tp as training places it
        from meshkit.planner.runtime import vocab_split

        top_split = vocab_split(shape, lay)
        top_params = embed_params(shape, top_split) + head_params(shape, top_split)
        phi = stage_layers + top_params
    else:
        top_params, top_split = 0.0, tp
        first = stage_layers + embed_params(shape, tp) + (head_params(shape, tp) if pp == 1 else 0)
        phi = max(first, stage_layers + head_params(shape, tp, copy=pp > 1))
    recompute = 1 if lay.remat == "layer" else 0
    layer_fwd = layer_flops(shape) * tokens_mb / tp
    eff, source = efficiency(shape, lay, hw, job, calibration)
    peak_flops = hw.peak_flops if job.precision == "bf16" else hw.fp32_flops
    acts = layer_activation_bytes(shape, lay, job)
    stage_hw = per_stage * layer_fwd * (3 + recompute) + 3 * head_flops(shape) * tokens_mb / tp
    t_mb = stage_hw / (peak_flops * eff)
    t_mb += per_stage * (3 + recompute) * elementwise_bytes(shape, lay, job) / hw.hbm_bytes_per_s
    if lay.remat == "dots":  # the elementwise ops recomputed: their activations written and read again
        t_mb += per_stage * 2 * (acts[0] - acts[1]) / hw.hbm_bytes_per_s
    return Step(shape=shape, layout=lay, cluster=cluster, job=job, m=m, per_stage=per_stage, tokens_mb=tokens_mb,
                 phi=phi, experts_phi=per_stage * expert_params(shape) / (tp * lay.ep), top_params=top_params, top_split=top_split, stage_layers=stage_layers, shard=lay.shard_group or lay.dp,
                 recompute=recompute, layer_fwd=layer_fwd, peak_flops=peak_flops, eff=eff, eff_source=source,
                 t_mb=t_mb, activations=acts)  # fmt: skip
