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
  efficiency calibrated per software stack and hardware family on published runs (``Job.stack``,
  ``STACKS``, ``CALIBRATION``), scaled by
  ``n / (n + N_HALF)`` for the smallest per-device matmul dimension n (a GEMM narrower than a few
  hundred columns leaves tensor cores idle: ``N_HALF`` is where it reaches half); plus the
  memory-bound elementwise ops (norms, residual adds, activation function: ``elementwise_bytes``
  per pass at HBM bandwidth; forward, backward counted twice, recomputed forward), which is
  what makes small models reach a lower MFU than large ones.
- Communication, ring model (``analysis.cost.ring_traffic``) at the link bandwidth of the axis:
  intra-host for tensor parallelism (kept inside a host); a group that spans hosts with k members
  on each host crosses between hosts through k NICs (NCCL's rings run one channel per NIC), so at
  ``min(intra, k x inter)`` per device; pipeline sends go through one NIC, and so do the
  data-parallel collectives of a stack that leaves a host through one (``Stack.one_nic``: DeepSpeed's
  ZeRO-3 of 2021, whose published runs a fitted fraction of ring bandwidth put at an eighth, one of a
  DGX A100's eight NICs; ``Calibration.comm_efficiency``, fitted, is now 1). Each collective also
  pays NCCL's latency per ring step (``hardware.BASE_LATENCY_S``, ``Hardware.hop_s`` inside a host,
  ``host_hop_s`` between hosts: n - 1 steps for a gather or reduce-scatter, 2 (n - 1) for an
  all-reduce, or its tree's 2 (k - 1 + log2 hosts) where that is shorter), one collective per layer
  (per parameter tensor under DeepSpeed's ZeRO-3, ``Stack.zero3_per_tensor``).
  Tensor-parallel all-reduces sit between the matmuls that need them: exposed whole. Data-parallel
  gradient traffic overlaps the backward pass of the last micro-batch (ZeRO-3's gathers and
  reduce-scatters: the compute of every micro-batch), less the last layer's reduce (ZeRO-3: the
  first gather and the last reduce-scatter), which nothing hides; what does not fit is exposed,
  and what is hidden still costs ``Calibration.overlap_tax`` of its time (the collectives' kernels
  share the device with the matmuls). Pipeline sends are exposed.
- Stragglers: every step waits for the slowest of N devices; with a relative spread
  ``Calibration.straggler`` per device that is ``sqrt(2 ln N)`` spreads (the expected maximum of N
  normal variables) on top of the step.
- Hybrid sharding (``predict(shard_group=g)``): ZeRO-3 over groups of g data-parallel replicas,
  the gradients all-reduced across the dp / g groups (PyTorch's HSDP, MaxText's FSDP within a slice
  and data parallelism across); state sharded g ways.
- Context parallelism (cp): every sequence split over cp devices (``seq / cp`` tokens each: compute,
  activations and logits per device / cp), gradients reduced and ZeRO state sharded over dp x cp
  (x ep). Ring form (``Job.context_attention``): each layer passes its K/V block ``cp - 1`` times in
  the forward pass and K/V with their gradients in the backward (``collective-permute``, S each,
  through one NIC where the ring crosses hosts), hidden behind the attention (``4 S D_q`` per token)
  that consumes it, less the overlap tax; all-to-all form: Q, K, V to a head split and the output
  back, ``(cp - 1) / cp`` of each, forward and twice backward, exposed.
- Expert parallelism (ep, mixtures of experts only): the expert axis splits the batch as data does
  (outside the experts) and holds ``experts / ep`` experts of each layer; each MoE layer dispatches
  and combines its tokens by ``all-to-all`` (``(ep - 1) / ep`` of ``k x capacity_factor`` copies of
  each token's activation, forward, and again for their gradients backward), exposed, on the
  network the ep group spans. Expert weights, their gradients and optimizer state / ep; ZeRO shards
  the dense parameters over dp x cp x ep and the experts over dp x cp. FLOPs count the active
  parameters (k experts and the router per token).
- Bubble: ``(p - 1) / (v m + p - 1)`` (``plans.bubble_model``), applied to the stage's time per step.
- Memory: parameters, gradients and optimizer state by ZeRO stage (``analysis.cost.zero_memory``,
  mixed-precision Adam 2 + 2 + 12 bytes per parameter in bf16, 4 + 4 + 8 in fp32) of the largest
  stage's share of the parameters (matrices split over tp); activations per layer and micro-batch
  as Korthikanti et al. (2022) count them for a GPT layer with tensor and sequence parallelism, generalised to any MLP width, gated MLPs and grouped-query attention (the ``S^2``
  softmax terms left out under flash attention); times the layer-micro-batches a device holds
  (1F1B: up to p micro-batches on the first stage, GPipe: m, interleaved: ``v p + p - 2`` chunks of
  ``L / (p v)`` layers, as meshkit's schedule tables hold them);
  under full remat one layer input per layer-micro-batch plus one layer recomputed at a time.
  Transients: the fp32 logits and their gradient (compute dtype) on the last stage, ZeRO-3's gathered layer
  (DeepSpeed: its largest tensor) and its unsharded gradient. With sequence parallelism (``Job.sequence_parallel``, the default) the
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

from meshkit.analysis.cost import MemoryModel, ring_traffic, zero_memory
from meshkit.planner.cluster import Cluster, Job
from meshkit.planner.hardware import Hardware
from meshkit.planner.layout import Layout, ModelShape
from meshkit.planner.network import collective_latency, crosses_hosts, group_bandwidth
from meshkit.planner.sizes import (
    attention_core_flops,
    attention_widths,
    elementwise_bytes,
    embed_params,
    expert_params,
    head_flops,
    head_params,
    in_flight,
    layer_activation_bytes,
    layer_flops,
    layer_params,
    model_flops_per_token,
    routed,
)
from meshkit.planner.stacks import CALIBRATION, STACKS, Calibration, stack_for
from meshkit.plans.memory import zero_stage
from meshkit.spec import STEADY_SCHEDULES

N_HALF = 128
"""Per-device matmul dimension at which matmul efficiency falls to half its large-matrix value
(chosen from the shape of bf16 GEMM efficiency curves, not fitted)."""
MEMORY_USABLE = 0.9
"""Fraction of HBM a training step can use (the rest: allocator fragmentation, runtime, workspaces)."""
# -- the prediction ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What a layout costs per device and per step (see the module docstring for the conventions)."""

    layout: Layout
    valid: bool
    fits: bool
    why: str | None
    """Why the layout is invalid or does not fit (one line); None when it runs."""
    shard_group: int = 0
    """ZeRO-3's shard group (hybrid sharding when below dp); 0 where parameters are not sharded."""
    peak_bytes: float = 0.0
    limit_bytes: float = 0.0
    memory: dict[str, float] = field(default_factory=dict)
    comm_bytes: dict[str, float] = field(default_factory=dict)
    """Ring-model bytes each device sends per step, by mesh axis (data, model, stage; under hybrid
    sharding data within the shard group and replica across the groups)."""
    crosses_hosts: dict[str, bool] = field(default_factory=dict)
    bubble: float = 0.0
    microbatches: int = 0
    step_time_s: float = math.inf
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds per step: compute, exposed comm per axis (comm_model, comm_data, comm_stage,
    comm_context, comm_expert), bubble, optimizer, straggler."""
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    """Model FLOPs (no recompute) per second per device over peak."""
    hfu: float = 0.0
    """Hardware FLOPs (with recompute) per second per device over peak."""
    model_tflops_per_device: float = 0.0
    hardware_tflops_per_device: float = 0.0
    efficiency: float = 0.0
    """The matmul efficiency the compute time assumed."""
    stack: str = ""
    efficiency_source: str = ""
    """Where ``efficiency`` comes from (the stack's calibration, or an estimate and from what)."""

    @property
    def hybrid(self) -> bool:
        return 0 < self.shard_group < self.layout.dp

    def label(self) -> str:
        """The layout's label (``hsdp=g`` where ZeRO-3 shards over groups of g replicas)."""
        return self.layout.label()

    def meshkit_plan(self) -> str | None:
        """The meshkit plan that runs it (hsdp for hybrid sharding), or None where meshkit has none."""
        return self.layout.meshkit_plan()

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["layout"] = self.layout.to_json()
        out["label"] = self.label()
        out["meshkit_plan"] = self.meshkit_plan()
        for k, v in out.items():
            if isinstance(v, float) and not math.isfinite(v):
                out[k] = None
        return out


def check(shape: ModelShape, layout: Layout, cluster: Cluster, job: Job) -> str | None:
    """Why the layout cannot run this model on this cluster, or None."""
    if layout.devices != cluster.devices:
        return f"dp*tp*pp*cp*ep = {layout.devices}, not the {cluster.devices} devices"
    if layout.cp > 1 and shape.seq % (2 * layout.cp):
        return f"cp={layout.cp}: seq {shape.seq} does not split into 2*cp balanced chunks"
    if layout.cp > 1 and job.context_attention == "all-to-all" and shape.heads % (layout.cp * layout.tp):
        return (
            f"cp={layout.cp} all-to-all: heads={shape.heads} do not divide over cp*tp={layout.cp * layout.tp}"
        )
    if layout.ep > 1 and not shape.experts:
        return f"ep={layout.ep}: {shape.name} has no experts (a dense MLP)"
    if layout.ep > 1 and shape.experts % layout.ep:
        return f"ep={layout.ep} does not divide experts={shape.experts}"
    if shape.heads % layout.tp:
        return f"tp={layout.tp} does not divide heads={shape.heads}"
    if shape.kv_heads % layout.tp and layout.tp % shape.kv_heads:
        return f"tp={layout.tp} neither divides nor is a multiple of kv_heads={shape.kv_heads}"
    if shape.layers < layout.pp * layout.virtual_stages:
        return f"pp*virtual_stages={layout.pp * layout.virtual_stages} exceeds layers={shape.layers}"
    per_replica = layout.batch_ways * layout.microbatch_size
    if job.global_batch % per_replica:
        return f"global batch {job.global_batch} is not a multiple of dp*ep*microbatch={per_replica}"
    m = job.global_batch // per_replica
    if layout.pp > 1 and layout.schedule in STEADY_SCHEDULES and m < layout.pp:
        return f"{layout.schedule} needs micro-batches >= pp: {m} < {layout.pp}"
    if layout.pp > 1 and layout.schedule == "interleaved" and m % layout.pp:
        return f"interleaved runs micro-batches in groups of pp={layout.pp}: {m} is not a multiple"
    if layout.pp == 1 and layout.virtual_stages > 1:
        return "virtual stages need pp > 1"
    if layout.zero and layout.dp == 1:
        return f"zero{layout.zero} over a data axis of one device shards nothing: use zero=0"
    g = layout.shard_group
    if g and g != layout.dp:
        if layout.cp > 1 or layout.ep > 1:
            return f"hybrid sharding (shard group {g}) is priced without cp or ep"
        if layout.zero != 3:
            return f"hybrid sharding (shard group {g}) shards ZeRO-3: use zero=3"
        if layout.dp % g:
            return f"shard group {g} does not divide dp={layout.dp}"
        if job.runtime == "meshkit" and (layout.tp > 1 or layout.pp > 1):
            return f"meshkit's hybrid sharding (plan hsdp, shard group {g}) runs without tp or pp"
    return None


def efficiency(
    shape: ModelShape, layout: Layout, hardware: Hardware, job: Job, calibration: Calibration | None = None
) -> tuple[float, str]:
    """(the stack's calibrated matmul efficiency on this family, scaled down for narrow per-device
    matmuls; where that efficiency comes from)."""
    base, source = (calibration or CALIBRATION).efficiency_of(job.stack, hardware.family)
    tokens = layout.microbatch_size * shape.seq / layout.cp
    n = min(shape.width / layout.tp, tokens)
    if shape.experts:  # an expert's matmuls: its width, and the tokens it takes from the whole ep group
        n = min(n, shape.ffn / layout.tp, tokens * shape.experts_per_token * layout.ep / shape.experts)
    return base * n / (n + N_HALF), source


@dataclass(frozen=True, kw_only=True, slots=True)
class _Step:
    """The quantities every part of one prediction reads (set once by ``_setup``)."""

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

    @property
    def batch_group(self) -> int:
        """Devices holding the same dense parameters: dp x cp x ep (their gradients are reduced over all)."""
        return self.layout.dp * self.layout.cp * self.layout.ep

    @property
    def window(self) -> float:
        """Seconds of one micro-batch's backward pass (what hides a gradient reduce)."""
        return (2 + self.recompute) * self.per_stage * self.layer_fwd / (self.peak_flops * self.eff)


def _setup(shape, layout, cluster, job, calibration) -> _Step:
    hw, lay = cluster.hardware, layout
    stack_for(job, hw)
    tp, pp, v = lay.tp, lay.pp, lay.virtual_stages
    m = job.global_batch // (lay.batch_ways * lay.microbatch_size)
    per_stage = -(-shape.layers // (pp * v)) * v
    tokens_mb = lay.microbatch_size * shape.seq // lay.cp
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
        phi = max(first, stage_layers + head_params(shape, tp))
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
    return _Step(shape=shape, layout=lay, cluster=cluster, job=job, m=m, per_stage=per_stage, tokens_mb=tokens_mb,
                 phi=phi, experts_phi=per_stage * expert_params(shape) / (tp * lay.ep), top_params=top_params, top_split=top_split, stage_layers=stage_layers, shard=lay.shard_group or lay.dp,
                 recompute=recompute, layer_fwd=layer_fwd, peak_flops=peak_flops, eff=eff, eff_source=source,
                 t_mb=t_mb, activations=acts)  # fmt: skip


def _memory(s: _Step):
    """(memory by component, the ZeRO state) on the busiest device."""
    lay, job, conv = s.layout, s.job, s.job.convention
    rule = zero_stage(lay.zero if lay.dp > 1 else 0)
    stage = rule.name
    shard = rule.shard_group(lay.dp, s.shard) * lay.cp  # ZeRO over dp x cp (x ep outside the experts)
    state = zero_memory(s.phi - s.experts_phi, shard * lay.ep, stage, conv)
    if s.experts_phi:  # the experts: over dp x cp only
        experts = zero_memory(s.experts_phi, shard, stage, conv)
        state = MemoryModel(stage=stage, params=state.params + experts.params, grads=state.grads + experts.grads,
                            optimizer=state.optimizer + experts.optimizer)  # fmt: skip
    full, dots, layer_in = s.activations
    held = in_flight(lay, s.shape.layers, s.m)
    if lay.remat == "layer":
        activations = held * layer_in + full
    elif lay.remat == "dots":
        activations = held * dots
    else:
        activations = held * full
    memory = {
        "parameters": state.params,
        "gradients": state.grads,
        "optimizer": state.optimizer,
        "activations": activations,
        # fp32 logits, their gradient in the compute dtype
        "logits": (4 + job.act_bytes) * s.tokens_mb * s.shape.vocab / lay.tp,
        # ZeRO-3: one gathered layer (tensor, where the stack gathers tensor by tensor), its unsharded gradient
        "gathered_parameters": _gathered(s) * (conv.param + conv.grad) if rule.shards("params") else 0.0,
    }
    if s.meshkit:
        from meshkit.planner import runtime

        memory = runtime.memory(
            s.shape, lay, job, layer_params(s.shape, lay.tp), s.top_params, s.per_stage, s.m, shard=s.shard
        )
    return memory, state


def _gathered(s: _Step) -> float:
    """Parameters ZeRO-3 holds gathered at once: a layer, or its largest matrix where the stack gathers
    each tensor by itself (the fused QKV projection or an MLP matrix)."""
    if not STACKS[s.job.stack].zero3_per_tensor:
        return layer_params(s.shape, s.layout.tp, s.layout.ep)
    q, kv = attention_widths(s.shape)
    return s.shape.width * max(s.shape.ffn, q + 2 * kv) / s.layout.tp


def _model_axis(s: _Step) -> tuple[float, float]:
    """(bytes, seconds) of one micro-batch's tensor-parallel all-reduces on one device."""
    tp, pp = s.layout.tp, s.layout.pp
    if tp == 1:
        return 0.0, 0.0
    if s.meshkit and pp > 1:  # a forward tick's 2 reduces per layer, a backward tick's 2 again + 4,
        # and under layer remat the block recomputed inside it redoes one (8 devices: 0.89 -> 1.00)
        count = (8 + s.recompute) * s.per_stage
    else:
        per_layer = 2 + (4 if s.meshkit else 2) + (1 if s.meshkit else 2) * s.recompute
        ends = 0 if s.meshkit else 2 if pp == 1 else 1  # vocab-parallel embedding, unembedding
        count = s.per_stage * per_layer + ends
    act = s.tokens_mb * s.shape.width * s.job.act_bytes  # one micro-batch's activation, whole
    nbytes = count * ring_traffic("all-reduce", act, tp)
    if s.meshkit and pp == 1 and s.top_split > 1:  # the vocabulary on the model axis: the lookup's
        # forward and the head's backward partial sums, and the cross-entropy's three all-reduces of a
        # number per token over the split logits (max, sum, target; at least float32: ``_expected``)
        count += 2 + 3
        nbytes += 2 * ring_traffic("all-reduce", act, tp)
        nbytes += 3 * ring_traffic("all-reduce", s.tokens_mb * max(s.job.act_bytes, 4), tp)
    seconds = nbytes / group_bandwidth(s.cluster, 1, tp) + count * collective_latency(
        s.cluster, "all-reduce", 1, tp
    )
    return nbytes, seconds


def _stage_axis(s: _Step) -> tuple[float, float]:
    """(bytes, seconds) per step of the pipeline's sends on one device (exposed)."""
    lay, conv = s.layout, s.job.convention
    pp, v, m = lay.pp, lay.virtual_stages, s.m
    if pp == 1:
        return 0.0, 0.0
    act = s.tokens_mb * s.shape.width * s.job.act_bytes
    if s.meshkit:  # activation and cotangent permuted on every tick, the replicated top's gradients
        # all-reduced over the stages
        nbytes = 4 * (v * m + pp - 1) * act + ring_traffic("all-reduce", s.top_params * conv.grad, pp)
        sends = 4 * (v * m + pp - 1)
        if v > 1:  # interleaved: the chunks permuted into schedule order at the start, gradients back
            nbytes += s.stage_layers * (conv.param + conv.grad)
    else:  # each activation and its gradient sent once per chunk
        nbytes, sends = 2 * v * m * act / lay.tp, 2 * v * m
    stride = lay.tp * s.batch_group
    seconds = nbytes / group_bandwidth(s.cluster, stride, pp, one_nic=True)
    return nbytes, seconds + sends * collective_latency(s.cluster, "collective-permute", stride, pp)


def _context_axis(s: _Step, cal: Calibration) -> tuple[float, float]:
    """(bytes, exposed seconds) of one micro-batch's context-parallel traffic on one device.

    Ring: every layer passes its K/V block ``cp - 1`` times forward (``collective-permute``, S each)
    and K/V with their gradients dK/dV backward (twice S), again per recomputed forward; each pass hides
    behind the attention it feeds (``attention_core_flops``), less the overlap tax. All-to-all: Q, K
    and V to a head split, the output back, ``(cp - 1) / cp`` of each, forward and twice backward."""
    lay, cp, e = s.layout, s.layout.cp, s.job.act_bytes
    if cp == 1:
        return 0.0, 0.0
    q, kv = attention_widths(s.shape)
    kv_local = max(kv / lay.tp, s.shape.head_dim)  # kv heads split over tp (whole heads: repeated below one)
    passes = (3 + s.recompute) * s.per_stage
    stride, c = lay.tp, s.cluster
    if s.job.context_attention == "all-to-all":
        size = s.tokens_mb * (2 * q / lay.tp + 2 * kv_local) * e
        nbytes = passes * ring_traffic("all-to-all", size, cp)
        t = nbytes / group_bandwidth(c, stride, cp) + 4 * passes * collective_latency(
            c, "all-to-all", stride, cp
        )
        return nbytes, t
    block = s.tokens_mb * 2 * kv_local * e  # K and V of this device's chunk
    nbytes = passes * (cp - 1) * ring_traffic("collective-permute", block, cp)
    steps = passes * (cp - 1)
    t = nbytes / group_bandwidth(c, stride, cp, one_nic=True) + steps * collective_latency(
        c, "collective-permute", stride, cp
    )
    attention = passes * attention_core_flops(s.shape) * s.tokens_mb / lay.tp / (s.peak_flops * s.eff)
    return nbytes, max(0.0, t - attention) + cal.overlap_tax * min(t, attention)


def _expert_axis(s: _Step) -> tuple[float, float]:
    """(bytes, seconds) of one micro-batch's expert-parallel all-to-alls on one device (exposed):
    per MoE layer, the tokens dispatched to their experts and combined back (``k x capacity_factor``
    copies of each token's activation, ``(ep - 1) / ep`` of them leaving the device), forward, their
    gradients backward, again per recomputed forward."""
    lay, ep = s.layout, s.layout.ep
    if ep == 1:
        return 0.0, 0.0
    split = lay.tp if s.job.sequence_parallel else 1  # the tokens a tensor-parallel rank dispatches
    size = s.tokens_mb * routed(s.shape) * s.shape.capacity_factor * s.shape.width * s.job.act_bytes / split
    count = 2 * (2 + s.recompute) * s.per_stage  # dispatch and combine: forward, backward, recomputed forward
    nbytes = count * ring_traffic("all-to-all", size, ep)
    stride = lay.tp * lay.cp
    t = nbytes / group_bandwidth(s.cluster, stride, ep) + count * collective_latency(
        s.cluster, "all-to-all", stride, ep
    )
    return nbytes, t


@dataclass(frozen=True, kw_only=True, slots=True)
class _Flow:
    """Data-parallel traffic of one kind per step: bytes per device over a group, in ``count``
    collectives, hidden behind ``window`` seconds of compute but for the ``edge`` fraction."""

    nbytes: float
    count: int
    op: str
    stride: int
    size: int
    window: float
    edge: float
    axis: str = "data"
    """The mesh axis it runs over: data, or hybrid sharding's replica (across the shard groups)."""


def _data_flows(s: _Step) -> list[_Flow]:
    """The data-parallel traffic of one step (the bytes as ``analysis.cost`` and ``plans`` count them)."""
    lay, conv, m, L = s.layout, s.job.convention, s.m, s.per_stage
    # the gradients of the dense parameters reduce over dp x cp x ep, the experts' over dp x cp: one
    # group of dp x cp x ep carries both (the experts' (n - 1) / n read at the larger n)
    dp, tp, g = s.batch_group, lay.tp, s.shard * lay.cp * lay.ep
    if dp == 1:
        return []
    rule = zero_stage(lay.zero)
    grad_b, param_b = conv.grad * s.phi, conv.param * s.phi
    flow = lambda nbytes, count, window, edge, op="all-gather", stride=tp, size=dp, axis="data": _Flow(  # noqa: E731
        nbytes=nbytes, count=count, op=op, stride=stride, size=size, window=window, edge=edge, axis=axis
    )

    def step(rows, n: int, extra: float = 0.0) -> tuple[float, int]:  # (bytes, collectives) per layer
        return extra + sum(r.traffic(n) for r in rows), sum(r.count for r in rows)

    if not rule.shards("params"):  # one collective per layer and kind; the last layer's reduce unhidden
        # (ZeRO-1: its reduce-scatter and gather), the rest behind the backward of the micro-batches
        # whose gradients it reduces (ZeRO-2: each)
        nbytes, kinds = step(rule.collectives(grad_b, param_b, microbatches=m), dp)
        op, behind = (
            ("all-reduce", 1) if rule.level == 0 else ("all-gather", m if rule.shards("grads") else 1)
        )
        edge = 2 / (kinds * L) if rule.level == 1 else 1 / (kinds * L)
        return [flow(nbytes, kinds * L, behind * s.window, edge, op=op)]
    hidden = m * s.t_mb
    if s.meshkit and lay.pp > 1:  # fsdp+pp: one bucketed gather before the first tick, one bucketed
        # reduce-scatter after the last, both in the parameters' dtype (float32): nothing hides them
        nbytes, count = step(rule.collectives(param_b, param_b), dp)
        return [flow(nbytes, count, hidden, 1.0)]
    if s.meshkit:  # the top gathered once per step, each layer per micro-batch (again under remat),
        # gradients reduce-scattered per micro-batch; gathers and reduce-scatters in the compute dtype,
        # in float32 under tensor parallelism (``Plan.gathers_in_compute_dtype``: fsdp+tp gathers the
        # parameters' dtype; compiled bf16 1.3 B at 64 devices, data axis 2.00 -> 1.00)
        e = 4 if tp > 1 else s.job.act_bytes
        rows = rule.collectives(s.phi * e, (s.phi - s.top_params) * e, microbatches=m,
                                gathers=1 if lay.remat == "none" else 2)  # fmt: skip
        nbytes, count = step(rows, g, extra=ring_traffic("all-gather", s.top_params * e, g))
        flows = [flow(nbytes, 1 + count * L, hidden, 2 / (1 + count * L), size=g)]
        if g < dp:  # hsdp: the float32 gradient shards all-reduced across the dp / g groups once, after
            # the micro-batch loop (one all-reduce, XLA combines them): nothing hides it
            r, row = dp // g, rule.across_replicas(4 * s.phi, g)
            flows.append(
                flow(row.traffic(r), 1, hidden, 1.0, op="all-reduce", stride=tp * g, size=r, axis="replica")
            )
        return flows
    units = (9 if s.shape.gated else 12) if STACKS[s.job.stack].zero3_per_tensor else 1  # tensors a layer has
    # gathered for the forward, again for the backward, gradients reduce-scattered
    nbytes, count = step(rule.collectives(grad_b, param_b, microbatches=m, gathers=2), g)
    flows = [flow(nbytes, count * L * units, hidden, 2 / (count * L * units), size=g)]
    if g < dp:  # hybrid: each shard's gradient all-reduced across the dp / g groups
        r, row = dp // g, rule.across_replicas(grad_b, g)
        flows.append(
            flow(row.traffic(r), L, s.window, 1 / L, op="all-reduce", stride=tp * g, size=r, axis="replica")
        )
    return flows


def _exposed(s: _Step, flow: _Flow, cal: Calibration) -> tuple[float, bool]:
    """(seconds of the flow the step waits for, whether it crosses hosts)."""
    c, tax = s.cluster, cal.overlap_tax
    bandwidth = group_bandwidth(c, flow.stride, flow.size, one_nic=STACKS[s.job.stack].one_nic)
    t = flow.nbytes / (bandwidth * cal.comm_efficiency.get(s.job.stack, 1.0))
    t += flow.count * collective_latency(c, flow.op, flow.stride, flow.size)
    hideable = t * (1 - flow.edge)
    exposed = t * flow.edge + max(0.0, hideable - flow.window) + tax * min(hideable, flow.window)
    return exposed, crosses_hosts(flow.stride, flow.size, c)


def _by_axis(flows: list[_Flow], values: list, combine) -> dict:
    """``combine`` of each data-parallel axis's values: data always, replica under hybrid sharding."""
    axes = ["data"] + (["replica"] if any(fl.axis == "replica" for fl in flows) else [])
    return {a: combine(v for fl, v in zip(flows, values, strict=True) if fl.axis == a) for a in axes}


def _new_axes(lay: Layout, context, expert) -> dict:
    """The context and expert axes' entries, where the layout has them (dense layouts keep their keys)."""
    return {k: v for k, v, n in (("context", context, lay.cp), ("expert", expert, lay.ep)) if n > 1}


def predict(
    shape: ModelShape,
    layout: Layout,
    cluster: Cluster,
    job: Job,
    *,
    calibration: Calibration | None = None,
    shard_group: int = 0,
) -> Prediction:
    """The cost of ``layout`` for ``shape`` on ``cluster`` running ``job`` (see the module docstring);
    ``calibration`` replaces ``CALIBRATION`` (calibration); ``shard_group`` shards ZeRO-3 over groups of
    that many data-parallel replicas and replicates across them (hybrid sharding; 0: all of dp)."""
    if shard_group:
        layout = layout.replace(shard_group=shard_group)
    why = check(shape, layout, cluster, job)
    if why is not None:
        return Prediction(layout=layout, valid=False, fits=False, why=why)
    cal = calibration or CALIBRATION
    s = _setup(shape, layout, cluster, job, cal)
    memory, state = _memory(s)
    tp_bytes, t_tp_mb = _model_axis(s)
    pp_bytes, t_pp = _stage_axis(s)
    cp_bytes, t_cp_mb = _context_axis(s, cal)
    ep_bytes, t_ep_mb = _expert_axis(s)
    flows = _data_flows(s)
    exposed = [_exposed(s, fl, cal) for fl in flows]
    lay, hw = layout, cluster.hardware
    from meshkit.plans import bubble_model

    bub = bubble_model(lay.pp, s.m, lay.virtual_stages) if lay.pp > 1 else 0.0
    compute = s.m * s.t_mb
    exposed_tp = s.m * max(t_tp_mb * (1 - job.tp_overlap), t_tp_mb - s.t_mb)
    useful = compute + exposed_tp + t_pp + s.m * (t_cp_mb + t_ep_mb)
    parts = {
        "compute": compute,
        "comm_model": exposed_tp,
        "comm_data": sum(t for t, _ in exposed),
        "comm_stage": t_pp,
        "comm_context": s.m * t_cp_mb,
        "comm_expert": s.m * t_ep_mb,
        "bubble": useful * bub / (1 - bub),
        "optimizer": 2 * (state.params + state.grads + state.optimizer) / hw.hbm_bytes_per_s,  # read + write
    }
    step = sum(parts.values())
    parts["straggler"] = step * cal.straggler * math.sqrt(2 * math.log(cluster.devices))
    step += parts["straggler"]
    tokens = job.global_batch * shape.seq
    model_flops = model_flops_per_token(shape) * tokens
    hw_flops = model_flops + s.recompute * shape.layers * layer_flops(shape) * tokens
    per_device = cluster.devices * step
    peak, limit = sum(memory.values()), hw.memory_bytes * MEMORY_USABLE
    why = (
        None
        if peak <= limit
        else (f"needs {peak / 1e9:.1f} GB per device, {limit / 1e9:.1f} GB usable ({peak / limit:.2f}x)")
    )
    return Prediction(
        layout=layout, valid=True, fits=why is None, why=why, shard_group=s.shard if lay.zero == 3 else 0,
        peak_bytes=peak, limit_bytes=limit, memory=memory,
        comm_bytes={**_by_axis(flows, [fl.nbytes for fl in flows], sum),
                    "model": s.m * tp_bytes, "stage": pp_bytes, **_new_axes(lay, s.m * cp_bytes, s.m * ep_bytes)},
        crosses_hosts={**_by_axis(flows, [x for _, x in exposed], any), "model": crosses_hosts(1, lay.tp, cluster),
                       "stage": crosses_hosts(lay.tp * s.batch_group, lay.pp, cluster),
                       **_new_axes(lay, crosses_hosts(lay.tp, lay.cp, cluster),
                                   crosses_hosts(lay.tp * lay.cp, lay.ep, cluster))},
        bubble=bub, microbatches=s.m, step_time_s=step, parts=parts, tokens_per_s=tokens / step,
        mfu=model_flops / per_device / s.peak_flops, hfu=hw_flops / per_device / s.peak_flops,
        model_tflops_per_device=model_flops / per_device / 1e12,
        hardware_tflops_per_device=hw_flops / per_device / 1e12, efficiency=s.eff, stack=job.stack,
        efficiency_source=s.eff_source,
    )  # fmt: skip
