"""What one layout costs on a cluster: per-device memory by component, bytes per mesh axis, pipeline
bubble, step time, tokens/s and MFU, from the model's shape alone (no JAX, no compile).

Conventions (stated so the numbers can be checked):

- FLOPs: matmuls only. Forward per token and layer ``2 (2 D D_q + 2 D D_kv) + 4 S D_q + 2 k D F``
  (QKV and output projections, the ``S^2`` terms of scores and values counted whole, no causal
  halving; D_q = heads x head_dim, D_kv = kv_heads x head_dim; k = 2 matrices, 3 when gated),
  logits ``2 D V``. A training step is 3x the forward
  (backward = 2x). **Model FLOPs** (what MFU divides by peak) count no recompute; **hardware FLOPs**
  add the recomputed forward of the layers under ``layer`` (full) remat, as Megatron's and BLOOM's
  TFLOP/s per GPU do. ``dots`` saves the matmul outputs: no matmul is recomputed.
- Compute time: hardware FLOPs of the slowest pipeline stage at ``peak x efficiency``, the
  efficiency calibrated per hardware family on published runs (``EFFICIENCY``), scaled by
  ``n / (n + N_HALF)`` for the smallest per-device matmul dimension n (a GEMM narrower than a few
  hundred columns leaves tensor cores idle: ``N_HALF`` is where it reaches half); plus the
  memory-bound elementwise ops (norms, residual adds, activation function: ``elementwise_bytes``
  per pass at HBM bandwidth; forward, backward counted twice, recomputed forward), which is
  what makes small models reach a lower MFU than large ones.
- Communication, ring model (``analysis.cost.ring_traffic``) at the link bandwidth of the axis:
  intra-host for tensor parallelism (kept inside a host), inter-host wherever a group spans hosts.
  Tensor-parallel all-reduces sit between the matmuls that need them: exposed whole. Data-parallel
  gradient traffic overlaps the backward pass of the last micro-batch (ZeRO-3's gathers and
  reduce-scatters: the compute of every micro-batch); what does not fit is exposed. Pipeline
  sends are exposed.
- Bubble: ``(p - 1) / (v m + p - 1)`` (``plans.bubble_model``), applied to the stage's time per step.
- Memory: parameters, gradients and optimizer state by ZeRO stage (``analysis.cost.zero_memory``,
  mixed-precision Adam 2 + 2 + 12 bytes per parameter in bf16, 4 + 4 + 8 in fp32) of the largest
  stage's share of the parameters (matrices split over tp); activations per layer and micro-batch
  as Korthikanti et al. (2022) count them for a GPT layer with tensor and sequence parallelism, generalised to any MLP width, gated MLPs and grouped-query attention (the ``S^2``
  softmax terms left out under flash attention); times the layer-micro-batches a device holds
  (1F1B: up to p micro-batches on the first stage, GPipe: m, interleaved: ``v p + p - 2`` chunks of
  ``L / (p v)`` layers, as meshkit's schedule tables hold them);
  under full remat one layer input per layer-micro-batch plus one layer recomputed at a time.
  Transients: the fp32 logits and their gradient (compute dtype) on the last stage, ZeRO-3's gathered layer and
  its unsharded gradient. With sequence parallelism (``Job.sequence_parallel``, the default) the
  activations outside the tensor-parallel matmuls are split over tp as well. A layout fits when the peak is within
  ``MEMORY_USABLE`` of the device's HBM (allocator fragmentation, runtime context, workspaces).

``Job(runtime="meshkit")`` counts what meshkit's own compiled programs do where they differ from the
standard (Megatron) implementation: the Q, K and V input gradients all-reduced separately (XLA does
not sum them before reducing), one row-parallel all-reduce redone per layer under ``layer`` remat,
and the pipeline's two full-size permutes on every tick. The compile check compares against that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshkit._errors import MeshkitError
from meshkit.analysis.cost import Convention, convention, ring_traffic, zero_memory
from meshkit.planner.hardware import Hardware
from meshkit.planner.layout import Layout, ModelShape
from meshkit.spec import PRECISIONS as SPEC_PRECISIONS
from meshkit.spec import STEADY_SCHEDULES, ZERO_STAGES

EFFICIENCY = {"gpu-ampere": 0.626, "gpu-hopper": 0.682, "tpu": 0.811}
"""Fraction of peak FLOP/s a large matmul-bound transformer layer reaches, per hardware family
(calibrated on tests/corpus/published_runs.json; see tests/test_planner.py and the README)."""
N_HALF = 128
"""Per-device matmul dimension at which matmul efficiency falls to half its large-matrix value
(chosen from the shape of bf16 GEMM efficiency curves, not fitted)."""
MEMORY_USABLE = 0.9
"""Fraction of HBM a training step can use (the rest: allocator fragmentation, runtime, workspaces)."""
DP_OVERLAP = 1.0
"""Fraction of the overlap window's compute time that hides data-parallel traffic."""
RUNTIMES = ("standard", "meshkit")
PRECISIONS = tuple(SPEC_PRECISIONS)


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """``devices`` accelerators of one kind, ``devices_per_host`` to a host (default: the node's)."""

    hardware: Hardware
    devices: int
    devices_per_host: int = 0

    def __post_init__(self):
        if self.devices_per_host == 0:
            object.__setattr__(self, "devices_per_host", self.hardware.devices_per_host)
        if self.devices < 1 or self.devices_per_host < 1:
            raise MeshkitError(f"devices={self.devices}, devices per host={self.devices_per_host}: need >= 1")
        if self.devices > self.devices_per_host and self.devices % self.devices_per_host:
            raise MeshkitError(
                f"{self.devices} devices is not a whole number of hosts of {self.devices_per_host}: "
                f"use a multiple of {self.devices_per_host} or set --devices-per-host"
            )

    @property
    def hosts(self) -> int:
        return max(1, self.devices // self.devices_per_host)


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """The training job: sequences per step, precision, optimizer state, and whose runtime to model."""

    global_batch: int
    precision: str = "bf16"
    optimizer_bytes: float | None = None
    """Optimizer state bytes per parameter (fp32 master + Adam moments: 12 in bf16; 8 in fp32)."""
    flash_attention: bool = True
    """Attention without a materialised S x S score matrix (no S^2 activation memory)."""
    sequence_parallel: bool = True
    """Under tensor parallelism, the activations between the tensor-parallel matmuls (norms,
    residuals, dropout) split over the sequence across tp (Megatron-LM's sequence parallelism;
    MaxText's and PaLM's sharded activations): replicated activations shrink by tp, the bytes
    moved stay (all-reduce = reduce-scatter + all-gather). meshkit's plans keep them whole."""
    tp_overlap: float = 0.0
    """Fraction of the tensor-parallel all-reduces hidden behind the matmuls (0: on the critical
    path, Megatron-LM's classic TP; 1: overlapped, Megatron-Core's --tp-comm-overlap, up to the
    compute time)."""
    dropout: bool = False
    """Dropout masks stored for the backward pass (1 byte per element after attention and MLP)."""
    runtime: str = "standard"
    """``standard`` (Megatron-style implementation) or ``meshkit`` (meshkit's compiled programs)."""

    def __post_init__(self):
        if self.global_batch < 1:
            raise MeshkitError(f"global batch {self.global_batch}: must be at least 1 sequence")
        if self.precision not in PRECISIONS:
            raise MeshkitError(f"unknown precision {self.precision!r}: choose bf16 or fp32")
        if self.optimizer_bytes is not None and self.optimizer_bytes < 0:
            raise MeshkitError(f"optimizer bytes per parameter {self.optimizer_bytes}: must be >= 0")
        if not 0.0 <= self.tp_overlap <= 1.0:
            raise MeshkitError(f"tp_overlap {self.tp_overlap}: a fraction between 0 and 1")
        if self.runtime not in RUNTIMES:
            raise MeshkitError(f"unknown runtime {self.runtime!r}: choose one of {', '.join(RUNTIMES)}")

    @property
    def convention(self) -> Convention:
        """Bytes per parameter: mixed-precision Adam in bf16 (2 + 2 + 12), fp32 Adam (4 + 4 + 8);
        meshkit's programs keep float32 parameters and gradients in either precision."""
        bf16 = self.precision == "bf16" and self.runtime != "meshkit"
        base = convention("mixed-adam" if bf16 else "fp32-adam")
        if self.optimizer_bytes is None:
            return base
        return convention(f"{base.param:g},{base.grad:g},{self.optimizer_bytes:g}")

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element (the compute dtype)."""
        return 2 if self.precision == "bf16" else 4


# -- the model's sizes ------------------------------------------------------------------------------


def _attention_widths(shape: ModelShape) -> tuple[int, int]:
    """(query width, key/value width): heads x head_dim and kv_heads x head_dim."""
    return shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim


def layer_params(shape: ModelShape, tp: int = 1) -> float:
    """Parameters of one layer on one tensor-parallel shard (matrices and their column-parallel
    biases split over tp; row-parallel biases and norms replicated)."""
    d, f, q, kv = shape.width, shape.ffn, *_attention_widths(shape)
    if shape.gated:  # LLaMA: no biases, RMSNorm scales
        return (2 * d * q + 2 * d * kv + 3 * d * f) / tp + 2 * d
    matrices = 2 * d * q + 2 * d * kv + 2 * d * f
    return (matrices + q + kv + f) / tp + d + d + 4 * d  # bq bv b_in split; bo b_out, 2 LayerNorms whole


def embed_params(shape: ModelShape, tp: int = 1) -> float:
    """Token (and, ungated, position) embedding on the first stage; vocab split over tp."""
    return shape.vocab * shape.width / tp + (0 if shape.gated else shape.seq * shape.width)


def head_params(shape: ModelShape, tp: int = 1) -> float:
    """Final norm and untied unembedding on the last stage; vocab split over tp."""
    return shape.width * shape.vocab / tp + (1 if shape.gated else 2) * shape.width


def param_count(shape: ModelShape) -> float:
    return shape.layers * layer_params(shape) + embed_params(shape) + head_params(shape)


def layer_flops(shape: ModelShape) -> float:
    """Forward matmul FLOPs of one layer per token (the S^2 terms counted whole)."""
    d, f, q, kv = shape.width, shape.ffn, *_attention_widths(shape)
    return 2 * (2 * d * q + 2 * d * kv) + 4 * shape.seq * q + 2 * (3 if shape.gated else 2) * d * f


def head_flops(shape: ModelShape) -> float:
    """Forward FLOPs of the logits per token."""
    return 2 * shape.width * shape.vocab


def model_flops_per_token(shape: ModelShape) -> float:
    """Training FLOPs per token without recompute (3 x forward): what MFU counts."""
    return 3 * (shape.layers * layer_flops(shape) + head_flops(shape))


def layer_activation_bytes(shape: ModelShape, layout: Layout, job: Job) -> tuple[float, float, float]:
    """(all saved activations, those ``dots`` remat keeps, the layer's input) of one layer and one
    micro-batch on one device, in bytes (Korthikanti et al. 2022: 16-bit activations, 1-byte
    dropout masks where ``job.dropout``; what precedes a tensor-parallel matmul is whole unless
    ``job.sequence_parallel`` splits it).
    ``dots`` keeps the layer input and the matmul outputs (Q, K, V, attention output, the MLP's
    first matmul(s)) and recomputes the elementwise rest (norms, activation function, masks, softmax)."""
    t, e = layout.tp, job.act_bytes
    sb = shape.seq * layout.microbatch_size
    d, f, q, kv = shape.width, shape.ffn, *_attention_widths(shape)
    split = t if job.sequence_parallel and job.runtime != "meshkit" else 1
    mask = 1 if job.dropout else 0
    replicated = sb * d * (4 * e + 2 * mask) / split  # QKV and MLP inputs, 2 norm inputs, dropout masks
    attention = sb * (q + 2 * kv + q) * e / t  # Q, K, V and the output projection's input
    mlp = sb * f * (3 if shape.gated else 2) * e / t  # GeLU: its input and output; SwiGLU: gate, up, product
    scores = 0.0 if job.flash_attention else sb * shape.heads * shape.seq * (2 * e + mask) / t
    full = replicated + attention + mlp + scores
    dots = sb * d * e / split + attention + sb * f * (2 if shape.gated else 1) * e / t
    return full, dots, sb * d * e / split


def elementwise_bytes(shape: ModelShape, layout: Layout, job: Job) -> float:
    """HBM bytes the non-matmul ops of one layer's forward pass move for one micro-batch on one
    device: two norms (read and write D), two residual adds (read 2 D, write D), the MLP's
    activation function (read and write F; SwiGLU: read 2 F, write F). The backward pass moves
    about twice as much, a recomputed forward as much again: ``ELEMENTWISE`` is this per pass."""
    split = layout.tp if job.sequence_parallel and job.runtime != "meshkit" else 1
    d, f = shape.width, shape.ffn
    return (
        layout.microbatch_size
        * shape.seq
        * job.act_bytes
        * (10 * d / split + (3 if shape.gated else 2) * f / layout.tp)
    )


def in_flight(layout: Layout, layers: int, m: int) -> float:
    """Layer-micro-batches whose activations the busiest device (the first stage) holds at once:
    its stage's layers times the micro-batch chunks it stashes, as meshkit's schedule tables count
    them (``plans._schedule``: GPipe m, 1F1B p, interleaved ``v p + p - 2`` chunks of ``L / (p v)``
    layers; Korthikanti et al. count one chunk more)."""
    p, v = layout.pp, layout.virtual_stages
    if p == 1:
        return float(layers)
    per_stage = -(-layers // (p * v)) * v
    if layout.schedule == "gpipe":
        return float(per_stage * m)
    if v == 1:
        return float(per_stage * min(p, m))
    return per_stage / v * min(v * p + p - 2, v * m)


# -- the prediction ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What a layout costs per device and per step (see the module docstring for the conventions)."""

    layout: Layout
    valid: bool
    fits: bool
    why: str | None
    """Why the layout is invalid or does not fit (one line); None when it runs."""
    peak_bytes: float = 0.0
    limit_bytes: float = 0.0
    memory: dict[str, float] = field(default_factory=dict)
    comm_bytes: dict[str, float] = field(default_factory=dict)
    """Ring-model bytes each device sends per step, by mesh axis (data, model, stage)."""
    crosses_hosts: dict[str, bool] = field(default_factory=dict)
    bubble: float = 0.0
    microbatches: int = 0
    step_time_s: float = math.inf
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds per step: compute, exposed comm per axis (comm_model, comm_data, comm_stage),
    bubble, optimizer."""
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    """Model FLOPs (no recompute) per second per device over peak."""
    hfu: float = 0.0
    """Hardware FLOPs (with recompute) per second per device over peak."""
    model_tflops_per_device: float = 0.0
    hardware_tflops_per_device: float = 0.0
    efficiency: float = 0.0
    """The matmul efficiency the compute time assumed."""

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["layout"] = self.layout.to_json()
        out["label"] = self.layout.label()
        out["meshkit_plan"] = self.layout.meshkit_plan()
        for k, v in out.items():
            if isinstance(v, float) and not math.isfinite(v):
                out[k] = None
        return out


def check(shape: ModelShape, layout: Layout, cluster: Cluster, job: Job) -> str | None:
    """Why the layout cannot run this model on this cluster, or None."""
    if layout.devices != cluster.devices:
        return f"dp*tp*pp = {layout.devices}, not the {cluster.devices} devices"
    if shape.heads % layout.tp:
        return f"tp={layout.tp} does not divide heads={shape.heads}"
    if shape.kv_heads % layout.tp and layout.tp % shape.kv_heads:
        return f"tp={layout.tp} neither divides nor is a multiple of kv_heads={shape.kv_heads}"
    if shape.layers < layout.pp * layout.virtual_stages:
        return f"pp*virtual_stages={layout.pp * layout.virtual_stages} exceeds layers={shape.layers}"
    per_replica = layout.dp * layout.microbatch_size
    if job.global_batch % per_replica:
        return f"global batch {job.global_batch} is not a multiple of dp*microbatch={per_replica}"
    m = job.global_batch // per_replica
    if layout.pp > 1 and layout.schedule in STEADY_SCHEDULES and m < layout.pp:
        return f"{layout.schedule} needs micro-batches >= pp: {m} < {layout.pp}"
    if layout.pp > 1 and layout.schedule == "interleaved" and m % layout.pp:
        return f"interleaved runs micro-batches in groups of pp={layout.pp}: {m} is not a multiple"
    if layout.pp == 1 and layout.virtual_stages > 1:
        return "virtual stages need pp > 1"
    if layout.zero and layout.dp == 1:
        return f"zero{layout.zero} over a data axis of one device shards nothing: use zero=0"
    return None


def crosses_hosts(stride: int, size: int, cluster: Cluster) -> bool:
    """Whether groups of ``size`` devices ``stride`` apart (mesh order stage, data, model: model
    innermost) span more than one host."""
    if size <= 1:
        return False
    dph, span = cluster.devices_per_host, stride * size
    if span <= dph and dph % span == 0:
        return False
    if stride >= dph or span % dph == 0:
        return True
    return any((r + stride * (size - 1)) // dph != r // dph for r in range(min(cluster.devices, span)))


def _bandwidth(cluster: Cluster, crosses: bool) -> float:
    h = cluster.hardware
    return h.inter_host_bytes_per_s if crosses else h.intra_host_bytes_per_s


def efficiency(
    shape: ModelShape, layout: Layout, hardware: Hardware, efficiencies: dict[str, float] | None = None
) -> float:
    """Calibrated matmul efficiency of the family, scaled down for narrow per-device matmuls."""
    n = min(shape.width / layout.tp, layout.microbatch_size * shape.seq)
    return (efficiencies or EFFICIENCY)[hardware.family] * n / (n + N_HALF)


def predict(
    shape: ModelShape,
    layout: Layout,
    cluster: Cluster,
    job: Job,
    *,
    efficiencies: dict[str, float] | None = None,
) -> Prediction:
    """The cost of ``layout`` for ``shape`` on ``cluster`` running ``job`` (see the module docstring);
    ``efficiencies`` replaces the calibrated ``EFFICIENCY`` per hardware family (calibration)."""
    why = check(shape, layout, cluster, job)
    if why is not None:
        return Prediction(layout=layout, valid=False, fits=False, why=why)
    hw, conv, e = cluster.hardware, job.convention, job.act_bytes
    dp, tp, pp, v, b = layout.dp, layout.tp, layout.pp, layout.virtual_stages, layout.microbatch_size
    m = job.global_batch // (dp * b)
    meshkit = job.runtime == "meshkit"
    per_stage = -(-shape.layers // (pp * v)) * v  # layers on the busiest device (uneven splits round up)
    tokens_mb = b * shape.seq  # tokens of one micro-batch

    # -- memory ----------------------------------------------------------------------------------
    stage_layers = per_stage * layer_params(shape, tp)
    if meshkit:  # embeddings and unembedding whole on every device (every stage)
        top_params = embed_params(shape) + head_params(shape)
        phi = stage_layers + top_params
    else:
        first = stage_layers + embed_params(shape, tp) + (head_params(shape, tp) if pp == 1 else 0)
        last = stage_layers + head_params(shape, tp)
        phi = max(first, last)  # parameters on the busiest device
    stage = ZERO_STAGES[layout.zero if dp > 1 else 0]
    state = zero_memory(phi, dp, stage, conv)
    full, dots, layer_in = layer_activation_bytes(shape, layout, job)
    held = in_flight(layout, shape.layers, m)
    if layout.remat == "layer":
        activations = held * layer_in + full
    elif layout.remat == "dots":
        activations = held * dots
    else:
        activations = held * full
    logits = (4 + e) * tokens_mb * shape.vocab / tp  # fp32 logits, their gradient in the compute dtype
    gathered = 0.0
    if stage == "zero3":
        one_layer = layer_params(shape, tp)
        gathered = one_layer * (conv.param + conv.grad)  # one gathered layer, its unsharded gradient
    memory = {
        "parameters": state.params,
        "gradients": state.grads,
        "optimizer": state.optimizer,
        "activations": activations,
        "logits": logits,
        "gathered_parameters": gathered,
    }
    if meshkit:
        from meshkit.planner import runtime

        memory = runtime.memory(shape, layout, job, layer_params(shape, tp), top_params, per_stage, m)
    peak = sum(memory.values())
    limit = hw.memory_bytes * MEMORY_USABLE

    # -- FLOPs and compute time ------------------------------------------------------------------
    recompute = 1 if layout.remat == "layer" else 0
    layer_fwd = layer_flops(shape) * tokens_mb / tp  # one layer, one micro-batch, one device
    head_fwd = head_flops(shape) * tokens_mb / tp
    stage_hw = per_stage * layer_fwd * (3 + recompute) + 3 * head_fwd  # the last (busiest) stage
    eff = efficiency(shape, layout, hw, efficiencies)
    peak_flops = hw.peak_flops if job.precision == "bf16" else hw.fp32_flops
    t_mb = stage_hw / (peak_flops * eff)
    t_mb += per_stage * (3 + recompute) * elementwise_bytes(shape, layout, job) / hw.hbm_bytes_per_s
    if layout.remat == "dots":  # the elementwise ops recomputed: their activations written and read again
        t_mb += per_stage * 2 * (full - dots) / hw.hbm_bytes_per_s

    # -- communication -----------------------------------------------------------------------------
    tp_cross = crosses_hosts(1, tp, cluster)
    dp_cross = crosses_hosts(tp, dp, cluster)
    pp_cross = crosses_hosts(tp * dp, pp, cluster)
    act = tokens_mb * shape.width * e  # one micro-batch's activation, whole
    if tp > 1:
        per_layer = 2 + (4 if meshkit else 2) + (1 if meshkit else 2) * recompute
        ends = 0 if meshkit else 2 if pp == 1 else 1  # vocab-parallel embedding, unembedding
        tp_mb = (per_stage * per_layer + ends) * ring_traffic("all-reduce", act, tp)
        if meshkit and pp > 1:  # a forward tick's 2 reduces per layer, a backward tick's 2 again + 4,
            # and under layer remat the block recomputed inside it redoes one (8 devices: 0.89 -> 1.00)
            tp_mb = (8 + recompute) * per_stage * ring_traffic("all-reduce", act, tp)
    else:
        tp_mb = 0.0
    t_tp_mb = tp_mb / _bandwidth(cluster, tp_cross)
    pp_bytes = 0.0  # meshkit: activation and cotangent permuted on every tick; else each sent once
    if pp > 1 and meshkit:  # and the replicated top's gradients all-reduced over the stages
        pp_bytes = 4 * (v * m + pp - 1) * act + ring_traffic("all-reduce", top_params * conv.grad, pp)
        if v > 1:  # interleaved: the chunks permuted into schedule order at the start, gradients back
            pp_bytes += stage_layers * (conv.param + conv.grad)
    elif pp > 1:
        pp_bytes = 2 * v * m * act / tp
    t_pp = pp_bytes / _bandwidth(cluster, pp_cross)
    grad_b, param_b = conv.grad * phi, conv.param * phi
    f = (dp - 1) / dp
    window = (2 + recompute) * per_stage * layer_fwd / (peak_flops * eff)  # backward of one micro-batch
    if stage == "dp":
        dp_bytes, hidden = 2 * f * grad_b, window
    elif stage == "zero1":
        dp_bytes, hidden = f * (grad_b + param_b), window
    elif stage == "zero2":
        dp_bytes, hidden = m * f * grad_b + f * param_b, m * window
    elif meshkit and pp > 1:  # fsdp+pp: one bucketed gather, one bucketed reduce-scatter per step,
        # both in the parameters' dtype (float32)
        dp_bytes, hidden = f * 2 * phi * conv.param, m * t_mb
    elif meshkit:  # the top gathered once per step, each layer per micro-batch (again under remat),
        # gradients reduce-scattered per micro-batch; gathers and reduce-scatters in the compute dtype,
        # in float32 under tensor parallelism (``Plan.gathers_in_compute_dtype``: fsdp+tp gathers the
        # parameters' dtype; compiled bf16 1.3 B at 64 devices, data axis 2.00 -> 1.00)
        gathers = 1 if layout.remat == "none" else 2
        g = 4 if tp > 1 else e
        top_b = top_params * g
        dp_bytes = f * (top_b + m * gathers * (phi - top_params) * g + m * phi * g)
        hidden = m * t_mb
    else:
        dp_bytes, hidden = m * f * (2 * param_b + grad_b), m * t_mb
    t_dp = dp_bytes / _bandwidth(cluster, dp_cross)
    exposed_dp = max(0.0, t_dp - DP_OVERLAP * hidden)

    # -- step time -------------------------------------------------------------------------------
    from meshkit.plans import bubble_model

    bub = bubble_model(pp, m, v) if pp > 1 else 0.0
    compute = m * t_mb
    exposed_tp = m * max(t_tp_mb * (1 - job.tp_overlap), t_tp_mb - t_mb)
    useful = compute + exposed_tp + t_pp
    t_bubble = useful * bub / (1 - bub)
    t_opt = 2 * (state.params + state.grads + state.optimizer) / hw.hbm_bytes_per_s  # read + write
    step = useful + t_bubble + exposed_dp + t_opt
    parts = {
        "compute": compute,
        "comm_model": exposed_tp,
        "comm_data": exposed_dp,
        "comm_stage": t_pp,
        "bubble": t_bubble,
        "optimizer": t_opt,
    }
    tokens = job.global_batch * shape.seq
    model_flops = model_flops_per_token(shape) * tokens
    hw_flops = model_flops + recompute * shape.layers * layer_flops(shape) * tokens
    per_device = cluster.devices * step
    fits = peak <= limit
    why = None
    if not fits:
        why = f"needs {peak / 1e9:.1f} GB per device, {limit / 1e9:.1f} GB usable ({peak / limit:.2f}x)"
    return Prediction(
        layout=layout, valid=True, fits=fits, why=why, peak_bytes=peak, limit_bytes=limit, memory=memory,
        comm_bytes={"data": dp_bytes, "model": m * tp_mb, "stage": pp_bytes},
        crosses_hosts={"data": dp_cross, "model": tp_cross, "stage": pp_cross},
        bubble=bub, microbatches=m, step_time_s=step, parts=parts, tokens_per_s=tokens / step,
        mfu=model_flops / per_device / peak_flops, hfu=hw_flops / per_device / peak_flops,
        model_tflops_per_device=model_flops / per_device / 1e12,
        hardware_tflops_per_device=hw_flops / per_device / 1e12, efficiency=eff,
    )  # fmt: skip
