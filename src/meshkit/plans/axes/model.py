"""The model axis (tensor parallelism, plans ``tp``, ``dp+tp``, ``fsdp+tp``, ``tp+cp``...): Megatron's
column- and row-parallel matrices, partitioned by XLA.

Where each leaf is split is the placement's tensor-parallel rules (``tp_rules.DEFAULT_TP_RULES``,
``VOCAB_TP_RULES``); the partitioner writes the collectives. Here: those collectives in the ledger's
model, per micro-batch: every row-parallel matrix (model axis on its rows) all-reduces its output
partial sums in the forward pass (tokens x output width), and every column-parallel matrix (model axis
on its columns) all-reduces the partial sums of its input gradient in the backward pass (tokens x input
width). A GPT layer has wo and w_out row-parallel, wq, wk, wv and w_in column-parallel: 2 forward and 4
backward all-reduces. A column-parallel matrix applied to the batch itself (an MLP's first layer) has no
input gradient to reduce: XLA drops it, and so does the model for the leaves in ``batch_fed`` (read from
the loss's jaxpr, ``_dataflow``). The vocabulary on the model axis, per micro-batch: the embedding lookup
is row-parallel (each device adds the rows it holds: tokens x width forward), the output head
column-parallel (tokens x width backward; a tied head is the embedding's second use, both rows), and the
cross-entropy on the split logits three all-reduces of one number per token (the max, the sum of
exponentials, the target's logit), in the logits' dtype (at least float32). A norm whose scale is
split on the model axis (OLMo 2's q/k norms over every head's width) sums its statistics over it.
"""

from __future__ import annotations

from typing import Any

from meshkit.analysis.cost import ring_traffic
from meshkit.plans._fsdp import tp_matrices
from meshkit.plans._remat import keeps_forward
from meshkit.plans.axes._base import Add, AxisPlan, Flow, LedgerInputs, divisors
from meshkit.plans.placement import LeafPlacement, Placement
from meshkit.spec import ADAPTER_PAIR, ADAPTER_RANK, MODEL


class ModelAxis(AxisPlan):
    axis = MODEL

    def ledger(self, add: Add, inputs: LedgerInputs) -> None:
        placement, m = inputs.placement, inputs.placement.model_size
        if m <= 1:
            return
        tokens, width, accumulate = inputs.tokens, inputs.activation_bytes, inputs.accumulate
        per = inputs.per_layer
        split = per is not None and per.sequence_split > 1
        # under sequence parallelism the layer's partial sums are reduce-scattered onto the sequence split;
        # XLA:CPU writes a reduce-scatter of the partitioner's as an all-reduce and keeps its slice
        reduce = (
            "reduce-scatter" if split and placement.mesh.devices.flat[0].platform != "cpu" else "all-reduce"
        )
        for x, uses, redone in tp_matrices(per, placement, inputs.normed):  # a scan's stacked leaf: per layer
            if ADAPTER_RANK not in x.names:  # an adapter multiplies its partner, not the tokens
                _matrix_rows(add, x, inputs, reduce, uses * (2 if redone else 1), uses)
        if split:
            _sequence_rows(add, inputs)
        _norm_rows(add, inputs)
        _vocab_rows(add, placement, accumulate, tokens, width)
        trainable = None if per is None else per.trainable
        for x, layers in adapter_sums(placement, trainable):
            add(
                "all-reduce",
                MODEL,
                accumulate * layers,
                x.nbytes // layers,
                m,
                f"{x.path}: the adapter's gradient partial sums",
            )

    def flows(self, step: Any) -> list[Flow]:  # the planner's steps are in the compute dtype
        """The all-reduces of a step's tensor-parallel matmuls, exposed whole between the matmuls that
        need them but for ``Job.tp_overlap`` of them (hidden behind the compute, untaxed). Megatron: 2
        forward and 2 backward per layer, the vocabulary-parallel embedding and unembedding, 2 more per
        recomputed layer; meshkit's programs (``Job(runtime="meshkit")``): 4 backward (Q, K and V's
        input gradients reduced apart) and one row-parallel reduce redone per recomputed layer, a
        pipeline's forward tick 2 and backward tick 6 per layer, and the vocabulary on the model axis."""
        s, tp = step, step.layout.tp
        if tp == 1:
            return []
        if s.meshkit and s.layout.pp > 1:  # under layer remat the block recomputed in a backward tick
            # redoes one (8 devices: 0.89 -> 1.00)
            count = (8 + s.recompute) * s.per_stage
        else:
            per_layer = 2 + (4 if s.meshkit else 2) + (1 if s.meshkit else 2) * s.recompute
            # a shared expert: its w_down's output sums, its input's gradient sums
            per_layer += 2 if s.shape.shared_ffn else 0
            ends = 0 if s.meshkit else 2 if s.layout.pp == 1 else 1  # vocab-parallel embedding, unembedding
            count = s.per_stage * per_layer + ends
        act = s.tokens_mb * s.shape.width * s.job.act_bytes  # one micro-batch's activation, whole
        nbytes = count * ring_traffic("all-reduce", act, tp)
        if s.meshkit and s.job.sequence_split(s.layout) > 1:
            # meshkit's sequence parallelism (``plans._sequence``, the ledger's ``_sequence_rows``): per
            # layer 3 all-gathers a row-parallel matrix (2 where the forward's gathered input is kept: no
            # remat, regather), 2 more for the head and the embedding; each reduce priced as the
            # all-reduce XLA:CPU compiles it to (a GPU's reduce-scatter moves half; XLA:TPU's collective
            # matmuls more, in permutes each feeding its matmul: the MaxText 128B on v5e-256 compiles to
            # 604 GiB a chip a step on the model axis, 1.34x this model's, docs/measurements.md)
            gathers = s.per_stage * 2 * (2 if keeps_forward(s.layout.remat) else 3) + 2
            nbytes += gathers * ring_traffic("all-gather", act, tp)
            count += gathers
        if s.meshkit and s.layout.pp == 1 and s.top_split > 1:  # the vocabulary on the model axis: the
            # lookup's forward and the head's backward partial sums, and the cross-entropy's three
            # all-reduces of a number per token (max, sum, target; at least float32: ``_expected``)
            count += 2 + 3
            nbytes += 2 * ring_traffic("all-reduce", act, tp)
            nbytes += 3 * ring_traffic("all-reduce", s.tokens_mb * max(s.job.act_bytes, 4), tp)
        m = s.m
        return [Flow(axis=MODEL, op="all-reduce", nbytes=m * nbytes, count=m * count, stride=1, size=tp,
                     window=m * s.t_mb, edge=1 - s.job.tp_overlap, taxed=False)]  # fmt: skip

    def search_degrees(self, shape: Any, cluster: Any, job: Any, devices: int) -> list[int]:
        """tp dividing the heads, inside a host (on a TPU slice, whose ICI joins hosts at the bandwidth it
        joins chips, anywhere)."""
        hw = cluster.hardware
        one_fabric = hw.inter_host_bytes_per_s >= hw.intra_host_bytes_per_s
        return [
            t
            for t in divisors(devices)
            if (one_fabric or t <= cluster.devices_per_host) and not shape.heads % t
        ]

    def check_layout(self, shape: Any, layout: Any, job: Any) -> str | None:
        tp = layout.tp
        if shape.heads % tp:
            return f"tp={tp} does not divide heads={shape.heads}"
        if shape.kv_heads % tp and tp % shape.kv_heads:
            return f"tp={tp} neither divides nor is a multiple of kv_heads={shape.kv_heads}"
        return None


