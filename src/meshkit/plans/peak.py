"""Peak per-device memory of a training step: the compiled step, compiled from abstract shapes
(nothing allocated), beside a model from the placement and the loss's layers.

Measured is ``memory_analysis()``'s arguments + temporaries (the outputs alias the donated
parameters and optimizer state). The model (``predict_peak``) is analytic in what the plan adds
(parameters and optimizer state at rest, gathered buckets and slices, gradients, the update) and
takes the activations from the compiler itself: the loss's gradient compiled on one device, with no
plan (``compiled_activations``), because which activations XLA keeps for the backward pass is its
fusion decision, not a property of the jaxpr. Each term and the measurement behind it is in
``predict_peak``'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.plans._expected import memory_formula
from meshkit.plans._fsdp import PerLayer, abstract, analyse, layered_loss
from meshkit.plans.assemble import Assembled, assemble
from meshkit.plans.placement import Placement
from meshkit.spec import MODEL, ParallelSpec, get_plan


def step_extra(state: Any, micro: Any, key: Any = None) -> tuple:
    """What the step's loss reads besides the parameters, as abstract values: ``(state, micro, key)``
    (the form ``meshkit.plans._fsdp`` traces and differentiates)."""
    key = jax.eval_shape(lambda: jax.random.key(0)) if key is None else key
    return jax.tree.map(abstract, (state, micro, key))


def pair(loss_fn: Callable) -> Callable:
    """The step loss ``(params, state, batch, key) -> (loss, (aux, state))`` as ``(params, extra)``."""
    return lambda p, extra: loss_fn(p, *extra)


@dataclass(frozen=True, kw_only=True, slots=True)
class AbstractStep:
    """A plan's step compiled from shapes, with what the model needs to predict its memory."""

    compiled: Any
    assembled: Assembled
    params: Any
    """Parameter shapes (jax.ShapeDtypeStruct)."""
    batch: Any

    @property
    def per_layer(self) -> PerLayer:
        return self.assembled.per_layer

    def predict(self) -> PeakModel:
        a = self.assembled
        return predict_peak(a.loss, a.per_layer, self.params, self.batch, a.optimizer, a.spec.accumulate)

    @property
    def measured_peak(self) -> int:
        m = self.compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.temp_size_in_bytes)


def abstract_step(
    loss_fn: Callable,
    params: Any,
    batch: Any,
    optimizer: optax.GradientTransformation,
    spec: ParallelSpec | None = None,
    *,
    logical_axes: Any = None,
    clip_norm: float | None = None,
    grad_norm: bool = False,
    **options: Any,
) -> AbstractStep:
    """Compile the step of ``spec`` (or of the spec ``options`` make: ``plan=``, ``mesh=``, ``remat=``...)
    ahead of time from parameter and batch shapes (ShapeDtypeStructs); ``loss_fn(params, batch)``
    returns the loss."""
    spec = ParallelSpec.of(spec, **options)
    step = assemble(loss_fn, params, optimizer, spec, logical_axes=logical_axes, clip_norm=clip_norm,
                    grad_norm=grad_norm)  # fmt: skip
    return AbstractStep(
        compiled=step.lower(params, batch).compile(), assembled=step, params=params, batch=batch
    )


