"""ZeRO-3/FSDP that gathers a layer's parameters where the layer runs and frees them after.

Why: the peak memory of a step decides whether a model fits. Gathering every parameter at the top
of the loss keeps the whole model (and, through the backward pass, its gradients and the bucket
copies: about 3x the parameters) alive at once, so sharding at rest bought nothing at the peak.

What was tried (issue 14, measured on a GPT of width 256 on data=8, gradients alone):

- gathers at the top of the loss: temporaries 50 MiB at 8 layers, growing with the whole model;
- each block rematerialized with its own gathers inside, in a Python loop: 25.5 MiB, still growing
  (XLA:CPU is free to schedule every layer's gather early, and does);
- the same, with ``lax.optimization_barrier((shards, block inputs))`` before the gathers: 6.6 MiB at
  8 and at 16 layers. The barrier makes the gather depend on the block's input, so it cannot run
  before the previous block has produced it, and the gathered values die inside the block;
- stacked blocks under ``lax.scan`` with the gathers inside the body: 64 MiB without remat (the
  backward pass needs every layer's gathered weights, so the scan saves them all), 7.8-8.8 MiB with
  the body rematerialized (the backward pass gathers each layer again).

So this module does exactly that, in two ways, found by tracing the loss once (``analyse``):

- **hook**: a model marks its blocks with ``meshkit.layer(block_fn)`` (``_hook``). Leaves that
  enter blocks only through the hook are passed to the loss as shards; the hook ties them to the
  block's inputs with an optimization barrier, gathers them (one all-gather per leaf: no bucket,
  whose packing and unpacking copies cost time and memory, ``_gather_vjp``) and applies the remat
  policy around gather + block;
- **scan**: a model that ``lax.scan``s over stacked layer parameters needs no hook. The loss is
  traced to a jaxpr and evaluated again with each such scan replaced by one whose body gathers its
  slice of the stacked shards (barrier tied to the carry) and is rematerialized by the policy.

The gather is a ``custom_vjp`` whose backward is the reduce-scatter (per leaf), so each layer's
gradient is reduce-scattered as soon as that layer's backward is done. Everything else (leaves used
outside blocks: embeddings, the final norm, the unembedding) is gathered once for the step, bucketed
per dtype (``_buckets``). Any other ``loss_fn`` runs unchanged with every parameter gathered up front; the report
says per-layer memory needs the scan form or the hook.

Remat (``meshkit.spec.REMAT_POLICIES``): ``none`` holds the gathered parameters for the backward pass (all-gather traffic
equals the forward's: the model's bytes; peak grows with the whole model); ``layer`` saves only each
block's input and recomputes the block, re-gathering its parameters (all-gather traffic 2x);
``dots`` saves matmul outputs and re-gathers; ``regather`` saves every value but an all-gather's
output, so the backward pass re-gathers the weights but recomputes no activation. The remat policy
applies to every plan (activation checkpointing), the gathers only to zero3.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.extend.core as jcore
from jax import lax

from meshkit.plans import _buckets as buckets
from meshkit.plans import _sequence
from meshkit.plans._hook import handling
from meshkit.plans._layers import Found, analyse, arrays_only, scan_closed, scan_groups
from meshkit.plans._remat import remat_policy
from meshkit.plans.placement import LeafPlacement, Placement
from meshkit.spec import DATA, EXPERT, PlanError


@dataclass(kw_only=True, slots=True)
class PerLayer:
    """A plan's per-layer settings; records what tracing the loss found (read by the reports)."""

    placement: Placement
    remat: str = "none"
    found: Found | None = field(default=None)
    global_norm: bool = False
    """Whether the step takes the gradients' global norm (clipping, or the grad_norm metric): then
    every gradient shard is alive until the norm is known (set by ``build_step``)."""
    measured: dict = field(default_factory=dict)
    """What the peak model compiled for this loss, by input shapes (``meshkit.analysis.peak``)."""
    experts: tuple = ()
    """Expert plans: ``(bytes,)`` of one MoE layer's dispatched rows per device, as traced (``_experts``)."""
    trainable: Any = None
    """The leaves that train (``_frozen.Trainable``), or None: all of them. The loss is differentiated
    with respect to these alone."""
    sequence_split: int = 0
    """Megatron's sequence parallelism (``ParallelSpec.sequence_parallel``): the model axis's size, over
    which each layer's input and output are split on their sequence dim (``_sequence``); 0: off."""
    barriers_only: bool = False
    """Place zero3's per-layer optimization barriers but gather nothing (parameters whole): the
    single-device compile ``meshkit.analysis.peak`` reads the compiler's activation bytes from."""

    @property
    def policy(self) -> Any:
        return remat_policy(self.remat)

    def split(self, tree: Any, *, whole: bool = False) -> Any:
        """A layer's input or output split on the sequence over the model axis (``_sequence.split``)."""
        return _sequence.split(tree, self.sequence_split, self.placement.mesh, whole=whole)

    def pinned(self, block: Callable, pins: list, *args: Any) -> Any:
        """``block(*args)`` with its matmuls against the ``pins`` leaves pinned (``_sequence.call``)."""
        return _sequence.call(block, pins, args, self.sequence_split, self.placement.mesh)

    @property
    def gathers(self) -> bool:
        return (
            self.placement.plan.shards_params
            and self.placement.has_data_axis
            and self.placement.data_size > 1
        )

    def whole_step_leaves(self) -> list[LeafPlacement]:
        """The placement with per-layer leaves marked whole: what the step-wide gather and the caller's
        reduce-scatter move (per-layer leaves are gathered and reduce-scattered inside layers)."""
        layer = self.found.layer_leaves if self.found is not None and self.gathers else ()
        return without(self.placement.flat(), layer)

    @property
    def regathers(self) -> bool:
        """Whether the backward pass gathers a layer's parameters again (remat other than none)."""
        return self.remat != "none"


