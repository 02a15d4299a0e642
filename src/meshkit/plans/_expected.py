"""What a plan should cost: the collectives per step under the ring model, and per-device memory.

The model is built from the placement alone (leaf sizes and where each leaf lives), never from the
compiled program, so setting it beside the ledger is a real check. Per step, with N devices on
the data axis, M on the model axis, m micro-batches and b = a leaf's bytes on one model shard:

- dp: one all-reduce over data of every gradient (sum of b);
- zero1: one reduce-scatter of the sharded gradients, one all-gather of the updated parameters;
- zero2: a reduce-scatter per micro-batch, one all-gather of the updated parameters;
- zero3: a reduce-scatter of the gradients per micro-batch and one all-gather of the parameters
  (the gather is loop-invariant across micro-batches, and XLA hoists it out of the loop: the full
  parameters then live through the accumulation, which the memory report shows as temporaries);
  where the loss has layers (``_fsdp``), the layers' parameters are instead gathered per layer and
  micro-batch, and once more in the backward pass under remat;
- leaves a ZeRO plan keeps whole: one all-reduce over data (over replica x data under hsdp);
- hsdp (``replica`` x ``data``): zero3's collectives over data, within each group of the replica
  axis, and once per step an all-reduce over replica of the gradient shards (P / N bytes, the
  parameters' dtype: the shards are summed after the micro-batch loop);
- fsdp+cp (``data`` x ``context``): the same, the context axis in the replicas' place (each gradient
  shard all-reduced over context once per step), beside the context plans' attention rows; in
  general each leaf's gradient is all-reduced once per step over the step's manual axes less those
  it is split on (``Placement.sum_axes``: data where ZeRO shards it, expert for an expert leaf);
- each axis's own rows, from its module in ``plans.axes``: the ZeRO stage's over data, tensor
  parallelism's Megatron all-reduces over model (and the vocabulary's), the context attention's
  ppermutes or all-to-alls, the MoE rows' all_to_alls over expert (and the experts' own all-reduces
  over model under tp+ep); each module's docstring says what it counts.

Data-axis reduce-scatters and all-gathers are bucketed (one per dtype), so the counts above are
collectives per dtype; the bytes are the sum over leaves. Scalar collectives (the loss,
gradient-norm partial sums) are left out of the comparison.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import jax
import optax

from meshkit.analysis.communication import CommLedger
from meshkit.analysis.cost import ring_traffic
from meshkit.plans import axes
from meshkit.plans._frozen import optimizer_view
from meshkit.plans._fsdp import PerLayer
from meshkit.plans._state_tree import map_state
from meshkit.plans.axes.data import model_bytes
from meshkit.plans.memory import zero_stage
from meshkit.plans.placement import LeafPlacement, Placement


@dataclass(frozen=True, kw_only=True, slots=True)
class Expected:
    """One kind of collective the plan should run."""

    op: str
    axes: str
    count: int
    size_bytes: float
    """S summed over the executions of one step."""
    traffic_bytes: float
    """Per-device ring traffic per step (all executions)."""
    what: str


def expected_collectives(
    placement: Placement,
    accumulate: int,
    *,
    tokens_per_device: int,
    activation_bytes: int = 4,
    batch_fed: frozenset[str] = frozenset(),
    gather_itemsize: int | None = None,
    per_layer: PerLayer | None = None,
    form: str = "ring",
    segment_bytes: int = 0,
    quantized: frozenset[str] = frozenset(),
    norm_scales: frozenset[str] = frozenset(),
    normed: frozenset[str] = frozenset(),
) -> list[Expected]:
    """The plan's collectives per step (see the module docstring): the gradients' sums over the step's
        axes (``_sum_rows``), then each axis module's rows (``plans.axes``). ``gather_itemsize``: bytes per
        element of zero3's all-gather and reduce-scatter under mixed precision (2 for bf16); ``form``: a
        context plan's attention (``meshkit.spec.CONTEXT_ATTENTION``); ``segment_bytes``: bytes per segment
    id of a batch of packed documents (0: none); ``quantized``: the leaves multiplied in int8
    (``_dataflow.dataflow``); ``norm_scales``, ``normed``: the leaves that scale a normalised value, and the
    matrices whose products a norm reads (``_dataflow.dataflow``)."""
    out: list[Expected] = []

    def add(op, axes, count, size, n_group, what):
        if count and size:
            out.append(
                Expected(
                    op=op,
                    axes=axes,
                    count=count,
                    size_bytes=count * size,
                    traffic_bytes=count * ring_traffic(op, size, n_group),
                    what=what,
                )
            )

    trainable = None if per_layer is None else per_layer.trainable
    _sum_rows(add, placement if trainable is None else trainable.placement(placement))  # frozen: no gradient
    inputs = axes.LedgerInputs(
        placement=placement,
        accumulate=accumulate,
        tokens_per_device=tokens_per_device,
        activation_bytes=activation_bytes,
        batch_fed=batch_fed,
        gather_itemsize=gather_itemsize,
        per_layer=per_layer,
        form=form,
        segment_bytes=segment_bytes,
        quantized=quantized,
        norm_scales=norm_scales,
        normed=normed,
    )
    for axis in axes.active(placement.plan):
        axis.ledger(add, inputs)
    return _merge(out)


def _sum_rows(add: Callable, placement: Placement) -> None:
    """The gradients' all-reduces after the micro-batch loop, once per step: each leaf summed over
    the region's live axes less those it is split on (``Placement.sum_axes``, as the step sums them),
    one row per set of axes. A leaf reduce-scattered on data moves its shard (``1/N``): hsdp's over
    replica, fsdp+cp's over context, fsdp+ep's dense shards over expert; a leaf kept whole moves its
    model shard (all of them under dp); an expert leaf its ``E / N`` experts, over data."""
    n = placement.data_size
    rows: dict[tuple[str, ...], float] = {}
    for x in placement.flat():
        if over := placement.sum_axes(x):
            rows[over] = rows.get(over, 0) + model_bytes(x, placement) / (n if x.data_dim is not None else 1)
    for over, size in rows.items():
        group = math.prod(int(placement.mesh.shape[a]) for a in over)
        add("all-reduce", "+".join(over), 1, size, group, f"gradients, summed over {' x '.join(over)}")


def _merge(items: Iterable[Expected]) -> list[Expected]:
    """One row per (op, axes): counts, bytes and traffic added up."""
    merged: dict[tuple[str, str], Expected] = {}
    for e in items:
        key = (e.op, e.axes)
        if key in merged:
            o = merged[key]
            e = Expected(
                op=e.op,
                axes=e.axes,
                count=o.count + e.count,
                size_bytes=o.size_bytes + e.size_bytes,
                traffic_bytes=o.traffic_bytes + e.traffic_bytes,
                what=f"{o.what}; {e.what}",
            )
        merged[key] = e
    return list(merged.values())


@dataclass(frozen=True, kw_only=True, slots=True)
class CommRow:
    """Measured beside model for one (op, axes)."""

    op: str
    axes: str
    measured_runs: int
    measured_traffic_bytes: float
    model_runs: int
    model_traffic_bytes: float

    @property
    def ratio(self) -> float | None:
        if self.model_traffic_bytes == 0:
            return None
        return self.measured_traffic_bytes / self.model_traffic_bytes

    @property
    def ok(self) -> bool:
        return self.ratio is not None and abs(self.ratio - 1) <= 0.01

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "ok": self.ok}


def compare_communication(ledger: CommLedger, expected: list[Expected]) -> list[CommRow]:
    """Measured traffic per (op, axes) beside the model; scalars (loss, norms) are left out, also where
    the compiler combined them into a tuple collective with the gradients."""
    measured: dict[tuple[str, str], list] = {}
    for r in ledger.records:
        if all(shape == () for shape in r.shapes):
            continue  # scalar metrics
        key = (r.op, r.axes_label)
        runs, traffic = measured.get(key, (0, 0.0))
        measured[key] = (runs + r.executions, traffic + (r.nonscalar_traffic_bytes or 0.0))
    model = {(e.op, e.axes): e for e in expected}
    rows = []
    for key in sorted(set(measured) | set(model)):
        runs, traffic = measured.get(key, (0, 0.0))
        e = model.get(key)
        rows.append(
            CommRow(
                op=key[0],
                axes=key[1],
                measured_runs=runs,
                measured_traffic_bytes=traffic,
                model_runs=e.count if e else 0,
                model_traffic_bytes=e.traffic_bytes if e else 0.0,
            )
        )
    return rows


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryRow:
    component: str
    measured_bytes: float
    formula_bytes: float

    @property
    def ratio(self) -> float | None:
        return None if not self.formula_bytes else self.measured_bytes / self.formula_bytes

    @property
    def ok(self) -> bool:
        """Measured = formula (to 1e-9), nothing = nothing included (a stateless optimizer, SGD)."""
        if not self.formula_bytes:
            return not self.measured_bytes
        return abs(self.ratio - 1) <= 1e-9

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "ok": self.ok}


def _divisor(leaf: LeafPlacement, placement: Placement, sharded_on_data: bool) -> int:
    d = placement.split(leaf)
    if sharded_on_data and leaf.data_dim is not None:
        d *= placement.data_size
    return d


def memory_formula(
    placement: Placement, optimizer: optax.GradientTransformation, params: Any
) -> dict[str, float]:
    """Per-device persistent bytes by the ZeRO rules, leaf by leaf (params and optimizer state)."""
    rule = zero_stage(placement.plan.zero)
    params_b = sum(x.nbytes / _divisor(x, placement, rule.shards("params")) for x in placement.flat())
    optimizer, placement, params = optimizer_view(optimizer, placement, params)  # frozen leaves: no state
    shapes = jax.eval_shape(optimizer.init, params)
    per_leaf = map_state(
        optimizer,
        params,
        shapes,
        placement.leaves,
        lambda s, leaf: s.size * s.dtype.itemsize / _divisor(leaf, placement, rule.shards("optimizer")),
        lambda s: s.size * s.dtype.itemsize,
        is_leaf=lambda x: isinstance(x, LeafPlacement),
    )
    return {"params": params_b, "optimizer": float(sum(jax.tree.leaves(per_leaf)))}


def device_bytes(tree: Any) -> float:
    """Bytes of a pytree of arrays held by the first addressable device."""
    dev = jax.local_devices()[0]
    total = 0
    for a in jax.tree.leaves(tree):
        total += sum(s.data.nbytes for s in a.addressable_shards if s.device == dev)
    return float(total)
