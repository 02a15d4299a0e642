"""Finding a loss's layers: one abstract trace of the loss tells whether it marks its blocks with
``meshkit.layer`` (hook) or ``lax.scan``s over stacked parameter leaves (scan), which leaves each
layer uses, and which of them a layer's backward pass reads (all but the biases, which only add).
ZeRO-3's per-layer gathers (``_fsdp``), the remat policies and the models of cost read it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from meshkit.plans._hook import handling
from meshkit.plans.placement import Placement

MARK = "meshkit_layer"


@dataclass(frozen=True, kw_only=True, slots=True)
class Found:
    """How the traced loss is structured into layers."""

    mode: str
    """'hook' (blocks marked with meshkit.layer), 'scan' (lax.scan over stacked leaves) or 'none'."""
    layer_leaves: tuple[int, ...]
    """Flat indices of the parameter leaves gathered per layer."""
    layers: int
    """Number of layer applications per forward pass (hook calls, or scan iterations)."""
    note: str
    groups: tuple[tuple[int, ...], ...] = ()
    """The per-layer leaves of each layer (one group of stacked leaves for a scan)."""
    backward_reads: tuple[int, ...] = ()
    """Per-layer leaves whose value a layer's backward pass reads (all but biases, which only add):
    what the ``regather`` policy gathers again."""

    @property
    def per_layer(self) -> bool:
        return self.mode != "none"


def abstract(a: Any) -> jax.ShapeDtypeStruct:
    """An array's (or tracer's) abstract value, weak type included (a state's Python-int counter
    traced as weakly typed must stay so, or a framework's state check rejects the new value)."""
    if isinstance(a, jax.ShapeDtypeStruct):
        return a
    return jax.ShapeDtypeStruct(
        jnp.shape(a), jnp.result_type(a), weak_type=getattr(jax.typeof(a), "weak_type", False)
    )


def _uses(jaxpr: Any, var: Any) -> list[Any]:
    return [e for e in jaxpr.eqns if any(v is var for v in e.invars)]


def analyse(loss_fn: Callable, placement: Placement, params: Any, micro: Any) -> Found:
    """Trace ``loss_fn(params, micro)`` once (abstractly) to find hooked blocks or scans over stacked
    leaves. ``micro`` is everything else the loss reads (the step passes its state, batch and key)."""
    treedef = jax.tree.structure(params)
    hook = _Hooks()

    def traced(leaves, micro):
        hook.ids.update({id(x): i for i, x in enumerate(leaves)})
        with handling(hook):
            return loss_fn(jax.tree.unflatten(treedef, leaves), micro)

    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(params)]
    jaxpr = jax.make_jaxpr(traced)(avals, micro).jaxpr
    pvars = jaxpr.invars[: len(avals)]
    if hook.hooked:
        return _hooked(jaxpr, pvars, hook)
    found = _scanned(jaxpr, pvars, placement)
    if found is not None:
        return found
    return Found(
        mode="none",
        layer_leaves=(),
        layers=0,
        note="no layer structure found: every parameter is gathered for the whole step; per-layer memory "
        "needs the model to lax.scan over stacked layer parameters or to mark its blocks with meshkit.layer",
    )


class _Hooks:
    """The ``meshkit.layer`` handler while the loss is traced: records each block's parameter leaves
    (by flat index) and runs the block as a named ``jax.jit`` call, so the jaxpr shows its uses."""

    def __init__(self) -> None:
        self.ids: dict[int, int] = {}
        self.hooked: set[int] = set()
        self.calls = 0
        self.groups: list[tuple[int, ...]] = []
        self.order: list[list[int | None]] = []

    def __call__(self, block_fn, block_params, inputs):
        self.calls += 1
        arrays, put_back = arrays_only((block_params, inputs))
        self.order.append([self.ids.get(id(x)) for x in arrays])
        mine = tuple(i for i in self.order[-1] if i is not None)
        self.hooked.update(mine)
        self.groups.append(mine)

        def marked(arrays):
            p, i = put_back(arrays)
            return block_fn(p, *i)

        marked.__name__ = MARK
        return jax.jit(marked)(arrays)


def arrays_only(tree: Any) -> tuple[list, Callable[[list], Any]]:
    """The array leaves of ``tree`` and ``put_back(arrays) -> tree``, which keeps every other leaf
    as the Python value it is. ``jax.jit`` and ``jax.checkpoint`` trace only arrays, as
    ``eqx.filter_jit`` does: an Equinox block carries its activation function and Dropout's
    ``inference`` flag as leaves, which traced raised a TypeError or TracerBoolConversionError."""
    leaves, treedef = jax.tree.flatten(tree)
    where = [k for k, x in enumerate(leaves) if isinstance(x, jax.Array | np.ndarray)]

    def put_back(arrays: list) -> Any:
        out = list(leaves)
        for k, a in zip(where, arrays, strict=True):
            out[k] = a
        return jax.tree.unflatten(treedef, out)

    return [leaves[k] for k in where], put_back


