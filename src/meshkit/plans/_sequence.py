"""Megatron's sequence parallelism under a model axis (``ParallelSpec.sequence_parallel``; Korthikanti
et al., 2022, "Reducing Activation Recomputation in Large Transformer Models").

Under tensor parallelism alone each device of a model group holds every layer's input whole: what a
layer keeps for its backward pass (its input under ``layer`` remat, the row-parallel outputs under
``dots``) does not shrink with the model axis. The MaxText 128B of 2023 on one v5e-256 (fsdp 16 x
tensor 16, 16 sequences of 2048 per group, width 10240) keeps 40 GiB of layer inputs a chip that way.
Split on the sequence, each device keeps ``1 / model`` of them; the row-parallel matmuls'
all-reduces become reduce-scatters before the residual sum, and the sequence is gathered again before
the next column-parallel matmul (an all-reduce is a reduce-scatter and an all-gather on a ring: the
same bytes).

Two things make it so, for any loss whose layers meshkit finds (``_layers``):

- ``split``: each layer's input and output (the scan's carry, a hooked block's inputs and outputs)
  constrained to the sequence split, the scan's first input and last output whole (the embedding and
  the head then run as without it);
- ``pinned``: inside the layer, each matmul with a weight split on the model axis has its output
  pinned where Megatron puts it: a column-parallel output split on its weight's split dim (the
  sequence whole), a row-parallel output split on the sequence. Without the pins XLA's partitioner
  chose per matmul between gathering the tokens and gathering the weights: on a 2-layer GPT of width
  256 under dp+tp (model=4) it gathered both, 40 all-gathers a step against Megatron's 14, and 5%
  more memory than without the split; with them the step runs Megatron's collectives.

A constraint never changes a value: the step's losses equal those without the split (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.spec import EXPERT, MODEL

_FREE = P.UNCONSTRAINED
_SAME_DIMS = ("convert_element_type", "copy", "copy_p", "reduce_precision")
"""Operations after which a weight is still that weight with its dims in place, split as it was (its cast
to the compute dtype). ``_dataflow``'s wider set (reshapes, transposes) follows values, not dims."""
_CALLS = ("pjit", "jit", "closed_call", "core_call")


def _mesh(fallback: Any) -> Any:
    mesh = jax.sharding.get_abstract_mesh()
    return fallback if mesh.empty else mesh


def split(tree: Any, ways: int, mesh: Any, *, whole: bool = False) -> Any:
    """``tree`` with each array of rank 3 or more constrained to be split over the model axis on its
    second dim, the sequence of ``(batch, sequence, width)``, where it divides (``whole``: gathered whole
    on the model axis again); the batch dim left as the plan splits it. ``ways`` 0 or 1: as it is."""
    if ways <= 1:
        return tree
    mesh = _mesh(mesh)

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and x.ndim >= 3 and x.shape[1] % ways == 0:
            spec = P(_FREE, None if whole else MODEL, *(None,) * (x.ndim - 2))
            return lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
        return x

    return jax.tree.map(one, tree)


def weight_spec(model_spec: Sequence[Any]) -> tuple | None:
    """The spec a layer's weight slice is pinned by: its model-axis split, or None (whole on the model
    axis; an expert's weight, whose matmuls run on its dispatched rows, not on the sequence)."""
    spec = tuple(model_spec)
    return spec if MODEL in spec and EXPERT not in spec else None


def pinned(closed: Any, specs: Sequence[tuple | None], ways: int, mesh: Any) -> Callable:
    """``f(*args)``: ``closed`` (a layer's jaxpr) evaluated with every matmul against an argument of
    ``specs`` (a weight split on the model axis; None: not one) pinned as the module docstring says.
    Nested calls (``jnp.matmul``'s jit) are evaluated inline; anything else binds as traced."""
    mesh = _mesh(mesh)
    specs = list(specs)
    return lambda *args: _run(
        closed.jaxpr, closed.consts, _pin_weights(list(args), specs, mesh), specs, ways, mesh
    )


