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
- context plans: the attention's ppermutes or all-to-alls over context (``_attention_rows``); expert
  plans: the MoE rows' all_to_alls over expert, and under tp+ep the experts' own Megatron
  all-reduces over model (``_expert_rows``);
- tensor parallel, per micro-batch: every row-parallel matrix (model axis on its rows) all-reduces
  its output partial sums in the forward pass (tokens x output width), and every column-parallel
  matrix (model axis on its columns) all-reduces the partial sums of its input gradient in the
  backward pass (tokens x input width). A GPT layer has wo and w_out row-parallel, wq, wk, wv and
  w_in column-parallel: 2 forward and 4 backward all-reduces. A column-parallel matrix applied to
  the batch itself (an MLP's first layer) has no input gradient to reduce: XLA drops it, and so
  does the model for the leaves in ``batch_fed`` (read from the loss's jaxpr, ``_dataflow``);
- the vocabulary on the model axis (``placement.VOCAB_TP_RULES``), per micro-batch: the embedding
  lookup is row-parallel (each device adds the rows it holds: tokens x width forward), the output
  head column-parallel (tokens x width backward; a tied head is the embedding's second use, both
  rows), and the cross-entropy on the split logits three all-reduces of one number per token (the
  max, the sum of exponentials, the target's logit), in the logits' dtype (at least float32).

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
from meshkit.plans._context import exchanged_kv_heads
from meshkit.plans._fsdp import PerLayer, gather_rows, tp_matrices
from meshkit.plans.memory import zero_stage
from meshkit.plans.placement import LeafPlacement, Placement
from meshkit.spec import CONTEXT, DATA, EXPERT, MODEL


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


def _itemsize(leaf: LeafPlacement) -> int:
    size = 1
    for s in leaf.shape:
        size *= s
    return max(leaf.nbytes // max(size, 1), 1)


def _model_bytes(leaf: LeafPlacement, placement: Placement) -> int:
    return leaf.nbytes // placement.split(leaf)


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
) -> list[Expected]:
    """The plan's collectives per step (see the module docstring). ``gather_itemsize``: bytes per
    element of zero3's all-gather and reduce-scatter under mixed precision (2 for bf16); ``form``: a
    context plan's attention (``meshkit.spec.CONTEXT_ATTENTION``)."""
    n, m_axis, stage = placement.data_size, placement.model_size, placement.plan.zero
    out: list[Expected] = []
    context = int(placement.mesh.shape[CONTEXT]) if placement.plan.context else 1

    def add(op, axes, count, size, n_group, what):
        if count and size:
            out.append(
                Expected(op=op, axes=axes, count=count, size_bytes=count * size,
                         traffic_bytes=count * ring_traffic(op, size, n_group), what=what)
            )  # fmt: skip

    leaves = placement.flat()
    _sum_rows(add, placement)
    if n > 1:
        sharded = sum(_model_bytes(x, placement) for x in leaves if x.data_dim is not None)
        if gather_itemsize is not None and zero_stage(stage).shards("params"):
            sharded = sum(
                _model_bytes(x, placement) * gather_itemsize // _itemsize(x)
                for x in leaves
                if x.data_dim is not None
            )

        def gathered(
            x: LeafPlacement,
        ) -> int:  # bytes of one leaf's all-gather (the compute dtype's under zero3)
            return _model_bytes(x, placement) * (gather_itemsize or _itemsize(x)) // _itemsize(x)

        rule = zero_stage(stage)  # dp: no leaf is sharded, its all-reduce is the whole leaves' above
        for row in rule.collectives(sharded, sharded, microbatches=accumulate) if rule.level else ():
            if row.part == "params" and rule.shards("params"):  # zero3: per layer (``_fsdp``)
                for count, size, what in gather_rows(
                    per_layer or PerLayer(placement=placement), accumulate, gathered
                ):
                    add("all-gather", DATA, count, size, n, what)
            else:
                add(row.op, DATA, row.count, row.size_bytes, n, row.what)
    tokens = tokens_per_device // context  # a device's tokens: T/C of each of its rows' sequences
    if m_axis > 1:
        for x, uses, redone in tp_matrices(per_layer, placement):  # a scan's stacked leaf: one per layer
            if (
                x.model_spec[0] == MODEL
            ):  # row-parallel: forward partial sums of the output (again under remat)
                size = tokens * x.shape[1] * activation_bytes
                times = accumulate * uses * (2 if redone else 1)
                add("all-reduce", MODEL, times, size, m_axis, f"{x.path}: forward output partial sums")
            elif (
                x.model_spec[1] == MODEL and x.path not in batch_fed
            ):  # column-parallel: backward partial sums of the input gradient
                size = tokens * x.shape[0] * activation_bytes
                add(
                    "all-reduce",
                    MODEL,
                    accumulate * uses,
                    size,
                    m_axis,
                    f"{x.path}: backward input-gradient partial sums",
                )
        _vocab_rows(add, placement, accumulate, tokens, activation_bytes)
    if context > 1:  # the attention's rows over context
        out += _attention_rows(placement, accumulate, tokens_per_device, activation_bytes, per_layer, form)
    if placement.plan.expert:
        _expert_rows(add, placement, accumulate, per_layer)
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
            rows[over] = rows.get(over, 0) + _model_bytes(x, placement) / (n if x.data_dim is not None else 1)
    for over, size in rows.items():
        group = math.prod(int(placement.mesh.shape[a]) for a in over)
        add("all-reduce", "+".join(over), 1, size, group, f"gradients, summed over {' x '.join(over)}")


def _expert_rows(add: Callable, placement: Placement, accumulate: int, per_layer: PerLayer | None) -> None:
    """Expert plans' own rows (``_experts``), per MoE layer and micro-batch with E devices on the
    expert axis: 2 all_to_alls forward (dispatch, combine) and their 2 transposes backward (the
    forward's again under remat), each ``(E-1)/E x S`` per device with ``S = B_local x experts x
    capacity x width`` elements (the chapter's rearranging collectives). Under tensor parallelism the
    experts' matmuls on their ``S`` rows (each device's E/N experts, N B_local C rows each) add the
    Megatron all-reduces over model: a row-parallel expert matrix its output's partial sums forward,
    a column-parallel one its input gradient's backward, each ``S`` bytes."""
    e, m = placement.expert_size, placement.model_size
    if per_layer is None or not per_layer.experts:
        return
    found = per_layer.found
    layers = found.layers if found is not None and found.per_layer else 1
    rows = per_layer.experts[0]
    if e > 1:
        passes = 4 if per_layer.remat == "none" else 6
        add("all-to-all", EXPERT, passes * layers * accumulate, rows, e,
            "MoE rows to their experts and back (forward and backward)")  # fmt: skip
    if m <= 1:
        return
    for x in placement.flat():
        if EXPERT in x.model_spec and len(x.shape) >= 3 and MODEL in x.model_spec[-2:]:
            row = x.model_spec[-2] == MODEL  # (E, F, D) with F on model: the MLP's output matrix
            uses = x.shape[0] if "layers" in x.names else 1
            add("all-reduce", MODEL, accumulate * uses, rows, m,
                f"{x.path}: expert {'forward output' if row else 'backward input-gradient'} partial sums")  # fmt: skip


def _attention_widths(placement: Placement) -> list[tuple[int, int, int, int, int]]:
    """(layers, query width, key/value width, query split, key/value split) per attention projection
    pair of the reference models (leaves ``.../wq`` and ``.../wk``; a scanned model's stacked leaf
    counts its layers), each width a device's: its heads' where tensor parallelism splits them
    (tp+cp; the split is the model axis's size there, else 1)."""
    leaves = {x.path: x for x in placement.flat()}
    m = placement.model_size

    def split(x: LeafPlacement) -> int:
        return m if x.model_spec[-1] == MODEL else 1

    out = []
    for path, wq in leaves.items():
        if path.endswith("wq") and (wk := leaves.get(path[:-2] + "wk")) is not None:
            layers = wq.shape[0] if "layers" in wq.names else 1
            out.append((layers, wq.shape[-1] // split(wq), wk.shape[-1] // split(wk), split(wq), split(wk)))
    return out


def _exchanged_kv_width(
    placement: Placement, q_width: int, kv_width: int, c: int, splits: tuple[int, int]
) -> int:
    """Key/value width all-to-all attention moves (``_context.exchanged_kv_heads``): their own where the
    placement knows the heads (``units``) and a device's kv heads divide over context, else the query
    width (``splits``: how many devices the query and the kv heads are split over by tensor parallelism)."""
    heads, kv_heads = placement.units.get("heads"), placement.units.get("kv_heads")
    if heads is None or kv_heads is None:
        return q_width
    heads, kv_heads = heads // splits[0], kv_heads // splits[1]
    if kv_width * heads != q_width * kv_heads:
        return q_width
    return kv_width * exchanged_kv_heads(heads, kv_heads, c) // kv_heads


def _attention_rows(placement: Placement, accumulate: int, tokens: int, activation_bytes: int,
                    per_layer: PerLayer | None, form: str) -> list[Expected]:  # fmt: skip
    """The context axis's rows of a context plan's attention (``_context``), per step with C devices
    on the context axis and ``tokens`` per data shard (``T/C`` of each sequence on a device): per layer
    and micro-batch, ring: ``2 (C-1)`` K/V ppermutes forward (again under remat) and as many of their
    gradients backward, each ``tokens/C x kv width``; or all-to-all: 4 forward (q, k, v, out) and 4
    backward, each ``tokens/C x heads x head_dim`` (k and v ``tokens/C x kv width`` where the kv heads
    divide over C, ``_exchanged_kv_width``)."""
    c = int(placement.mesh.shape[CONTEXT])
    out: list[Expected] = []
    if c == 1:
        return out
    local = tokens // c * activation_bytes
    forward = 2 if per_layer is not None and per_layer.remat != "none" else 1
    for layers, q_width, kv_width, *splits in _attention_widths(placement):
        if form == "ring":
            op, count, size = (
                "collective-permute",
                accumulate * layers * 2 * (c - 1) * (forward + 1),
                local * kv_width,
            )
            what = "K/V blocks round the ring (forward) and their gradients back (backward)"
        else:
            op, count = "all-to-all", accumulate * layers * 4 * (forward + 1)
            size = (
                local * (q_width + _exchanged_kv_width(placement, q_width, kv_width, c, tuple(splits))) // 2
            )  # mean of q, k, v, out
            what = "q, k, v to a head split and the output back; the same backward"
        out.append(Expected(op=op, axes=CONTEXT, count=count, size_bytes=count * size,
                            traffic_bytes=count * ring_traffic(op, size, c), what=what))  # fmt: skip
    return out


def _split_names(leaf: LeafPlacement) -> tuple:
    """The leaf's logical names of the dims split on the model axis."""
    names = (*leaf.names, *(None,) * (len(leaf.shape) - len(leaf.names)))
    return tuple(n for n, a in zip(names, leaf.model_spec, strict=True) if a == MODEL)


def _vocab_rows(add, placement: Placement, accumulate: int, tokens: int, activation_bytes: int) -> None:
    """A tied head's backward all-reduce and the cross-entropy's all-reduces over split logits (the
    lookup's and an untied head's rows are the row- and column-parallel rows of ``tp_matrices``)."""
    vocab = [x for x in placement.flat() if "vocab" in _split_names(x) and len(x.shape) == 2]
    heads = [x for x in vocab if x.names[-1:] == ("vocab",)]
    tied = [x for x in vocab if x.names[:1] == ("vocab",)] if not heads else []
    m = placement.model_size
    for x in tied:
        add("all-reduce", MODEL, accumulate, tokens * x.shape[1] * activation_bytes, m,
            f"{x.path} (tied head): backward input-gradient partial sums")  # fmt: skip
    if heads or tied:
        logit = tokens * max(activation_bytes, 4)
        add(
            "all-reduce", MODEL, 3 * accumulate, logit, m, "cross-entropy over split logits: max, sum, target"
        )


def _merge(items: Iterable[Expected]) -> list[Expected]:
    """One row per (op, axes): counts, bytes and traffic added up."""
    merged: dict[tuple[str, str], Expected] = {}
    for e in items:
        key = (e.op, e.axes)
        if key in merged:
            o = merged[key]
            e = Expected(op=e.op, axes=e.axes, count=o.count + e.count,
                         size_bytes=o.size_bytes + e.size_bytes,
                         traffic_bytes=o.traffic_bytes + e.traffic_bytes, what=f"{o.what}; {e.what}")  # fmt: skip
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
            CommRow(op=key[0], axes=key[1], measured_runs=runs, measured_traffic_bytes=traffic,
                    model_runs=e.count if e else 0, model_traffic_bytes=e.traffic_bytes if e else 0.0)
        )  # fmt: skip
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
    shapes = jax.eval_shape(optimizer.init, params)
    per_leaf = optax.tree_map_params(
        optimizer,
        lambda s, leaf: s.size * s.dtype.itemsize / _divisor(leaf, placement, rule.shards("optimizer")),
        shapes,
        placement.leaves,
        transform_non_params=lambda s: s.size * s.dtype.itemsize,
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
