"""Which tensor-parallel matmuls need no input gradient: read from the loss's jaxpr.

A column-parallel matrix (split on its output dim) all-reduces the partial sums of its input's
gradient in the backward pass, unless nothing upstream needs that gradient: when the matmul's
other operand depends on no parameter (the batch itself, as in an MLP's first layer), XLA drops
the all-reduce. The plan's cost model asks this module which leaves those are, so model and
ledger agree. The walk follows the loss's jaxpr, into nested calls (``jit``, custom derivatives,
remat), tracking which values depend on parameters and which are a parameter leaf up to
dtype/shape-only operations (and the division and rounding that quantize it: ``quantized`` names the
leaves multiplied in int8). ``norms`` names the leaves that scale a normalised value (an RMSNorm's or a
LayerNorm's, a product with a reciprocal square root): where the model axis splits such a leaf, it splits
the width the norm's statistics are taken over; and the matrices whose products a norm reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from meshkit.plans._leaf_paths import path_str

_SAME_VALUE = {
    "convert_element_type",
    "reshape",
    "transpose",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "copy",
    "copy_p",
    "reduce_precision",
    "sharding_constraint",
    # a matmul's operand quantized to int8 (``models.quantize``: ``round(w / scale)``) is its leaf
    "div",
    "round",
}
_SUB = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _inner(eqn) -> Any:
    for name in _SUB:
        sub = eqn.params.get(name)
        if sub is not None:
            return getattr(sub, "jaxpr", sub)
    return None


def _var(v) -> Any:
    """A jaxpr variable, or None for a literal (literals are unhashable and depend on nothing)."""
    return None if isinstance(v, jcore.Literal) else v


def _walk(
    jaxpr,
    origin: dict,
    tainted: set,
    found: set,
    rows: dict | None = None,
    weights: set | None = None,
    int8: set | None = None,
    norms: _Norms | None = None,
) -> None:
    """``weights`` (where frozen leaves are given): the values computed from parameters alone; a sum of
    such values keeps the origin of its parameter operand (LoRA's ``W + s A @ B`` is ``W`` to the ledger).
    ``int8``: collects the leaves some matmul multiplies as int8 (``quantized``); ``norms``: the norms'
    scales and the matrices whose products a norm reads (``norms``)."""
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
        dirty = any(v in tainted for v in ins)
        sub = _inner(eqn)
        if sub is not None and len(sub.invars) == len(eqn.invars):
            pairs = [(iv, _var(ov)) for iv, ov in zip(sub.invars, eqn.invars, strict=True)]
            inner_origin = {iv: origin[ov] for iv, ov in pairs if ov in origin}
            inner_taint = {iv for iv, ov in pairs if ov in tainted}
            inner_weights = None if weights is None else {iv for iv, ov in pairs if ov in weights}
            inner_norms = None if norms is None else norms.inner(pairs)
            _walk(sub, inner_origin, inner_taint, found, rows, inner_weights, int8, inner_norms)
            for ov, iv in zip(eqn.outvars, map(_var, sub.outvars), strict=True):
                if norms is not None:
                    norms.out(ov, iv, inner_norms)
                if iv in inner_taint:
                    tainted.add(ov)
                if iv in inner_origin:
                    origin[ov] = inner_origin[iv]
                if weights is not None and iv in inner_weights:
                    weights.add(ov)
            continue
        if eqn.primitive.name == "dot_general" and len(ins) == 2:
            a, b = ins
            (contract, batch) = eqn.params["dimension_numbers"]
            if int8 is not None and np.int8 in (a.aval.dtype, b.aval.dtype):
                int8.update(origin[v] for v in (a, b) if v in origin)
            for side, (w, x) in enumerate(((a, b), (b, a))):
                if w in origin and x not in tainted:
                    found.add(origin[w])
                if w in origin and rows is not None:  # the other operand's free dims: the rows it multiplies
                    skip = {*contract[1 - side], *batch[1 - side]}
                    n = int(np.prod([d for i, d in enumerate(x.aval.shape) if i not in skip]))
                    rows[origin[w]] = max(rows.get(origin[w], 0), n)
        if eqn.primitive.name in _SAME_VALUE and ins and ins[0] in origin:
            origin[eqn.outvars[0]] = origin[ins[0]]
        if norms is not None:
            norms.see(eqn, ins, origin)
        if weights is not None and ins and all(v in weights for v in ins):
            weights.update(eqn.outvars)
            held = [v for v in ins if v in origin]
            if eqn.primitive.name == "add" and len(held) == 1:
                origin[eqn.outvars[0]] = origin[held[0]]
        if dirty:
            tainted.update(eqn.outvars)


@dataclass
class _Norms:
    """What the walk learns of the norms: ``scales``, the leaves multiplied with a normalised value (a
    reciprocal square root's output, or a product with it or a dtype/shape change of it); ``normed``, the
    matrices whose product (through dtype/shape changes) a norm squares for its statistics (OLMo 2's
    ``wo`` and ``w_down``, whose outputs are normalised before the residual sum)."""

    scales: set = field(default_factory=set)
    normed: set = field(default_factory=set)
    values: set = field(default_factory=set)
    products: dict = field(default_factory=dict)

    def see(self, eqn, ins: list, origin: dict) -> None:
        name, outs = eqn.primitive.name, eqn.outvars
        if name == "rsqrt" or (name in _SAME_VALUE | {"mul"} and any(v in self.values for v in ins)):
            self.values.update(outs)
        if name == "mul" and len(ins) == 2 and any(v in self.values for v in ins):
            self.scales.update(origin[v] for v in ins if v in origin)
        if name == "dot_general":
            held = [origin[v] for v in ins if v in origin]
            if held:
                self.products[outs[0]] = held[0]
        elif name in _SAME_VALUE and ins and ins[0] in self.products:
            self.products[outs[0]] = self.products[ins[0]]
        elif name == "square" and ins[0] in self.products:
            self.normed.add(self.products[ins[0]])

    def inner(self, pairs: list) -> _Norms:
        """The same, seen from inside a nested jaxpr (``pairs``: its inputs and the outer values they are)."""
        return _Norms(
            self.scales,
            self.normed,
            {iv for iv, ov in pairs if ov in self.values},
            {iv: self.products[ov] for iv, ov in pairs if ov in self.products},
        )

    def out(self, outer, inner_var, seen: _Norms) -> None:
        """What a nested jaxpr's output ``inner_var`` was, for the outer value ``outer``."""
        if inner_var in seen.values:
            self.values.add(outer)
        if inner_var in seen.products:
            self.products[outer] = seen.products[inner_var]


@dataclass(frozen=True)
class Dataflow:
    """What the ledger reads of a loss's jaxpr (``dataflow``), as paths (``a/b/c``) of parameter leaves."""

    batch_fed: frozenset[str]
    """Leaves some matmul multiplies with a value that depends on no parameter (with ``trainable``: on no
    trainable one; a frozen leaf's gradient is not asked for, like the batch's): XLA drops a
    column-parallel matrix's input-gradient all-reduce there."""
    quantized: frozenset[str]
    """Leaves some matmul multiplies in int8 (``meshkit.models.quantize``: the leaf divided by its scale,
    rounded and cast is still the leaf; where frozen leaves are given, LoRA's ``W + s A @ B`` is ``W``): the
    model axis adds their int32 partial sums and their scales' all-reduces."""
    norm_scales: frozenset[str]
    """Leaves that scale a normalised value (``_Norms``): where the model axis splits one (OLMo 2's q/k
    norms over every head's width), the compiler sums the norm's statistics over it, forward and backward."""
    normed: frozenset[str]
    """Matrices whose product a norm reads: a row-parallel one is recomputed under layer remat even when
    it is the layer's last."""
    rows: dict[str, int]
    """Per leaf the most rows a matmul multiplies it with: the other operand's dims neither contracted nor
    batched (a token model's ``examples x sequence`` for each projection)."""


def dataflow(loss_fn: Callable, params: Any, *rest: Any, trainable: Any = None) -> Dataflow:
    """``Dataflow`` of ``loss_fn(params, *rest)`` (arrays or ``jax.ShapeDtypeStruct``s), from one trace;
    ``trainable``: a ``_frozen.Trainable``, or None where every leaf trains."""
    closed = jax.make_jaxpr(loss_fn)(params, *rest)
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    invars = closed.jaxpr.invars[: len(paths)]

    def walk(taint: set, found: set, **kw: Any) -> None:
        _walk(closed.jaxpr, dict(zip(invars, paths, strict=True)), taint, found, **kw)

    fed: set = set()
    weights = None if trainable is None else set(invars)
    if trainable is None:
        walk(set(invars), fed)
    else:
        walk({v for v, m in zip(invars, trainable.mask, strict=True) if m}, fed, weights=set(invars))
    int8: set = set()
    walk(set(invars), set(), weights=weights, int8=int8)
    rows: dict[str, int] = {}
    walk(set(invars), set(), rows=rows)
    seen = _Norms()
    walk(set(invars), set(), norms=seen)
    return Dataflow(frozenset(fed), frozenset(int8), frozenset(seen.scales), frozenset(seen.normed), rows)