def call(block: Callable, pins: Sequence[tuple | None], args: tuple, ways: int, mesh: Any) -> Any:
    """``block(*args)`` traced and evaluated by ``pinned``, ``pins`` the splits of its first arrays (a
    hooked block's parameters)."""
    arrays, tree = jax.tree.flatten(args)
    closed, out = jax.make_jaxpr(lambda *a: block(*jax.tree.unflatten(tree, a)), return_shape=True)(*arrays)
    specs = [*pins, *[None] * (len(arrays) - len(pins))]
    return jax.tree.unflatten(jax.tree.structure(out), pinned(closed, specs, ways, mesh)(*arrays))


def _pin_weights(args: list, specs: Sequence[tuple | None], mesh: Any) -> list:
    """The weights (``specs``) constrained to their model-axis split where the layer reads them: the
    constraint's transpose pins each weight's gradient there too (under dp+tp, left free, XLA's
    partitioner gathered a weight and re-split the attention's gradients with all-to-alls)."""
    return [
        x if s is None else lax.with_sharding_constraint(x, NamedSharding(mesh, P(*s)))
        for x, s in zip(args, specs, strict=True)
    ]


def _run(jaxpr: Any, consts: Sequence[Any], args: list, specs: list, ways: int, mesh: Any) -> list:
    env: dict[Any, Any] = {}
    split_of: dict[Any, tuple] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x, s in zip(jaxpr.invars, args, specs, strict=True):
        env[v] = x
        if s is not None:
            split_of[v] = s
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        inspecs = [split_of.get(v) if isinstance(v, jcore.Var) else None for v in eqn.invars]
        name = eqn.primitive.name
        inner = eqn.params.get("jaxpr")
        if name in _CALLS and isinstance(inner, jcore.ClosedJaxpr) and any(inspecs):
            outs = _run(inner.jaxpr, inner.consts, invals, inspecs, ways, mesh)
        elif name == "dot_general" and inspecs[1] is not None:
            outs = [_pinned_dot(eqn, invals, inspecs[1], ways, mesh)]
        else:
            with eqn.ctx.manager:  # as jax.core.eval_jaxpr binds an equation
                outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
            if name in _SAME_DIMS and inspecs[0] is not None:
                split_of[eqn.outvars[0]] = inspecs[0]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _pinned_dot(eqn: Any, invals: list, spec: tuple, ways: int, mesh: Any) -> Any:
    """``tokens @ weight`` (the weight on the right, split as ``spec``) with its tokens and its product
    pinned where Megatron keeps them: a column-parallel product's tokens whole on the model axis and
    the product split on the dim the weight's split dim becomes; a row-parallel product's tokens split
    as the weight's contracted dim is, the product (partial sums) split on the sequence. A pin on the
    tokens pins their gradient in the backward pass the same way (a constraint's transpose): left
    free, XLA's partitioner gathered the row-parallel weight and re-split the attention's gradients with
    all-to-alls (GPT, tp on model=8: 10 all-to-alls a step)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = invals
    dim = spec.index(MODEL)

    def bind(lhs: Any) -> Any:
        with eqn.ctx.manager:
            return eqn.primitive.bind(lhs, rhs, **eqn.primitive.get_bind_params(eqn.params))

    if dim in rb or lhs.ndim < 3 or len(lb):
        return bind(lhs)
    if dim in rc:  # row-parallel: the reduce-scatter onto the sequence split
        dims = [_FREE] + [None] * (lhs.ndim - 1)
        dims[lc[list(rc).index(dim)]] = MODEL
        return split(bind(_constrain(lhs, dims, mesh)), ways, mesh)
    out = bind(_constrain(lhs, [_FREE] + [None] * (lhs.ndim - 1), mesh))
    rhs_free = [d for d in range(rhs.ndim) if d not in rc]
    dims = [_FREE] + [None] * (out.ndim - 1)
    dims[lhs.ndim - len(lc) + rhs_free.index(dim)] = MODEL
    return _constrain(out, dims, mesh)


def _constrain(x: Any, dims: list, mesh: Any) -> Any:
    return lax.with_sharding_constraint(x, NamedSharding(mesh, P(*dims)))