def _own_output_gather(
    shards: Sequence[jax.Array], leaves: Sequence[LeafPlacement], n: int
) -> list[jax.Array]:
    """One all-gather per leaf, its output the gathered leaf itself (a leaf also split on ``model``
    goes through ``_buckets``, manual over ``model``: the policy then sees that region's output)."""
    return [
        x
        if leaf.data_dim is None
        else buckets.all_gather([x], [leaf], n)[0]
        if leaf.model_sharded
        else lax.all_gather(x, DATA, axis=leaf.data_dim, tiled=True)
        for x, leaf in zip(shards, leaves, strict=True)
    ]


def _per_leaf_gather(shards: Sequence[jax.Array], leaves: Sequence[LeafPlacement], n: int) -> list[jax.Array]:
    """One all-gather per leaf, of its ``(n, chunk)`` rows (``_buckets`` with a bucket of one: the
    sharded dim moved to the front, so the gather runs on the major dim; 2% fewer bytes accessed
    than gathering on the sharded dim in place, bench_plans zero3 layer remat 121.2 vs 123.3 MB)."""
    return [buckets.all_gather([x], [leaf], n)[0] for x, leaf in zip(shards, leaves, strict=True)]


def _per_leaf_scatter(grads: Sequence[jax.Array], leaves: Sequence[LeafPlacement], n: int) -> list[jax.Array]:
    return [buckets.reduce_scatter([g], [leaf], n)[0] for g, leaf in zip(grads, leaves, strict=True)]