def _sequence_rows(add: Add, inputs: LedgerInputs) -> None:
    """Sequence parallelism's all-gathers and sums (``plans._sequence``), per micro-batch: for each
    row-parallel matrix of a layer, the sequence gathered before the column-parallel matmuls that feed
    it, the row-parallel output's gradient gathered in the backward pass, and the first gathered again
    there for the weights' gradients (without remat, or under ``regather``, the forward's is kept: two); the last
    layer's output gathered whole for the head, and its gradient for the embedding's backward; and the
    gradient of each layer leaf whole on the model axis (norms, row-parallel biases), a partial sum
    over its sequence split, all-reduced once per layer."""
    per, placement = inputs.per_layer, inputs.placement
    m, tokens, act, accumulate = (
        placement.model_size,
        inputs.tokens,
        inputs.activation_bytes,
        inputs.accumulate,
    )
    kept = keeps_forward(per.remat)
    flat = placement.flat()
    layer = {flat[i].path for i in per.found.layer_leaves} if per.found is not None else set()
    rows = [(x, uses) for x, uses, _ in tp_matrices(per, placement)
            if x.path in layer and ADAPTER_RANK not in x.names and x.model_spec[0] == MODEL]  # fmt: skip
    for x, uses in rows:
        size = tokens * x.shape[1] * act
        add("all-gather", MODEL, accumulate * uses * (2 if kept else 3), size, m,
            f"{x.path}: the sequence gathered for its layer's matmuls and gradients")  # fmt: skip
    if rows:
        add("all-gather", MODEL, 2 * accumulate, tokens * rows[0][0].shape[1] * act, m,
            "the last layer's output whole for the head, its gradient for the embedding")  # fmt: skip
    scan = per.found is not None and per.found.mode == "scan"
    trained = per.trainable.mask if per.trainable is not None else [True] * len(flat)
    for i in per.found.layer_leaves if per.found is not None else ():
        x = flat[i]
        if x.model_sharded or not trained[i] or ADAPTER_RANK in x.names:
            continue
        layers = x.shape[0] if scan else 1
        add("all-reduce", MODEL, accumulate * layers, x.nbytes / layers, m,
            f"{x.path}: its gradient's partial sums over the sequence split")  # fmt: skip


