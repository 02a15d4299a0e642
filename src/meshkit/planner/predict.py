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
  ZeRO-3 of 2021, whose published runs reach one of a DGX A100's eight NICs; with it the fitted
  fraction of ring bandwidth, ``Calibration.comm_efficiency``, is 1 for every stack). Each collective also
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

from meshkit.analysis.cost import MemoryModel, zero_memory
from meshkit.planner import traffic
from meshkit.planner.cluster import Cluster, Job
from meshkit.planner.layout import Layout, ModelShape, degree_names
from meshkit.planner.sizes import (
    attention_widths,
    in_flight,
    layer_flops,
    layer_params,
    model_flops_per_token,
)
from meshkit.planner.stacks import CALIBRATION, STACKS, Calibration
from meshkit.planner.step import Step, setup
from meshkit.plans.axes import AXIS_PLANS
from meshkit.plans.memory import zero_stage
from meshkit.spec import DATA, MODEL, REPLICA, STAGE
from meshkit.spec import plans as spec_plans

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
    """Why the layout cannot run this model on this cluster, or None: its devices and batch, then each
    axis's own refusals (``AxisPlan.check_layout``), then the data part's."""
    if layout.devices != cluster.devices:
        names = "*".join(degree_names())
        return f"{names} = {layout.devices}, not the {cluster.devices} devices"
    per_replica = layout.batch_ways * layout.microbatch_size
    if job.global_batch % per_replica:
        ways = "*".join(["dp", *(r.token for r in spec_plans.AXIS_RULES if r.splits == "rows"), "microbatch"])
        return f"global batch {job.global_batch} is not a multiple of {ways}={per_replica}"
    for axis in AXIS_PLANS.values():
        why = axis.check_layout(shape, layout, job)
        if why is not None:
            return why
    if layout.zero and layout.dp == 1:
        return f"zero{layout.zero} over a data axis of one device shards nothing: use zero=0"
    g = layout.shard_group
    if g and g != layout.dp:
        if any(n > 1 for a, n in layout.degrees if a not in (MODEL, STAGE)):
            return f"hybrid sharding (shard group {g}) is priced without cp or ep"
        if layout.zero != 3:
            return f"hybrid sharding (shard group {g}) shards ZeRO-3: use zero=3"
        if layout.dp % g:
            return f"shard group {g} does not divide dp={layout.dp}"
        if job.runtime == "meshkit" and (layout.tp > 1 or layout.pp > 1):
            return f"meshkit's hybrid sharding (plan hsdp, shard group {g}) runs without tp or pp"
    return None


def _memory(s: Step):
    """(memory by component, the ZeRO state) on the busiest device."""
    lay, job, conv = s.layout, s.job, s.job.convention
    rule = zero_stage(lay.zero if lay.dp > 1 else 0)
    stage = rule.name
    shard = rule.shard_group(lay.dp, s.shard) * lay.sequence_ways  # ZeRO over dp x cp (ep: outside experts)
    state = zero_memory(s.phi - s.experts_phi, shard * lay.batch_ways // lay.dp, stage, conv)
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


def _gathered(s: Step) -> float:
    """Parameters ZeRO-3 holds gathered at once: a layer, or its largest matrix where the stack gathers
    each tensor by itself (the fused QKV projection or an MLP matrix)."""
    if not STACKS[s.job.stack].zero3_per_tensor:
        return layer_params(s.shape, s.layout.tp, s.layout.ep)
    q, kv = attention_widths(s.shape)
    return s.shape.width * max(s.shape.ffn, q + 2 * kv) / s.layout.tp


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
    s = setup(shape, layout, cluster, job, cal)
    memory, state = _memory(s)
    flows = traffic.flows(s)
    priced = [traffic.price(s, fl, cal) for fl in flows]
    used = [DATA] + [axis for axis, n in layout.degrees if n > 1]  # every layout reports its data part
    comm_bytes = {a: 0.0 for a in used} | {fl.axis: 0.0 for fl in flows}
    crossing = dict.fromkeys(comm_bytes, False)
    exposed = {f"comm_{axis}": 0.0 for axis in AXIS_PLANS}
    for fl, (seconds, crosses) in zip(flows, priced, strict=True):
        comm_bytes[fl.axis] += fl.nbytes
        crossing[fl.axis] |= crosses
        exposed[f"comm_{DATA if fl.axis == REPLICA else fl.axis}"] += seconds  # hsdp's replicas: data's part
    hw = cluster.hardware
    from meshkit.plans import bubble_model

    bub = bubble_model(layout.pp, s.m, layout.virtual_stages) if layout.pp > 1 else 0.0
    compute = s.m * s.t_mb
    useful = compute + sum(t for k, t in exposed.items() if k != f"comm_{DATA}")
    parts = {"compute": compute, **exposed, "bubble": useful * bub / (1 - bub),
             "optimizer": 2 * (state.params + state.grads + state.optimizer) / hw.hbm_bytes_per_s}  # fmt: skip
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
        layout=layout, valid=True, fits=why is None, why=why, shard_group=s.shard if layout.zero == 3 else 0,
        peak_bytes=peak, limit_bytes=limit, memory=memory,
        comm_bytes=comm_bytes, crosses_hosts=crossing,
        bubble=bub, microbatches=s.m, step_time_s=step, parts=parts, tokens_per_s=tokens / step,
        mfu=model_flops / per_device / s.peak_flops, hfu=hw_flops / per_device / s.peak_flops,
        model_tflops_per_device=model_flops / per_device / 1e12,
        hardware_tflops_per_device=hw_flops / per_device / 1e12, efficiency=s.eff, stack=job.stack,
        efficiency_source=s.eff_source,
    )  # fmt: skip