def _gather_vjp(leaves: Sequence[LeafPlacement], n: int, *, own_output: bool = False) -> Callable:
    """A layer's all-gather, one per leaf, whose backward is the leaf's reduce-scatter.

    One per leaf, not a bucket per dtype: packing a bucket (concatenate) and unpacking it (slices)
    copies every gathered byte and every gradient once more. Measured on the bench_plans GPT
    (2 layers, width 128, data=8, zero3 with layer remat, loop form): 131.7 MB accessed per step
    bucketed against 123.3 per leaf (the hand-written step: 122.8), wall time 1.13-1.17x the
    hand-written step bucketed, 0.85-0.98x per leaf, at the same CPU time; XLA:CPU's 8 device
    threads gain nothing from fewer, larger collectives here. Peak memory drops with it (the bucket
    and its slices were both alive: bench_memory, 8 layers, loop form, no remat 86.1 -> 61.9 MiB).

    The backward pass alone bucketed (gathers per leaf, one reduce-scatter of the layer's
    concatenated gradient rows) is another trade, measured and not taken: XLA:CPU combines no
    reduce-scatters, and 31 of them per step cost 1.15-1.25x the jit step's time on bench_plans'
    zero3 modes, 1.03-1.09x bucketed; but the concatenation copies the layer's whole gradients at
    the end of its backward pass, +0.4-0.6 of a layer's parameters at the peak under layer and dots
    remat (GPT width 256, 8 layers, layer: 14.5 -> 16.2 MiB). XLA's GPU and TPU compilers combine
    per-leaf reduce-scatters into one variadic collective without a copy, so the bucket would spend
    memory where the compiler already saves the time (``bench_plans.py --bucket`` shows the time).
    Under ``regather`` (``own_output``) the gathered value must be the all-gather's own output (of a
    bucket, or of rows reshaped, the policy would save the slices or the reshape)."""
    leaves = list(leaves)
    gather_fn = _own_output_gather if own_output else _per_leaf_gather

    @jax.custom_vjp
    def gather(shards):
        return gather_fn(shards, leaves, n)

    def fwd(shards):
        return gather_fn(shards, leaves, n), None

    def bwd(_, cotangents):
        return (_per_leaf_scatter(list(cotangents), leaves, n),)

    gather.defvjp(fwd, bwd)
    return lambda shards: gather(list(shards))


def _weight(flat: Sequence[LeafPlacement], i: int | None, *, stacked: bool = False) -> tuple | None:
    """The model-axis split a layer's matmuls are pinned by for leaf ``i`` (a scan's slice of it where
    ``stacked``), or None."""
    if i is None:
        return None
    leaf = _unstacked(flat[i]) if stacked else flat[i]
    return _sequence.weight_spec(leaf.model_spec)


def _unstacked(leaf: LeafPlacement) -> LeafPlacement:
    """A stacked leaf's placement as one layer's slice sees it (leading layer axis dropped)."""
    return dataclasses.replace(
        leaf,
        shape=leaf.shape[1:],
        model_spec=leaf.model_spec[1:],
        data_dim=None if leaf.data_dim is None else leaf.data_dim - 1,
    )


def without(layout_leaves: Sequence[LeafPlacement], drop: Sequence[int]) -> list[LeafPlacement]:
    """The leaves with those indices marked whole (buckets then pass them through untouched)."""
    drop = set(drop)
    return [dataclasses.replace(x, data_dim=None) if i in drop else x for i, x in enumerate(layout_leaves)]


def gather_rows(
    per: PerLayer | None, accumulate: int, nbytes: Callable[[LeafPlacement], float]
) -> list[tuple]:
    """zero3's data-axis all-gathers per step as ``(count, size_bytes_each, what)``.

    Leaves used outside layers: one bucketed gather per step (hoisted out of the micro-batch loop).
    Per-layer leaves: one gather per leaf, layer application and micro-batch, twice with remat (the
    backward pass gathers again)."""
    flat = per.placement.flat() if per is not None else []
    layer = (
        set(per.found.layer_leaves) if per is not None and per.found is not None and per.gathers else set()
    )
    top = sum(nbytes(x) for i, x in enumerate(flat) if x.data_dim is not None and i not in layer)
    rows = [(1, top, "parameters used outside layers (hoisted out of the micro-batch loop)")]
    if layer:
        # one all-gather per leaf and layer application: a hooked block's leaves are its own, a
        # scan's stacked leaves are gathered once per iteration
        times = per.found.layers if per.found.mode == "scan" else 1

        def row(leaves: set[int], what: str) -> None:
            sharded = [i for i in leaves if flat[i].data_dim is not None]
            if sharded:
                total = sum(nbytes(flat[i]) for i in sharded)
                rows.append((accumulate * times * len(sharded), total / (times * len(sharded)), what))

        row(layer, "each layer's parameters, one all-gather per leaf")
        if per.regathers:
            again = layer if per.remat != "regather" else set(per.found.backward_reads)
            row(
                again,
                "again in the backward pass (remat)"
                + (", all but biases" if per.remat == "regather" else ""),
            )
    return rows