def _norm_rows(add: Add, inputs: LedgerInputs) -> None:
    """A norm whose scale the model axis splits (OLMo 2's q/k norms over every head's width) takes its
    statistics over a split width: per micro-batch and layer, an all-reduce of one number per token in the
    forward pass (again where remat redoes the layer) and one in the backward (the gradient's sum over the
    width), in at least float32."""
    per, placement = inputs.per_layer, inputs.placement
    passes = 2 if per is None or keeps_forward(per.remat) else 3
    for x in placement.flat():
        if x.path in inputs.norm_scales and x.model_sharded:
            layers = x.shape[0] if "layers" in x.names else 1
            add("all-reduce", MODEL, inputs.accumulate * layers * passes, inputs.tokens * max(inputs.activation_bytes, 4),
                placement.model_size, f"{x.path}: its norm's statistics over the split width")  # fmt: skip


def adapter_sums(placement: Placement, trainable: Any) -> list[tuple[LeafPlacement, int]]:
    """``(leaf, layers it stacks)`` of each trainable low-rank adapter whole on the model axis whose
    partner is split on it (LoRA's ``A`` of a column-parallel weight, ``B`` of a row-parallel one): its
    gradient is a partial sum per device, all-reduced over ``model`` in the backward pass, once per
    layer it stacks and micro-batch."""
    if trainable is None:
        return []
    flat = placement.flat()
    by_path = {x.path: x for x in flat}
    a, b = ADAPTER_PAIR
    out = []
    for x, train in zip(flat, trainable.mask, strict=True):
        if not train or ADAPTER_RANK not in x.names or x.model_sharded:
            continue
        stem, mine = (x.path[: -len(a)], a) if x.path.endswith(a) else (x.path[: -len(b)], b)
        partner = by_path.get(stem + (b if mine == a else a))
        if partner is not None and partner.model_sharded:
            out.append((x, x.shape[0] if "layers" in x.names else 1))
    return out


def _split_names(leaf: LeafPlacement) -> tuple:
    """The leaf's logical names of the dims split on the model axis."""
    names = (*leaf.names, *(None,) * (len(leaf.shape) - len(leaf.names)))
    return tuple(n for n, a in zip(names, leaf.model_spec, strict=True) if a == MODEL)


def _vocab_rows(add: Add, placement: Placement, accumulate: int, tokens: int, activation_bytes: int) -> None:
    """A tied head's backward all-reduce and the cross-entropy's all-reduces over split logits (the
    lookup's and an untied head's rows are the row- and column-parallel rows of ``tp_matrices``)."""
    vocab = [x for x in placement.flat() if "vocab" in _split_names(x) and len(x.shape) == 2]
    heads = [x for x in vocab if x.names[-1:] == ("vocab",)]
    tied = [x for x in vocab if x.names[:1] == ("vocab",)] if not heads else []
    m = placement.model_size
    for x in tied:
        add(
            "all-reduce",
            MODEL,
            accumulate,
            tokens * x.shape[1] * activation_bytes,
            m,
            f"{x.path} (tied head): backward input-gradient partial sums",
        )
    if heads or tied:
        logit = tokens * max(activation_bytes, 4)
        add(
            "all-reduce", MODEL, 3 * accumulate, logit, m, "cross-entropy over split logits: max, sum, target"
        )


PLAN = ModelAxis()


def _matrix_rows(add: Add, x: Any, inputs: LedgerInputs, reduce: str, forward: int, backward: int) -> None:
    """One split matrix's rows, ``forward`` forward passes (2 where remat redoes it) and ``backward``
    backward ones. Row-parallel (model axis on its rows): the output's partial sums in the forward pass;
    column-parallel: the input gradient's in the backward pass (none for a matrix fed the batch itself).
    A matrix multiplied in int8 (``models.quantize``) sums int32 partials, and all-reduces the scales it
    takes over the dimension the model axis splits: row-parallel, in the forward pass, the input's per
    token and the matrix's per output column; column-parallel, in the backward pass, the output
    gradient's per token and the matrix's per input row (requantized along the backward's contraction)."""
    m, tokens, accumulate = inputs.placement.model_size, inputs.tokens, inputs.accumulate
    int8, width = x.path in inputs.quantized, inputs.activation_bytes
    if x.model_spec[0] == MODEL:
        count, free, what = forward, x.shape[1], "forward output partial sums"
    elif x.model_spec[1] == MODEL and x.path not in inputs.batch_fed:
        count, free, what = backward, x.shape[0], "backward input-gradient partial sums"
    else:
        return
    add(reduce, MODEL, accumulate * count, tokens * free * (4 if int8 else width), m, f"{x.path}: {what}")
    if int8:
        add("all-reduce", MODEL, accumulate * count, (tokens + free) * width, m, f"{x.path}: int8 scales")