def _hooked(jaxpr: Any, pvars: list, hook: _Hooks) -> Found:
    """Blocks marked with ``meshkit.layer``: their leaves gathered per block unless also used outside one."""
    outside = {i for i, v in enumerate(pvars) if any(o is v for o in jaxpr.outvars)}
    for i in sorted(hook.hooked):
        if any(e.params.get("name") != MARK for e in _uses(jaxpr, pvars[i])):
            outside.add(i)
    kept = tuple(sorted(hook.hooked - outside))
    note = f"{hook.calls} blocks marked with meshkit.layer; {len(kept)} parameter leaves gathered inside them"
    if hook.hooked & outside:
        note += f"; {len(hook.hooked & outside)} also used outside a block, gathered for the whole step"
    groups = tuple(tuple(i for i in g if i in kept) for g in hook.groups)
    reads = set()
    marked = [e for e in jaxpr.eqns if e.params.get("name") == MARK]
    for eqn, idx in zip(marked, hook.order, strict=False):
        inner = eqn.params["jaxpr"].jaxpr
        reads |= {
            i for v, i in zip(inner.invars, idx, strict=False) if i is not None and _value_read(inner, v)
        }
    return Found(
        mode="hook",
        layer_leaves=kept,
        layers=hook.calls,
        note=note,
        groups=groups,
        backward_reads=tuple(sorted(reads & set(kept))),
    )


def _scanned(jaxpr: Any, pvars: list, placement: Placement) -> Found | None:
    """Leaves used only as a ``lax.scan``'s sliced inputs (stacked layers), or None if there are none."""
    flat = placement.flat()
    stacked: set[int] = set()
    lengths = []
    reads = set()
    for i, v in enumerate(pvars):
        uses = _uses(jaxpr, v)
        if (
            not uses
            or flat[i].data_dim == 0
            or not all(e.primitive.name == "scan" and _is_xs(e, v) for e in uses)
        ):
            continue
        stacked.add(i)
        lengths += [e.params["length"] for e in uses]
        for e in uses:
            body, start = e.params["jaxpr"], sum(scan_groups(e))
            body = getattr(body, "jaxpr", body)
            for k, u in enumerate(e.invars[start:]):
                if u is v and _value_read(body, body.invars[start + k]):
                    reads.add(i)
    if not stacked:
        return None
    return Found(
        mode="scan",
        layer_leaves=tuple(sorted(stacked)),
        layers=max(lengths),
        groups=(tuple(sorted(stacked)),),
        backward_reads=tuple(sorted(reads)),
        note=f"lax.scan over {len(stacked)} stacked parameter leaves, {max(lengths)} layers, gathered per layer",
    )


_PASS = {"broadcast_in_dim", "convert_element_type", "reshape", "squeeze", "expand_dims"}


def _value_read(jaxpr: Any, var: Any) -> bool:
    """Whether differentiating ``jaxpr`` reads ``var``'s value: False where it only enters sums
    (through broadcasts, casts, reshapes), as a bias does; True for anything else (conservative)."""
    for eqn in _uses(jaxpr, var):
        if eqn.primitive.name in ("add", "sub", "add_any"):
            continue
        if eqn.primitive.name in _PASS:
            if any(_value_read(jaxpr, o) for o in eqn.outvars):
                return True
            continue
        return True
    return False


def scan_groups(eqn: Any) -> tuple[int, int] | None:
    """(consts, carry) counts of a scan equation, or None where its form is not the plain one
    (the scan's internal parameters changed across JAX versions: ``ft_in`` groups in 0.12)."""
    p = eqn.params
    if "num_consts" in p:
        return p["num_consts"], p["num_carry"]
    groups = getattr(p.get("ft_in"), "elts", None)  # a FlatTree of (consts, carry, xs) groups
    body = p.get("jaxpr")
    if (
        groups is None
        or len(groups) != 3
        or getattr(body, "constvars", ())
        or len(eqn.invars) != sum(map(len, groups))
    ):
        return None
    if len(body.outvars) != len(eqn.outvars):
        return None
    return len(groups[0]), len(groups[1])


def scan_closed(eqn: Any) -> Any:
    """A scan equation's body as a closed jaxpr."""
    body = eqn.params["jaxpr"]
    return body if isinstance(body, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(body, [])


def _is_xs(eqn: Any, var: Any) -> bool:
    groups = scan_groups(eqn)
    if groups is None:
        return False
    start = sum(groups)
    return any(v is var for v in eqn.invars[start:]) and not any(v is var for v in eqn.invars[:start])