def tp_matrices(
    per: PerLayer | None, placement: Placement, normed: frozenset[str] = frozenset()
) -> list[tuple[LeafPlacement, int, bool]]:
    """Tensor-parallel matrices as ``(2-D leaf, uses per forward pass, forward redone in backward)``,
    expert leaves aside (their rows are the MoE's dispatched rows, not the tokens).

    A stacked leaf of a scan is one matrix per layer. Under ``layer`` remat the backward pass redoes a
    layer's forward, and with it the row-parallel output all-reduces, but not the layer's last one
    (its output only feeds the residual sum, which the backward pass does not need): the model counts
    one fewer than the layer's row-parallel matrices again per layer, unless a norm reads that last
    output (``normed``, ``_dataflow.dataflow``: OLMo 2's norm after the MLP), whose backward needs it."""
    found = per.found if per is not None else None
    stacked = set(found.layer_leaves) if found is not None and found.mode == "scan" else set()
    redo: set[int] = set()
    if per is not None and per.remat == "layer" and found is not None:
        for group in found.groups:  # leaf order: a GPT block's attention before its MLP
            rows = [i for i in group if placement.flat()[i].model_spec[-2:][:1] == ("model",)]
            redo.update(rows if rows and placement.flat()[rows[-1]].path in normed else rows[:-1])
    out = []
    for i, x in enumerate(placement.flat()):
        if EXPERT in x.model_spec:  # an expert leaf's matmuls run on its dispatched rows (``_expected``)
            continue
        if i in stacked:  # (L, D) stacked vectors are no matrices
            if len(x.shape) == 3:
                out.append((_unstacked(x), x.shape[0], i in redo))
        elif len(x.shape) == 2:
            out.append((x, 1, i in redo))
    return out


# -- running the loss per layer -------------------------------------------------------------------


def _barrier_gather(gather: Callable, shards: list, tie: Any) -> tuple[list, Any]:
    """Gather ``shards`` after ``tie`` exists (an optimization barrier binds them), so the gather
    cannot be scheduled before the layer's input and its result dies with the layer. Returns the
    gathered leaves and ``tie`` as the barrier passes it on, which the layer then reads: the
    barrier's transpose binds the input's cotangent with the gradient shards in the backward pass,
    so XLA cannot fuse the residual stream's cotangent chain across layers. Reading the untouched
    input instead, XLA fused the LayerNorm backward of every layer into each consumer of that chain
    (fusions of 46 operands, recomputed four times): bench_plans fsdp+tp without remat 143.4 ->
    131.6 MB accessed per step, wall / CPU time 1.16 / 1.12x -> 0.97 / 0.98x the hand-written 2D
    step's; zero3 without remat 102.3 -> 96.3 MB, 1.13 -> 0.98 / 0.96x."""
    leaves, treedef = jax.tree.flatten(tie)
    where = [k for k, x in enumerate(leaves) if isinstance(x, jax.Array)]
    shards, arrays = lax.optimization_barrier((list(shards), [leaves[k] for k in where]))
    for k, x in zip(where, arrays, strict=True):
        leaves[k] = x
    return gather(shards), jax.tree.unflatten(treedef, leaves)


def hooked_loss(loss_fn: Callable, per: PerLayer, treedef: Any) -> Callable:
    """``f(leaves, micro)``: the loss with hooked leaves given as shards (gathered inside each block)."""
    found = per.found
    flat = per.placement.flat()
    n = per.placement.data_size
    layer_set = set(found.layer_leaves) if per.gathers or per.barriers_only else set()
    policy = per.policy

    def f(leaves, micro):
        ids = {id(x): i for i, x in enumerate(leaves)}
        calls = [0]

        def handler(block_fn, block_params, inputs):
            # arrays only: other leaves (an Equinox block's activation function) stay static
            bl, params_back = arrays_only(block_params)
            ins, inputs_back = arrays_only(inputs)
            first, last = calls[0] == 0, calls[0] == found.layers - 1
            calls[0] += 1
            mine = [k for k, x in enumerate(bl) if ids.get(id(x)) in layer_set]
            gather = (
                list
                if per.barriers_only
                else _gather_vjp([flat[ids[id(bl[k])]] for k in mine], n, own_output=per.remat == "regather")
            )

            pins = [_weight(flat, ids.get(id(x))) for x in bl]

            def block(bl, ins):
                return block_fn(params_back(bl), *inputs_back(ins))

            def run(bl, ins):
                bl, ins = list(bl), per.split(ins)
                if mine:
                    gathered, ins = _barrier_gather(gather, [bl[k] for k in mine], ins)
                    for k, x in zip(mine, gathered, strict=True):
                        bl[k] = x
                return per.split(
                    per.pinned(block, pins, bl, ins) if per.sequence_split > 1 else block(bl, ins)
                )

            if policy is not None:
                run = jax.checkpoint(run, policy=policy)
            # as in a scan: the first block's input and the last one's output whole on the model axis
            out = run(bl, per.split(ins, whole=True) if first else ins)
            return per.split(out, whole=True) if last else out

        with handling(handler):
            return loss_fn(jax.tree.unflatten(treedef, leaves), micro)

    return f


