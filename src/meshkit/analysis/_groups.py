"""Replica groups in every form XLA prints, expanded to device ids, and matched to mesh axes.

Forms read:
- ``{}``: one group of every device;
- ``{{0,1},{2,3}}``: explicit lists;
- ``[2,4]<=[8]`` and ``[4,2]<=[2,4]T(1,0)``: iota lists (reshape, transpose, regroup);
- ``mesh['data'=4,'model'=2] {'model'}``: the mesh-axis form JAX 0.12 emits for shard_map
  collectives, with optional ``, device_ids=(...)`` and sub-axes such as ``'data':(1)2``;
- ``maximal_mesh[device_id=3] {}``: a single device.

Explicit and iota groups hold replica ids, partition ids or flattened device ids depending on the
collective's grouping mode (``channel_id`` and ``use_global_device_ids``); ``device_groups`` maps
them to device ids as XLA's ``GetParticipatingDevicesGroups`` (collective_ops_utils.cc) does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from itertools import combinations, pairwise

from meshkit._errors import HloParseError

MeshShape = tuple[tuple[str, int], ...]
Groups = tuple[tuple[int, ...], ...]

#: The most devices meshkit reads a program for (2^20, beyond any machine built so far): replica
#: groups, meshes and device counts past it are refused in one line instead of expanded (an iota
#: such as ``[100000000,2]<=[200000000]``, a few bytes of text, would take gigabytes).
MAX_DEVICES = 1 << 20


def check_devices(count: int, what: str) -> int:
    """``count``, or :class:`HloParseError` naming ``what`` when it is beyond :data:`MAX_DEVICES`."""
    if count > MAX_DEVICES:
        raise HloParseError(
            f"{what}: {count:,} devices, more than the {MAX_DEVICES:,} meshkit reads (is the text corrupt?)"
        )
    return count


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
    device_ids: bool = False
    """Whether the ids are device ids whatever the grouping mode (mesh-axis and maximal forms)."""


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


def _transposed(values: list[int], shape: list[int], order: list[int]) -> list[int]:
    """``values`` laid out row-major in ``shape``, read back row-major after moving axes into
    ``order`` (numpy's ``reshape(shape).transpose(order).ravel()``, without importing numpy)."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    offsets = [0]
    for d in order:  # the flat index of each element, one axis at a time (major to minor)
        offsets = [o + i * strides[d] for o in offsets for i in range(shape[d])]
    return [values[o] for o in offsets]


def _rows(flat: list[int], size: int) -> Groups:
    return tuple(tuple(flat[i : i + size]) for i in range(0, len(flat), size))


def mesh_groups(
    mesh: MeshShape, axes: list[tuple[str, int | None, int | None]], device_ids: list[int] | None = None
) -> Groups:
    """Groups of devices that vary only along ``axes`` (name, sub-axis pre-size, sub-axis size)."""
    names = [n for n, _ in mesh]
    sizes = [s for _, s in mesh]
    total = check_devices(math.prod(sizes), f"mesh {list(mesh)}")
    ids = list(range(total)) if device_ids is None else list(device_ids)
    if len(ids) != total:
        raise HloParseError(f"mesh {mesh} lists {len(ids)} device ids, expected {total}")
    # Split each mesh dimension at the boundaries of its sub-axes (major to minor).
    sub_sizes: list[int] = []
    where: dict[tuple[str, int, int], int] = {}
    for name, size in mesh:
        if size == 1:  # a size-1 axis: one trivial part, so groups may still name it
            where[(name, 1, 1)] = len(sub_sizes)
            sub_sizes.append(1)
            continue
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
    rest = [d for d in range(len(sub_sizes)) if d not in grouped]
    n = math.prod(sub_sizes[d] for d in grouped) if grouped else 1
    return _rows(_transposed(ids, sub_sizes, rest + grouped), n)


_GROUPS_ATTR = re.compile(r"\breplica_groups\s*=\s*")


def groups_text(attrs: str) -> str | None:
    """The exact ``replica_groups=`` value in an instruction's attribute text, or None when absent."""
    m = _GROUPS_ATTR.search(attrs)
    if m is None:
        return None
    body = attrs[m.end() :]
    if body.startswith("{"):
        return _balanced(body, 0)
    for pattern in (_IOTA, _MESH, _MAXIMAL):
        if m := pattern.match(body):
            return m.group(0)
    raise HloParseError(f"cannot read replica_groups={body[:40]!r}: not a form meshkit knows")


def expand_groups(text: str) -> ReplicaGroups:
    """Expand replica groups printed in any form (see the module docstring) into the ids printed;
    ``replica_groups={}`` gives no groups (every participant: see ``device_groups``)."""
    if text.startswith("{"):
        inner = text[1:-1].strip()
        if not inner:
            return ReplicaGroups(text, ())
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([^{}]*)\}", inner))
        if not groups or re.sub(r"[\d\s,{}]", "", inner):
            raise HloParseError(f"cannot read replica_groups={text[:40]!r}: expected {{{{0,1}},{{2,3}}}}")
        return ReplicaGroups(text, groups)
    if m := _IOTA.fullmatch(text):
        shape, dims = _ints(m.group(1)), _ints(m.group(2))
        perm = _ints(m.group(3)) if m.group(3) else list(range(len(dims)))
        if math.prod(shape) != math.prod(dims) or sorted(perm) != list(range(len(dims))):
            raise HloParseError(f"replica_groups={text}: the iota shapes or transpose do not agree")
        total = check_devices(math.prod(dims), f"replica_groups={text}")
        flat = _transposed(list(range(total)), dims, perm)
        return ReplicaGroups(text, _rows(flat, total // shape[0] if len(shape) > 1 else total))
    if m := _MESH.fullmatch(text):
        return _expand_mesh(text, m)
    m = _MAXIMAL.fullmatch(text)
    return ReplicaGroups(text, ((int(m.group(1)),),), device_ids=True)


def _expand_mesh(text: str, m: re.Match) -> ReplicaGroups:
    mesh = []
    for part in m.group(1).split(","):
        name, _, size = part.strip().rpartition("=")
        if not size.strip().isdigit():
            raise HloParseError(
                f"cannot read mesh axis {part.strip()!r} in replica_groups (expected 'name'=size)"
            )
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
    return ReplicaGroups(text, groups, mesh=tuple(mesh), axes=tuple(labels), device_ids=True)


CROSS_REPLICA = "cross-replica"
CROSS_PARTITION = "cross-partition"
CROSS_REPLICA_AND_PARTITION = "cross-replica-and-partition"
FLATTENED_ID = "flattened-id"
#: Opcodes with a ``use_global_device_ids`` attribute (XLA's all-gather and all-reduce bases).
_GLOBAL_IDS_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-reduce-scatter")
_CHANNEL = re.compile(r"\bchannel_id\s*=")
_GLOBAL_IDS = re.compile(r"\buse_global_device_ids\s*=\s*true")


def group_mode(op: str, attrs: str) -> str:
    """XLA's ``GetCollectiveOpGroupMode``: how a collective's replica group ids are to be read."""
    has_channel = bool(_CHANNEL.search(attrs))
    global_ids = bool(_GLOBAL_IDS.search(attrs)) if op in _GLOBAL_IDS_OPS else None
    if not has_channel:
        if global_ids:
            raise HloParseError("use_global_device_ids=true needs a channel_id (XLA rejects the combination)")
        return CROSS_REPLICA
    if global_ids is None:
        return CROSS_PARTITION
    return FLATTENED_ID if global_ids else CROSS_REPLICA_AND_PARTITION


def device_groups(groups: Groups, mode: str, replicas: int, partitions: int) -> Groups | None:
    """Device groups (device = replica * partitions + partition) of groups printed in ``mode``'s
    ids; ``groups == ()`` is ``replica_groups={}``. None when an id is out of range for the mode."""
    check_devices(replicas * partitions, f"replica_count={replicas} x num_partitions={partitions}")
    if not groups:
        if mode == CROSS_PARTITION:
            groups = (tuple(range(partitions)),)
        elif mode == FLATTENED_ID:
            groups = (tuple(range(replicas * partitions)),)
        else:
            groups = (tuple(range(replicas)),)
    limit = {CROSS_PARTITION: partitions, FLATTENED_ID: replicas * partitions}.get(mode, replicas)
    if any(not 0 <= i < limit for g in groups for i in g):
        return None
    if mode == CROSS_REPLICA:
        return tuple(tuple(r * partitions + p for r in g) for g in groups for p in range(partitions))
    if mode == CROSS_PARTITION:
        return tuple(tuple(r * partitions + p for p in g) for g in groups for r in range(replicas))
    if mode == CROSS_REPLICA_AND_PARTITION:
        return tuple(tuple(r * partitions + p for r in g for p in range(partitions)) for g in groups)
    return groups


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


def _coords(index: int, sizes: list[int]) -> list[int]:
    out = []
    for size in reversed(sizes):
        index, c = divmod(index, size)
        out.append(c)
    return out[::-1]


def pair_axes(pairs: tuple[tuple[int, int], ...], mesh: MeshShape) -> tuple[str, ...] | None:
    """Mesh axes along which source/target pairs of a collective-permute move data."""
    sizes = [s for _, s in mesh]
    total = math.prod(sizes)
    moved = set()
    for s, t in pairs:
        if not (0 <= s < total and 0 <= t < total):
            return None
        cs, ct = _coords(s, sizes), _coords(t, sizes)
        moved |= {i for i in range(len(sizes)) if cs[i] != ct[i]}
    return tuple(mesh[i][0] for i in sorted(moved))
