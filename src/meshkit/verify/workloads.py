"""The built-in models ``meshkit verify`` certifies plans on, with their data: linear, the MLP,
and every model family of the registry (``meshkit.models.registry``: its small config), as
``NAME`` or ``NAME-scan`` (its blocks stacked under ``lax.scan``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from meshkit._errors import MeshkitError
from meshkit.models import linear, mlp, reference_np, registry
from meshkit.verify.compare import _to_float64


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """A model with its data, ready for any plan: what ``Trainer`` takes, and the references."""

    name: str
    loss_fn: Any
    params: Any
    """A parameter pytree, or a ``meshkit.Adapted`` model (its state and logical axes come with it)."""
    batch: Any
    logical_axes: Any = None
    tokens_per_example: int = 1
    units: Any = None
    """Logical axes of whole units (``{"heads": 8}``), checked against the model axis."""
    rules: Any = None
    """Tensor-parallel rules (None: the plan's defaults, ``tp_rules.vocab_rules``)."""
    state: Any = None
    rng: Any = None
    has_aux: bool = False
    float64: Any = None
    """``(params64, x, y) -> (loss, grads)`` in NumPy float64, where the model has one."""
    in_float64: Any = None
    """``() -> Workload``: the model in float64 (called under ``jax.enable_x64``), where casting the
    parameters is not enough (a model that casts to its own dtype); None: cast them."""


#: Megatron pairs for the reference MLP: the first layer column-parallel, the second row-parallel.
MLP_AXES = [
    {"w": ("embed", "mlp"), "b": ("mlp",)},
    {"w": ("mlp", "embed"), "b": ("embed",)},
    {"w": ("embed", None), "b": (None,)},
]


@functools.cache  # one per process: its parameters are made by jitted code, and nothing changes them
def workload(
    name: str, seed: int = 0, *, heads: int = 8, layers: int = 2, stages: bool = False, experts: int = 0
) -> Workload:
    """The reference workloads: 'linear', 'mlp' (the chapter's [16, 64, 64, 8]) and each model family's
    small config (``Family.small``: width 32, ``heads`` heads, ``layers`` blocks) by its name, or as
    ``NAME-scan`` its blocks stacked under lax.scan; with ``stages`` the scanned model as
    ``meshkit.Stages``, the form pipeline plans take."""
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    if name == "linear":
        x = rng.normal(size=(64, 16)).astype(np.float32)
        y = (x @ rng.normal(size=(16, 4)) + 0.1 * rng.normal(size=(64, 4))).astype(np.float32)
        p = linear.init(key, 16, 4)
        return Workload(
            name=name,
            loss_fn=linear.loss,
            params=p,
            batch=(x, y),
            logical_axes=linear.logical_axes(p),
            float64=reference_np.linear_grad,
        )
    if name == "mlp":
        x = rng.normal(size=(64, 16)).astype(np.float32)
        y = np.sin(x @ np.ones((16, 8)) / 4).astype(np.float32)
        p = mlp.init(key, [16, 64, 64, 8])
        return Workload(
            name=name,
            loss_fn=mlp.loss,
            params=p,
            batch=(x, y),
            logical_axes=MLP_AXES,
            float64=reference_np.mlp_grad,
        )
    family = family_workload(name)
    if family is None:
        raise MeshkitError(f"unknown model {name!r}: choose {', '.join(names())}, or give module:function")
    cfg = family.small(layers=layers, heads=heads, experts=experts, scan_layers=stages or name.endswith(SCAN))
    return _family(name, family, cfg, rng, key, stages=stages)


SCAN = "-scan"
"""A family's workload name with this suffix: its scanned form (``gpt-scan``)."""


def names() -> list[str]:
    """Every built-in workload's name."""
    return ["linear", "mlp", *(n for f in registry.names() for n in (f, f + SCAN))]


def family_workload(name: str) -> registry.Family | None:
    """The model family a workload name (``NAME`` or ``NAME-scan``) is of, or None (linear, mlp, ...)."""
    base = name.removesuffix(SCAN)
    return registry.family(base) if base in registry.names() else None


def _family(
    name: str, family: registry.Family, cfg: Any, rng: np.random.Generator, key: jax.Array, *, stages: bool
) -> Workload:
    """A family's model of ``cfg`` on 16 random sequences, in float32 and (``in_float64``) float64 (a
    float64 config: the models cast to their config's dtype); as ``Stages`` (scanned) for pipeline plans."""
    module = family.module
    make_loss = module.stages if stages else functools.partial(module.make_loss, with_aux=bool(cfg.experts))
    tokens = rng.integers(0, cfg.vocab_size, size=(16, cfg.seq_len + 1)).astype(np.int32)
    batch = (tokens[:, :-1], tokens[:, 1:])

    def one(dtype: str, params: Any) -> Workload:
        c = dataclasses.replace(cfg, dtype=dtype)
        return Workload(
            name=name,
            loss_fn=make_loss(c),
            params=params,
            batch=batch,
            logical_axes=module.logical_axes(params),
            tokens_per_example=cfg.seq_len,
            units=family.units(cfg),
            has_aux=bool(cfg.experts),
            in_float64=None if dtype == "float64" else lambda: one("float64", _to_float64(params)),
        )

    return one("float32", module.init(key, cfg))