def scanned_loss(loss_fn: Callable, per: PerLayer, params: Any, micro: Any) -> Callable:
    """``f(leaves, micro)``: the loss re-evaluated from its jaxpr, every scan over stacked leaves
    replaced by one that gathers its layer's slice inside the (rematerialized) body."""
    flat = per.placement.flat()
    n = per.placement.data_size
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(params)]
    treedef = jax.tree.structure(params)
    closed, out_shape = jax.make_jaxpr(
        lambda leaves, m: loss_fn(jax.tree.unflatten(treedef, leaves), m), return_shape=True
    )(avals, micro)
    out_tree = jax.tree.structure(out_shape)
    jaxpr = closed.jaxpr
    index = {v: i for i, v in enumerate(jaxpr.invars[: len(avals)])}
    layer_set = set(per.found.layer_leaves) if per.gathers or per.barriers_only else set()
    policy = per.policy

    def run_scan(eqn, invals):
        p = eqn.params
        nc, nk = scan_groups(eqn)
        consts, carry, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
        which = [index.get(v) if isinstance(v, jcore.Var) else None for v in eqn.invars[nc + nk :]]
        mine = [k for k, i in enumerate(which) if i in layer_set]
        gather = (
            list
            if per.barriers_only
            else _gather_vjp(
                [_unstacked(flat[which[k]]) for k in mine], n, own_output=per.remat == "regather"
            )
        )
        closed = scan_closed(eqn)
        pins = [None] * (nc + nk) + [_weight(flat, i, stacked=True) for i in which]
        body = (
            _sequence.pinned(closed, pins, per.sequence_split, per.placement.mesh)
            if per.sequence_split > 1
            else jcore.jaxpr_as_fun(closed)
        )

        def layer(carry, x):
            x, carry = list(x), per.split(list(carry))
            if mine:
                # (the barrier's carry is not used: tying it made no difference in a scan, whose
                # body is a fusion boundary already; bench_plans zero3/fsdp+tp scanned 0.96-1.02)
                gathered, _ = _barrier_gather(gather, [x[k] for k in mine], carry)
                for k, g in zip(mine, gathered, strict=True):
                    x[k] = g
            out = body(*consts, *carry, *x)
            return per.split(list(out[:nk])), list(out[nk:])

        if policy is not None:  # in a scan, CSE cannot merge the recomputation into the forward: no barrier
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
        carry = per.split(list(carry), whole=True)  # the embedding's output as without the split
        carry, ys = lax.scan(layer, carry, list(xs), length=p["length"], reverse=p["reverse"])
        return [*per.split(carry, whole=True), *ys]

    def f(leaves, m):
        env: dict[Any, Any] = {}

        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, closed.consts, strict=True):
            env[v] = x
        for v, x in zip(jaxpr.invars, [*leaves, *jax.tree.leaves(m)], strict=True):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            if eqn.primitive.name == "scan" and any(
                index.get(v) in per.found.layer_leaves for v in eqn.invars
            ):
                outs = run_scan(eqn, invals)
            else:
                with eqn.ctx.manager:  # as jax.core.eval_jaxpr binds an equation
                    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
                if not eqn.primitive.multiple_results:
                    outs = [outs]
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
        return jax.tree.unflatten(out_tree, [read(v) for v in jaxpr.outvars])

    return f