def nbytes(tree: Any) -> float:
    return float(
        sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class PeakModel:
    """Predicted per-device bytes at the step's peak (see ``predict_peak``)."""

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


def compiled_activations(loss_fn: Callable, per: PerLayer, params: Any, extra: Any) -> float:
    """Bytes XLA keeps for the loss's own forward and backward pass, per device: the temporaries of
    the loss's gradient compiled on one device for one device's micro-batch (``loss_fn(params,
    extra) -> (loss, aux)``; ``extra``: state, micro-batch and key, ``step_extra``), every layer
    under the remat policy, with the parameters whole and no data-axis collectives (under tensor
    parallelism: on one data shard's ``model`` devices, each leaf split by its tensor-parallel spec,
    so the partitioner splits the heads' and the MLP's activations as in the step; compiled on one
    device instead, with whole leaves, the model predicted 1.4-2.4x the measured peak of dp+tp and
    fsdp+tp on a GPT, data=4,model=2 and data=2,model=4). Each gradient is reduced
    where it is made (as the step's update or reduce-scatter consumes it), so the term holds what
    the backward pass keeps plus its working set, and no gradient output, except in a scan (below).

    Why compile rather than count: what the backward pass keeps is the compiler's choice, not
    JAX's. ``saved_residuals`` lists what JAX's linearization saves; XLA fuses the cheap elementwise
    ones into the backward pass's fusions and recomputes them from what it does keep (matmul
    outputs and operands, exponentials, tanh, reductions), and drops residuals the backward pass
    does not read. Counting matmul outputs only (the model before) missed attention's T x T
    scores and softmax and the MLP's hidden activations: on ``meshkit train``'s defaults (seq 128,
    width 128, 2 layers) it predicted 2.0 MiB of activations where the step keeps about 17, so the
    whole peak came out at 1/2.7 of the measured. Counting every residual over-counts by about 1.4x
    (the GPT block keeps some 28 of JAX's 45 activation-sized residuals). The plan does not change
    what the model keeps: it adds gathers, gradients and buckets, which ``predict_peak`` models.

    Loop and hook forms: under zero3 each layer sits behind the same optimization barriers as in
    the step (they decide what XLA schedules together), except under ``regather``, compiled under
    its policy without barriers (a barrier's output is saveable: on one device the policy would
    save its copy of the whole weights, which the plan gathers again instead). Compiled as ``none``
    (the model before), it missed 1.0 MiB per layer on the issue-14 GPT (1.13 at 16 layers): the
    policy's saved residuals enter the backward pass through ``jax.checkpoint``'s own barrier, so
    XLA keeps every one of them (4.26 MiB per layer, as many as a scan stacks), where without
    remat it fuses the cheap ones away (3.26).

    Scanned form: compiled without barriers (in a scan the barrier's copy of each layer's slice
    would be saved as a stacked residual, which the plan gathers instead) and under every policy,
    ``regather`` included (it saves what the step's body saves: everything but the gathers). The
    stacked gradients are one output of the backward loop, which XLA cannot reduce inside it: the
    temporaries include them (the stacked layer bytes) and the loop's buffers for one layer's
    parameter and gradient slices; ``predict_peak`` takes those out and models the plan's own.
    Under ``regather`` the compile also holds a copy of one layer's weights in the backward loop
    (its temporaries exceed ``none``'s by a constant in depth: 2.25 MiB on the issue-14 GPT at 2, 3
    and 4 layers, where one layer's parameters are 3.0), which zero3 gathers again instead (the
    model's bucket): ``predict_peak`` takes one layer's parameters out (bench shape 0.85 -> 0.97).
    Counting the scan's saved residuals instead (the model before: a scan stacks every residual it
    saves, so none is fused away) missed one layer's backward working set inside the loop (its
    T x T gradients; recomputed values under remat): 1.16x measured/predicted on an attention-heavy
    GPT without remat, 3.35x with layer remat."""
    placement = Placement(plan=get_plan("dp"), mesh=per.placement.mesh, leaves=per.placement.leaves)
    scan = per.found is not None and per.found.mode == "scan"
    barriers = per.gathers and not scan and per.remat != "regather"
    local = PerLayer(placement=placement, remat=per.remat, found=per.found, barriers_only=barriers)
    f = layered_loss(loss_fn, local, params, extra)
    leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(params)]

    def step(xs, e):  # each gradient consumed where it is made, as the update would
        loss, grads = jax.value_and_grad(lambda xs: f(xs, e)[0])(xs)
        return loss, [jnp.sum(g) for g in grads]

    m = per.placement.model_size
    if m > 1:  # tensor parallel: the loss on one data shard's devices, split on the model axis as in
        # the step (the partitioner splits the activations of the heads and the MLP's hidden units)
        # (this process's own devices where it has m of them: a multi-host compile then needs no
        # other process)
        devices = list(np.asarray(per.placement.mesh.devices).reshape(-1))
        mine = [d for d in devices if d.process_index == jax.process_index()]
        sub = jax.sharding.Mesh(np.asarray(mine if len(mine) >= m else devices)[:m], (MODEL,))
        specs = [NamedSharding(sub, leaf.spec(data=False)) for leaf in per.placement.flat()]
        leaves = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=h) for x, h in zip(leaves, specs, strict=True)
        ]
        rep = NamedSharding(sub, P())
        extra = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep, weak_type=a.weak_type), extra
        )
    traced = jax.jit(step).trace(leaves, extra)
    # the same program (another plan's Trainer, verify's next certificate): one compile; the jaxpr
    # text does not show the inputs' shardings, so the tensor-parallel split is part of the key
    key = str(traced.jaxpr) + (str([x.sharding.spec for x in leaves]) + str(m) if m > 1 else "")
    if key not in _COMPILED:
        if len(_COMPILED) >= 64:
            _COMPILED.pop(next(iter(_COMPILED)))
        _COMPILED[key] = float(traced.lower().compile().memory_analysis().temp_size_in_bytes)
    return _COMPILED[key]


