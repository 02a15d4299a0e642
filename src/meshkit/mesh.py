"""Meshes from text such as ``data=4,model=2``, validated against the device count."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Literal

import jax
from jax.sharding import AxisType, Mesh

from meshkit._errors import MeshSpecError

_AXIS = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

MeshSpec = str | Mapping[str, int] | Sequence[tuple[str, int]]


def parse_mesh_spec(spec: MeshSpec) -> tuple[tuple[str, int], ...]:
    """Parse ``"data=4,model=2"`` (or a mapping / pairs) into ``(("data", 4), ("model", 2))``.

    Sizes are positive integers, or ``-1`` for at most one axis ("infer from the device count").
    """
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise MeshSpecError("empty mesh spec: write axes as name=size, e.g. data=4,model=2")
        pairs = []
        for part in text.split(","):
            name, sep, size = part.partition("=")
            name, size = name.strip(), size.strip()
            if not sep or not size:
                raise MeshSpecError(
                    f"bad mesh axis {part.strip()!r} in {spec!r}: write each axis as name=size, e.g. data=4,model=2"
                )
            try:
                value = int(size)
            except ValueError:
                raise MeshSpecError(
                    f"bad size {size!r} for mesh axis {name or '?'!r} in {spec!r}: sizes are whole numbers, or -1 to infer one axis"
                ) from None
            pairs.append((name, value))
    elif isinstance(spec, Mapping):
        pairs = list(spec.items())
    else:
        pairs = [tuple(p) for p in spec]
    text = ",".join(f"{n}={s}" for n, s in pairs)
    seen: set[str] = set()
    for name, size in pairs:
        if not name:
            raise MeshSpecError(
                f"empty axis name in mesh {text!r}: every axis needs a name, e.g. data=4,model=2"
            )
        if not isinstance(name, str) or not _AXIS.match(name):
            raise MeshSpecError(
                f"bad axis name {name!r} in mesh {text!r}: use letters, digits and '_' (not starting with a digit)"
            )
        if name in seen:
            raise MeshSpecError(
                f"axis name {name!r} appears twice in mesh {text!r}: give each axis its own name"
            )
        seen.add(name)
        if not isinstance(size, int) or size == 0 or size < -1:
            raise MeshSpecError(
                f"bad size {size!r} for mesh axis {name!r} in {text!r}: sizes are positive, or -1 to infer one axis"
            )
    if sum(size == -1 for _, size in pairs) > 1:
        raise MeshSpecError(f"more than one axis is -1 in mesh {text!r}: only one axis size can be inferred")
    return tuple(pairs)


def resolve_mesh_shape(spec: MeshSpec, device_count: int) -> tuple[tuple[str, int], ...]:
    """Fill in a ``-1`` axis and check that the sizes multiply to ``device_count``.

    The error names every factor, e.g. ``data=3 x model=2 = 6, but 8 devices are available``.
    """
    pairs = parse_mesh_spec(spec)
    factors = " x ".join(f"{n}={s}" for n, s in pairs)
    known = math.prod(s for _, s in pairs if s != -1)
    if any(s == -1 for _, s in pairs):
        if device_count % known:
            raise MeshSpecError(
                f"cannot infer the -1 axis of mesh {factors}: the other axes multiply to {known}, "
                f"which does not divide the {device_count} devices; pick sizes that divide {device_count}"
            )
        pairs = tuple((n, device_count // known if s == -1 else s) for n, s in pairs)
    total = math.prod(s for _, s in pairs)
    if total != device_count:
        factors = " x ".join(f"{n}={s}" for n, s in pairs)
        raise MeshSpecError(
            f"mesh {factors} = {total} devices, but {device_count} are available; choose sizes whose "
            f"product is {device_count}, or write -1 for one axis to infer it"
        )
    return pairs


AxisTypes = Literal["explicit", "auto"] | AxisType | Sequence[AxisType]


def _axis_types(axis_types: AxisTypes, n: int) -> tuple[AxisType, ...]:
    if isinstance(axis_types, str):
        if axis_types not in ("explicit", "auto"):
            raise MeshSpecError(f"unknown axis_types {axis_types!r}: use 'explicit' or 'auto'")
        return ((AxisType.Explicit if axis_types == "explicit" else AxisType.Auto),) * n
    if isinstance(axis_types, AxisType):
        return (axis_types,) * n
    types = tuple(axis_types)
    if not all(isinstance(t, AxisType) for t in types) or len(types) != n:
        raise MeshSpecError(
            f"axis_types {axis_types!r}: give 'explicit', 'auto', one jax.sharding.AxisType, or one per axis ({n})"
        )
    return types


def make_mesh(
    spec: MeshSpec,
    axis_types: AxisTypes = "explicit",
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Build a ``jax.sharding.Mesh`` from ``"data=4,model=2"`` over all (or the given) devices.

    ``axis_types``: 'explicit' (default), 'auto', a ``jax.sharding.AxisType``, or a tuple of them
    (one per axis, as ``jax.make_mesh`` takes).
    """
    if isinstance(axis_types, str) and axis_types not in ("explicit", "auto"):
        raise MeshSpecError(f"unknown axis_types {axis_types!r}: use 'explicit' or 'auto'")
    devices = list(jax.devices() if devices is None else devices)
    pairs = resolve_mesh_shape(spec, len(devices))
    return jax.make_mesh(
        tuple(s for _, s in pairs),
        tuple(n for n, _ in pairs),
        axis_types=_axis_types(axis_types, len(pairs)),
        devices=devices,
    )


def as_auto(mesh: Mesh) -> Mesh:
    """The same devices and axes with every axis ``Auto`` (the plans' steps partition the model axis
    with XLA and write the data axis out by hand; Explicit axes would have the user's types decide)."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
