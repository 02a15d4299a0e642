"""Replica groups in every form XLA prints, expanded to device ids, and matched to mesh axes.

Forms read:
- ``{}``: one group of every device;
- ``{{0,1},{2,3}}``: explicit lists;
- ``[2,4]<=[8]`` and ``[4,2]<=[2,4]T(1,0)``: iota lists (reshape, transpose, regroup);
- ``mesh['data'=4,'model'=2] {'model'}``: the mesh-axis form JAX 0.12 emits for shard_map
  collectives, with optional ``, device_ids=(...)`` and sub-axes such as ``'data':(1)2``;
- ``maximal_mesh[device_id=3] {}``: a single device.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from itertools import combinations, pairwise

import numpy as np

from meshkit._errors import HloParseError

MeshShape = tuple[tuple[str, int], ...]
Groups = tuple[tuple[int, ...], ...]

_IOTA = re.compile(r"\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?")
_MESH = re.compile(
    r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*)\))?\s*\{([^}]*)\}",
)
_MAXIMAL = re.compile(r"maximal_mesh\[device_id=(\d+)\]")
_AXIS_REF = re.compile(r"""^['"]?([^'":]+)['"]?(?::\((\d+)\)(\d+))?$""")


@dataclass(frozen=True, slots=True)
class ReplicaGroups:
    """Expanded replica groups of one collective."""

    text: str
    """The groups as printed."""
    groups: Groups
    """Device ids of each group (logical ids of the SPMD program)."""
    mesh: MeshShape | None = None
    """The mesh printed with the groups (mesh-axis form only)."""
    axes: tuple[str, ...] | None = None
    """Mesh axes printed with the groups (mesh-axis form only; sub-axes as 'data:(1)2')."""


def _ints(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"-?\d+", text)]


def _balanced(text: str, start: int) -> str:
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    raise HloParseError("unbalanced braces in replica_groups")


def mesh_groups(
    mesh: MeshShape, axes: list[tuple[str, int | None, int | None]], device_ids: list[int] | None = None
) -> Groups:
    """Groups of devices that vary only along ``axes`` (name, sub-axis pre-size, sub-axis size)."""
    names = [n for n, _ in mesh]
    sizes = [s for _, s in mesh]
    total = math.prod(sizes)
    ids = np.arange(total) if device_ids is None else np.asarray(device_ids)
    if ids.size != total:
        raise HloParseError(f"mesh {mesh} lists {ids.size} device ids, expected {total}")
    # Split each mesh dimension at the boundaries of its sub-axes (major to minor).
    sub_sizes: list[int] = []
    where: dict[tuple[str, int, int], int] = {}
    for name, size in mesh:
        refs = [(p or 1, s or size) for n, p, s in axes if n == name]
        bounds = sorted({1, size} | {p for p, _ in refs} | {p * s for p, s in refs})
        for lo, hi in pairwise(bounds):
            if hi % lo:
                raise HloParseError(f"sub-axes of mesh axis {name!r} do not tile its size {size}")
            where[(name, lo, hi // lo)] = len(sub_sizes)
            sub_sizes.append(hi // lo)
    grouped = []
    for name, pre, size in axes:
        if name not in names:
            raise HloParseError(f"replica group names axis {name!r}, which mesh {names} lacks")
        full = dict(mesh)[name]
        key = (name, pre or 1, size or full)
        if key not in where:
            raise HloParseError(f"sub-axis {name}:({pre}){size} does not fit mesh axis of size {full}")
        grouped.append(where[key])
    # Shardy's sub-axis "(pre)size" has pre = product of the more-major parts of the axis, so the
    # split above (boundaries ascending, major to minor) puts it at index where[...].
    arr = ids.reshape(sub_sizes)
    rest = [d for d in range(arr.ndim) if d not in grouped]
    n = math.prod(arr.shape[d] for d in grouped) if grouped else 1
    flat = arr.transpose(rest + grouped).reshape(-1, n)
    return tuple(tuple(int(v) for v in row) for row in flat)


def groups_text(attrs: str) -> str | None:
    """The exact ``replica_groups=`` value in an instruction's attribute text, or None when absent."""
    pos = attrs.find("replica_groups=")
    if pos < 0:
        return None
    body = attrs[pos + len("replica_groups=") :]
    if body.startswith("{"):
        return _balanced(body, 0)
    for pattern in (_IOTA, _MESH, _MAXIMAL):
        if m := pattern.match(body):
            return m.group(0)
    raise HloParseError(f"cannot read replica_groups={body[:40]!r}: not a form meshkit knows")