def layered_loss(loss_fn: Callable, per: PerLayer, params: Any, micro: Any) -> Callable:
    """``f(leaves, micro)`` for the found structure: per-layer leaves arrive as shards under zero3
    (whole otherwise) and every layer runs under the remat policy."""
    if per.found.mode == "hook":
        return hooked_loss(loss_fn, per, jax.tree.structure(params))
    if per.found.mode == "scan":
        return scanned_loss(loss_fn, per, params, micro)
    treedef = jax.tree.structure(params)
    return lambda leaves, m: loss_fn(jax.tree.unflatten(treedef, leaves), m)


def value_and_grad(loss_fn: Callable, per: PerLayer, params: Any, micro: Any) -> tuple[Any, Any]:
    """``((loss, aux), grads)`` of ``loss_fn(params, micro) -> (loss, aux)`` on one micro-batch, per
    layer where the loss has layers (``micro``: what the loss reads besides the parameters).

    Inside zero3's manual data region ``params`` are the local shards: leaves used outside layers
    are gathered here for the whole step (their gradients come back whole, for the caller's
    reduce-scatter); per-layer leaves stay shards and come back as reduce-scattered gradient shards.
    Elsewhere ``params`` are whole and only the remat policy applies.
    """
    leaves, treedef = jax.tree.flatten(params)
    flat = per.placement.flat()
    # each leaf as gathered over data: its local shape with the data dim whole (an expert leaf keeps
    # its E/N experts: fsdp+ep whole on data, fsdp+tp+ep split on both)
    n = per.placement.data_size
    shapes = [
        tuple(s * n if per.gathers and d == leaf.data_dim else s for d, s in enumerate(x.shape))
        for leaf, x in zip(flat, leaves, strict=True)
    ]
    full = jax.tree.unflatten(
        treedef, [jax.ShapeDtypeStruct(s, x.dtype) for s, x in zip(shapes, leaves, strict=True)]
    )
    micro_avals = micro  # the tracers themselves: make_jaxpr keeps their full types (weak, varying)
    if per.found is None:  # one abstract trace, also read by the reports (layers, stacked leaves)
        per.found = analyse(loss_fn, per.placement, full, micro_avals)
    if (per.remat != "none" or per.sequence_split > 1) and not per.found.per_layer:  # there is no layer
        what = f"remat={per.remat!r} checkpoints" if per.remat != "none" else "sequence_parallel splits"
        raise PlanError(
            f"{what} per layer, but the loss has no layers meshkit can find: mark each block with meshkit.layer, "
            f"lax.scan over stacked layer parameters, or "
            + ("use remat='none'" if per.remat != "none" else "drop --sequence-parallel")
        )
    if per.remat == "none" and not per.gathers and per.sequence_split <= 1:
        f = lambda leaves, m: loss_fn(jax.tree.unflatten(treedef, leaves), m)  # noqa: E731
    else:
        if per.gathers:
            leaves = buckets.all_gather(leaves, per.whole_step_leaves(), per.placement.data_size)
        f = layered_loss(loss_fn, per, full, micro_avals)
    out, grads = trainable_value_and_grad(f, per.trainable, leaves, micro)
    return out, jax.tree.unflatten(treedef, grads)


def trainable_value_and_grad(f: Callable, trainable: Any, leaves: list, micro: Any) -> tuple[Any, list]:
    """``f(leaves, micro)``'s value and its gradients with respect to the trainable leaves (None in a
    frozen leaf's place: it is passed in undifferentiated, so it has no gradient and none of its
    collectives)."""
    if trainable is None:
        return jax.value_and_grad(f, has_aux=True)(leaves, micro)
    idx = trainable.indices

    def of_trainable(train, m):
        full = list(leaves)
        for i, x in zip(idx, train, strict=True):
            full[i] = x
        return f(full, m)

    out, g = jax.value_and_grad(of_trainable, has_aux=True)([leaves[i] for i in idx], micro)
    grads: list = [None] * len(leaves)
    for i, x in zip(idx, g, strict=True):
        grads[i] = x
    return out, grads