_COMPILED: dict[str, float] = {}
"""``compiled_activations``' bytes by the one-device program's jaxpr text (its memory depends on
the program alone: shapes, operations, remat; the one-device compile is the same for every plan but
zero3's barriers in the loop form)."""


def predict_peak(
    loss_fn: Callable,
    per: PerLayer,
    params: Any,
    batch: Any,
    optimizer: Any,
    accumulate: int = 1,
    *,
    state: Any = None,
    key: Any = None,
) -> PeakModel:
    """Per-device peak of the step: arguments + the larger of the backward and the update phases.

    ``loss_fn`` is the step's loss ``(params, state, batch, key) -> (loss, (aux, state))``. The
    terms, and why (P = parameter bytes per device: a leaf split on ``model`` counts 1/model of
    itself, P_top = leaves used outside layers, P_layers = per-layer
    leaves, P_1 = one layer's, N = data-axis size; measured on the issue-14 GPT, data=8, by reading
    XLA's buffer live ranges at the peak, ``--xla_dump_to``):

    - persistent (the arguments): parameters and optimizer state as the plan keeps them, the batch;
    - activations (``compiled_activations``; in a scan less its stacked gradients and loop slices):
      what the backward pass keeps, with its working set; with remat, the layer being recomputed;
    - backward phase, dp/zero1/zero2: the whole local gradients (P) + the activations; a scan's
      loop also keeps one layer's parameter and gradient slices in its buffers (+2 P_1);
    - with ``accumulate`` > 1: the accumulator the micro-batch loop carries, whole under dp and
      zero1 (P: they reduce once, after the loop), a shard under zero2 and zero3 (P / N:
      reduce-scattered per micro-batch), counted beside a micro-batch's gradients where those are
      complete at once (a scan's stacked gradients; zero2's bucket); in the loop form each leaf's
      gradient is added into it as it is made, so it takes the gradients' place;
    - backward phase, zero3: leaves used outside layers gathered for the step: bucket, slices and
      whole gradient (3 P_top); per-layer leaves (gathered leaf by leaf, no bucket) without remat:
      every layer's gathered leaves held for the backward pass (P_layers, both forms); with remat
      one layer at a time: in the loop form nothing on top (its gathered leaves and whole gradient
      share memory with the recomputed values the activation term already holds), in a scan its
      whole gradient (P_1, plus the loop's slice P_1; under ``regather`` 2 P_1 and every layer's
      barrier output shards, P_layers / N, which the policy lets the scan save as a stacked
      residual for the re-gather to read). Gradient shards: all of them (P_layers / N) where the step takes the
      global norm (clipping or the grad_norm metric) or writes them as one stacked
      scan output, or under ``regather`` (its per-leaf reduce-scatters are scheduled at the end of
      the step), or with ``accumulate`` > 1 (the shards are summed into the micro-batch loop's
      accumulator, alive through the loop and updated after it: the loop form under ``layer``
      remat, 4 layers, was 1.12 counting one layer's, 1.02 counting all); otherwise one layer's (P_1 / N): XLA schedules each layer's optimizer update
      right after its reduce-scatter, into the donated parameter and state buffers, and the shard
      dies there (its live range spans ~17 of ~1300 instructions at 4 layers);
    - update phase: the gradients with the optimizer's update tree (2x the gradients; a scanned
      dp step updates in the gradients' buffers); zero1/zero2's bucketed all-gather of the new
      parameters (bucket + slices, 2x the parameters); zero3: 2x the gradient shards, of every
      leaf where they are all alive at once (above), else of the leaves outside layers and one
      layer. Counting every shard (with its update) was the loop form's 0.83-0.88 at 16-32 layers
      under ``layer`` remat, where this phase decided the peak.
    """
    placement = per.placement
    n, stage = placement.data_size, placement.plan.zero
    flat = placement.flat()
    # per device: a leaf split on the model axis by the tensor-parallel rules is 1/model of itself
    # everywhere in the step (gathered, gradient, update), like at rest
    sizes = [nbytes(x) / placement.split(leaf) for x, leaf in zip(jax.tree.leaves(params), flat, strict=True)]
    total = sum(sizes)
    micro = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct((s.shape[0] // (n * accumulate), *s.shape[1:]), s.dtype), batch
    )
    extra = step_extra(state, micro, key)
    loss_fn = pair(loss_fn)
    if per.found is None:  # the step was not traced yet: trace the loss once for its layers
        per.found = analyse(loss_fn, placement, params, extra)
    found = per.found
    layer = set(found.layer_leaves) if found is not None and found.per_layer and per.gathers else set()
    zero3 = stage == "zero3" and n > 1

    def at_rest(i: int, sharded: bool) -> float:
        return sizes[i] / n if sharded and flat[i].data_dim is not None else sizes[i]

    params_b = sum(at_rest(i, zero3) for i in range(len(sizes)))
    opt_b = memory_formula(placement, optimizer, params)["optimizer"]
    batch_b = nbytes(batch) / n
    persistent = params_b + opt_b + batch_b

    layer_b = sum(sizes[i] for i in layer)
    scan = found is not None and found.mode == "scan"
    # one compile per loss, remat and shapes (a Trainer reports the same step repeatedly)
    memo = (per.remat, str(jax.tree.map(lambda a: (a.shape, a.dtype), (params, extra))))
    if memo not in per.measured:
        per.measured[memo] = compiled_activations(loss_fn, per, params, extra)
    activations = per.measured[memo]
    stacked_b = sum(sizes[i] for i in found.layer_leaves) if found is not None and found.per_layer else 0.0
    one_layer = stacked_b / found.layers if stacked_b else 0.0
    if scan:  # the one-device compile's own stacked gradients and loop slices (the plan's are below)
        activations -= stacked_b + 2 * one_layer
        if per.remat == "regather" and zero3:  # its copy of the layer's weights, which zero3 gathers instead
            activations -= one_layer
    # A scan's loop keeps one layer's slice of the stacked parameters and of their gradient in loop
    # buffers besides the stacked arrays (measured: +2 layers; +1 under zero3 with remat, where the
    # body's slice is a shard and only the gathered layer's buffer stays)
    body = (1 if zero3 and per.remat != "none" else 2) * one_layer if scan else 0.0
    # gradient accumulation (m > 1 micro-batches): the scan over micro-batches carries the summed
    # gradients, whole under dp and zero1 (reduced once, after the loop), a shard under zero2 and
    # zero3 (reduce-scattered per micro-batch). It is alive beside a micro-batch's own gradients
    # where those are complete at once before they are added: a scan's stacked gradients (one
    # output of the backward loop), zero2's bucketed reduce-scatter. In the loop form XLA adds
    # each leaf's gradient into the carry as it is made, so the accumulator takes their place
    # (GPT width 128, 4 layers, data=8, accumulate=2, loop form: dp and zero1 0.89 / 0.84 measured /
    # predicted counting it beside them, 1.00 / 1.00 not; scanned 0.99 / 0.99 counting it)
    sharded_acc = placement.plan.shards_gradients and n > 1
    beside = accumulate > 1 and (scan or stage == "zero2")
    accumulator = sum(at_rest(i, sharded_acc) for i in range(len(sizes))) if beside else 0.0
    if zero3:
        lay = found.layers if layer else 1
        per_layer_b = layer_b / lay if layer else 0.0
        # gathered for the step (bucket + slices) with their whole gradients; the per-layer gradient
        # shards: all of them where the step takes their global norm before updating; else XLA
        # updates each layer's shards (into the donated parameters and Adam state) as they arrive,
        # and one layer's shard is alive at a time (a scan writes them all as one stacked array)
        # (regather's per-leaf reduce-scatters are scheduled at the step's end: all shards alive;
        # with micro-batches they are summed into the accumulator, updated after the loop)
        at_once = per.global_norm or scan or per.remat == "regather" or accumulate > 1
        # the leaves outside layers, by how they are gathered: a data-sharded leaf in the dtype's
        # bucket (bucket, slice, whole gradient: 3x), a leaf also split on model by itself (its
        # gathered value and whole gradient: 2x), a leaf kept whole on data (its gradient: 1x)
        top = sum(sizes[i] * (1 if flat[i].data_dim is None else 2 if flat[i].model_sharded else 3)
                  for i in range(len(sizes)) if i not in layer)  # fmt: skip
        backward = top + (layer_b if at_once else per_layer_b) / n + body + accumulator
        # (a layer's leaves are gathered one by one, no bucket: ``_fsdp._gather_vjp``; with the
        # bucket and its slices both alive the terms below were 2 P_layers without remat and one
        # P_1 more with remat; bench_memory, 8 layers, loop form, none 86.1 -> 61.9 MiB measured)
        if per.remat == "none":  # every layer's gathered leaves held, gradients whole until scattered
            # (a scan saves each layer's gathered leaves as stacked residuals)
            backward += layer_b
        elif scan:  # one layer at a time: its whole gradient (its gathered leaves share memory with
            # the recomputed values); under regather its gathered leaves too, and the barrier's
            # output shards, which the re-gather reads and the policy may save, are saved as a
            # stacked residual (a copy: measured slope +P_1/N per layer)
            backward += per_layer_b + (per_layer_b + layer_b / n if per.remat == "regather" else 0.0)
        # (loop form with remat: the layer re-gathered in the backward pass; the one-device compile
        # already holds that layer's recomputed values, which share memory with its gathered leaves.
        # regather's one-device compile, under its policy, holds weight-sized buffers of the layer in
        # its backward pass where the step holds the gathered leaves: measured 4 and 8 layers
        # 0.83 / 0.90 with 2 P_1 on top, 1.01 / 1.01 without)
        shards = sum(at_rest(i, True) for i in range(len(sizes)))
        # the update: gradient shards and the update tree, of every leaf at once, or (updated layer
        # by layer as the shards arrive) of the leaves outside layers and one layer
        update = 2 * (shards if at_once else shards - (layer_b - per_layer_b) / n)
    else:
        backward = total + body + accumulator  # whole local gradients (and the accumulator)
        # the loop form materializes the update tree beside the gradients; in the scanned form XLA
        # updates in the gradients' buffers; zero1/2 gather the new parameters (bucket + slices)
        update = (total if scan else 2 * total) if stage == "dp" else 2 * total
    return PeakModel(
        persistent=persistent, backward=backward + activations, update=update, activations=activations
    )


def peak_report(
    measured: Any,
    loss_fn: Callable,
    per: PerLayer,
    params: Any,
    batch: Any,
    optimizer: Any,
    accumulate: int = 1,
    *,
    state: Any = None,
    key: Any = None,
) -> dict:
    """Measured peak (a MemoryLedger's arguments + temporaries) beside the model, explained past 10%."""
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), batch)
    model = predict_peak(loss_fn, per, params, shapes, optimizer, accumulate, state=state, key=key)
    got = measured.argument_bytes + measured.temp_bytes
    ratio = got / model.total
    found = per.found
    out = {
        "measured_bytes": got,
        "model_bytes": model.total,
        "ratio": ratio,
        "model": model.to_json(),
        "remat": per.remat,
        "layers": found.note if found is not None else None,
        "ok": 0.9 <= ratio <= 1.1,
    }
    if not out["ok"]:
        why = []
        if ratio > 1.1:
            why.append("the compiler keeps more alive at once than the model counts (buffers of several "
                       "layers overlap, or gathered buckets are copied)")  # fmt: skip
        else:
            why.append("the compiler reuses buffers the model counts separately (gradients, activations and "
                       "the update share memory over time)")  # fmt: skip
        if per.gathers and found is not None and not found.per_layer:
            why.append(found.note)
        out["explanation"] = "; ".join(why)
    return out