def parse_replica_groups(attrs: str, num_devices: int | None) -> ReplicaGroups | None:
    """Read ``replica_groups=...`` from an instruction's attribute text; None when absent."""
    text = groups_text(attrs)
    return None if text is None else expand_groups(text, num_devices)


def expand_groups(text: str, num_devices: int | None) -> ReplicaGroups:
    """Expand replica groups printed in any form (see the module docstring) into device ids."""
    if text.startswith("{"):
        inner = text[1:-1].strip()
        if not inner:
            if num_devices is None:
                raise HloParseError("replica_groups={} means every device, but the device count is unknown")
            return ReplicaGroups(text, (tuple(range(num_devices)),))
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([^{}]*)\}", inner))
        return ReplicaGroups(text, groups)
    if m := _IOTA.fullmatch(text):
        shape, dims = _ints(m.group(1)), _ints(m.group(2))
        perm = _ints(m.group(3)) if m.group(3) else list(range(len(dims)))
        arr = np.arange(math.prod(dims)).reshape(dims).transpose(perm)
        arr = arr.reshape(shape[0], -1) if len(shape) > 1 else arr.reshape(1, -1)
        return ReplicaGroups(text, tuple(tuple(int(v) for v in row) for row in arr))
    if m := _MESH.fullmatch(text):
        return _expand_mesh(text, m)
    m = _MAXIMAL.fullmatch(text)
    return ReplicaGroups(text, ((int(m.group(1)),),))


def _expand_mesh(text: str, m: re.Match) -> ReplicaGroups:
    mesh = []
    for part in m.group(1).split(","):
        name, _, size = part.strip().rpartition("=")
        mesh.append((name.strip().strip("'\""), int(size)))
    refs, labels = [], []
    for ref in (r.strip() for r in m.group(3).split(",")):
        if not ref:
            continue
        r = _AXIS_REF.match(ref)
        if not r:
            raise HloParseError(f"cannot read mesh axis {ref!r} in replica_groups")
        pre, size = (int(r.group(2)), int(r.group(3))) if r.group(2) else (None, None)
        refs.append((r.group(1), pre, size))
        labels.append(r.group(1) if pre is None else f"{r.group(1)}:({pre}){size}")
    ids = _ints(m.group(2)) if m.group(2) else None
    groups = mesh_groups(tuple(mesh), refs, ids)
    return ReplicaGroups(text, groups, mesh=tuple(mesh), axes=tuple(labels))


def _canon(groups: Groups) -> frozenset[frozenset[int]]:
    return frozenset(frozenset(g) for g in groups)


def match_axes(groups: Groups, mesh: MeshShape) -> tuple[str, ...] | None:
    """The mesh axes whose device groups equal ``groups`` (order within a group ignored), or None."""
    target = _canon(groups)
    names = [n for n, _ in mesh]
    for k in range(0, len(names) + 1):
        for combo in combinations(names, k):
            if _canon(mesh_groups(mesh, [(n, None, None) for n in combo])) == target:
                return combo
    return None


def pair_axes(pairs: tuple[tuple[int, int], ...], mesh: MeshShape) -> tuple[str, ...] | None:
    """Mesh axes along which source/target pairs of a collective-permute move data."""
    sizes = [s for _, s in mesh]
    total = math.prod(sizes)
    moved = set()
    for s, t in pairs:
        if not (0 <= s < total and 0 <= t < total):
            return None
        cs, ct = np.unravel_index(s, sizes), np.unravel_index(t, sizes)
        moved |= {i for i in range(len(sizes)) if cs[i] != ct[i]}
    return tuple(mesh[i][0] for i in sorted(moved))
