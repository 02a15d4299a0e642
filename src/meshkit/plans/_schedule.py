"""Pipeline schedules as data: a static table of stage x tick, built in Python before tracing.

A schedule is a per-device order of actions, ``F`` (forward of one micro-batch through one chunk
of layers) and ``B`` (its backward), run on a clock: at every tick each device does one action or
idles. ``build`` plays the orders against the dependencies (``F`` of virtual stage s needs the
activation ``F`` of s-1 sent at an earlier tick; ``B`` of s needs its own ``F`` and the cotangent
``B`` of s+1 sent at an earlier tick), taking each device's next action as soon as its inputs
have arrived. One tick is one chunk's forward or backward (backward counted as one tick like the
forward: the unit-time model of the GPipe and Megatron papers).

Orders (p devices, m micro-batches, v chunks per device; virtual stage ``s = chunk * p + device``,
chunks of one device round-robin as Megatron's interleaved schedule lays them out):

- ``gpipe``: every forward, then every backward (in micro-batch order);
- ``1f1b``: device d runs ``p - 1 - d`` warm-up forwards, then alternates one forward and one
  backward, then drains the backwards: at most ``p - d`` micro-batches in flight;
- ``interleaved``: Megatron's interleaved 1F1B: micro-batches in groups of p pass through each
  chunk in turn; warm-up ``2 (p - 1 - d) + (v - 1) p`` forwards, then 1F1B.

With backward ticks equal to forward ticks the step takes ``2 (v m + p - 1)`` ticks, of which each
device idles ``2 (p - 1)``: the bubble, idle ticks over all ticks, is ``(p - 1) / (v m + p - 1)``
(GPipe and 1F1B: v = 1). ``tests/test_pipeline.py`` checks the tables reach it exactly.

The table also assigns buffer slots, so the traced program needs no dynamic bookkeeping: a
stage's input activation is kept (for the recomputing backward) from its arrival to its backward,
a cotangent from its arrival to its use; ``x_slots`` and ``g_slots`` are the most either holds at
once on a device (GPipe: m; 1F1B: at most p). Slot ``x_slots`` (resp. ``g_slots``) is a scratch
slot that receives what no one needs (a device's idle tick still takes part in the permute).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshkit.spec import STEADY_SCHEDULES, PlanError, check_schedule

IDLE, FWD, BWD = 0, 1, 2
_LETTER = {IDLE: ".", FWD: "F", BWD: "B"}


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """A static pipeline schedule: what each device does at each tick, and where data goes.

    Arrays are ``(ticks, p)`` int32, indexed ``[tick, device]``.
    """

    name: str
    p: int
    m: int
    v: int
    kind: np.ndarray
    """IDLE, FWD or BWD."""
    chunk: np.ndarray
    """Local chunk of layers (0..v-1); 0 when idle."""
    mb: np.ndarray
    """Micro-batch; 0 when idle."""
    x_read: np.ndarray
    """Slot of the stashed stage input read by F and B (x_slots where the input is the batch)."""
    g_read: np.ndarray
    """Slot of the cotangent read by B (g_slots on the last virtual stage, which starts from the loss)."""
    x_write: np.ndarray
    """Slot the forward activation received at the end of this tick goes to (x_slots: none)."""
    g_write: np.ndarray
    """Slot the cotangent received at the end of this tick goes to (g_slots: none)."""
    x_slots: int
    g_slots: int

    @property
    def ticks(self) -> int:
        return int(self.kind.shape[0])

    @property
    def stages(self) -> int:
        """Virtual stages p * v."""
        return self.p * self.v

    def virtual_stage(self) -> np.ndarray:
        return self.chunk * self.p + np.arange(self.p)[None, :]

    def table(self) -> np.ndarray:
        """``(ticks, p, 3)`` int32: kind, micro-batch, virtual stage; what the step records."""
        s = np.where(self.kind == IDLE, 0, self.virtual_stage())
        mb = np.where(self.kind == IDLE, 0, self.mb)
        return np.stack([self.kind, mb, s], axis=-1).astype(np.int32)

    def __str__(self) -> str:
        return render(self.table(), self.v)


def bubble_model(p: int, m: int, v: int = 1) -> float:
    """Idle ticks over all ticks of the step: ``(p - 1) / (v m + p - 1)``."""
    return (p - 1) / (v * m + p - 1)


def bubble_of(record: np.ndarray) -> float:
    """Idle fraction of an executed record ``(ticks, p, 3)`` (or a ``(ticks, p)`` kind array)."""
    kind = np.asarray(record)
    kind = kind[..., 0] if kind.ndim == 3 else kind
    return float(np.mean(kind == IDLE))


def render(record: np.ndarray, v: int = 1) -> str:
    """One line per device: ``F3`` / ``B3`` (micro-batch 3; ``F3b`` for a device's second chunk...) or ``.``."""
    record = np.asarray(record)
    ticks, p, _ = record.shape
    cells = []
    for d in range(p):
        row = []
        for t in range(ticks):
            kind, mb, s = (int(x) for x in record[t, d])
            tag = "" if v == 1 or kind == IDLE else "abcdefgh"[s // p]
            row.append(f"{_LETTER[kind]}{mb if kind != IDLE else ''}{tag}")
        cells.append(row)
    width = max(len(c) for row in cells for c in row)
    return "\n".join(f"stage {d}: " + " ".join(c.rjust(width) for c in row) for d, row in enumerate(cells))


def check(name: str, p: int, m: int, v: int = 1) -> None:
    """Raise PlanError naming the fix when the schedule cannot run these sizes."""
    check_schedule(name, v)
    if p < 1 or m < 1:
        raise PlanError(f"stages and microbatches must be at least 1 (got {p}, {m})")
    if name in STEADY_SCHEDULES and m < p:
        raise PlanError(
            f"schedule {name} needs microbatches >= stages: {m} < stage={p}; use microbatches={p} or more"
        )
    if name == "interleaved" and m % p:
        raise PlanError(
            f"schedule interleaved runs micro-batches in groups of stage={p}: microbatches={m} does not divide; "
            f"use microbatches={-(-m // p) * p}"
        )


def _orders(name: str, p: int, m: int, v: int) -> list[list[tuple[int, int, int]]]:
    """Per device, the list of (kind, chunk, micro-batch) in the order it runs them."""
    out = []
    for d in range(p):
        if name == "gpipe":
            order = [(FWD, 0, j) for j in range(m)] + [(BWD, 0, j) for j in range(m)]
        else:
            n = v * m
            fwd = [(FWD, (k // p) % v, (k // (p * v)) * p + k % p) for k in range(n)]
            bwd = [(BWD, v - 1 - (k // p) % v, (k // (p * v)) * p + k % p) for k in range(n)]
            warm = min(p - 1 - d if v == 1 else 2 * (p - 1 - d) + (v - 1) * p, n)
            order = fwd[:warm]
            for i in range(n - warm):
                order += [fwd[warm + i], bwd[i]]
            order += bwd[n - warm :]
        out.append(order)
    return out


class _Slots:
    """A free list of buffer slots per device; a slot read at tick t may be written at the end of t."""

    def __init__(self, p: int) -> None:
        self.free: list[list[int]] = [[] for _ in range(p)]
        self.count = [0] * p

    def take(self, d: int) -> int:
        if self.free[d]:
            return self.free[d].pop(0)
        self.count[d] += 1
        return self.count[d] - 1

    def give(self, d: int, slot: int) -> None:
        self.free[d].append(slot)
        self.free[d].sort()


def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule ``name`` for p devices, m micro-batches and v chunks per device (see the module docstring)."""
    check(name, p, m, v)
    S = p * v
    orders = _orders(name, p, m, v)
    pos = [0] * p
    done: dict[tuple[int, int, int], int] = {}  # (kind, virtual stage, mb) -> tick it ran
    rows: list[list[tuple[int, int, int]]] = []
    t = 0
    while any(pos[d] < len(orders[d]) for d in range(p)):
        row = []
        for d in range(p):
            if pos[d] == len(orders[d]):
                row.append((IDLE, 0, 0))
                continue
            kind, c, j = orders[d][pos[d]]
            s = c * p + d
            if kind == FWD:
                deps = [(FWD, s - 1, j)] if s > 0 else []
            else:
                deps = [(FWD, s, j)] + ([(BWD, s + 1, j)] if s < S - 1 else [])
            if all(done.get(x, t) < t for x in deps):
                row.append((kind, c, j))
                pos[d] += 1
            else:
                row.append((IDLE, 0, 0))
        for d, (kind, c, j) in enumerate(row):
            if kind != IDLE:
                done[(kind, c * p + d, j)] = t
        rows.append(row)
        t += 1
        if t > 4 * (v * m + p) + 8:
            raise AssertionError(f"schedule {name} p={p} m={m} v={v} does not make progress")
    ticks = len(rows)
    arr = np.array(rows, np.int32).reshape(ticks, p, 3)
    kind, chunk, mb = arr[..., 0], arr[..., 1], arr[..., 2]
    return _with_slots(name, p, m, v, kind, chunk, mb, done)


def _with_slots(name, p, m, v, kind, chunk, mb, done) -> Schedule:
    """Assign stash and cotangent slots: occupied from the end of the sending tick to the reading tick."""
    S, ticks = p * v, kind.shape[0]
    # (device, virtual stage, mb) -> (write tick, read tick) for stashed inputs and cotangents
    x_live = {
        (s % p, s, j): (done[(FWD, s - 1, j)], done[(BWD, s, j)]) for s in range(1, S) for j in range(m)
    }
    g_live = {
        (s % p, s, j): (done[(BWD, s + 1, j)], done[(BWD, s, j)]) for s in range(S - 1) for j in range(m)
    }

    def assign(live):
        pool, where = _Slots(p), {}
        for t in range(ticks):
            for key, (_, r) in live.items():  # reads of tick t free their slot before its writes
                if r == t and key in where:
                    pool.give(key[0], where[key])
            for key, (w, _) in sorted(live.items()):
                if w == t:
                    where[key] = pool.take(key[0])
        return where, max(pool.count)

    x_where, nx = assign(x_live)
    g_where, ng = assign(g_live)
    full = lambda fill: np.full((ticks, p), fill, np.int32)  # noqa: E731
    x_read, g_read, x_write, g_write = full(nx), full(ng), full(nx), full(ng)
    for (d, s, j), slot in x_where.items():
        w, r = x_live[(d, s, j)]
        x_write[w, d] = slot
        x_read[done[(FWD, s, j)], d] = slot
        x_read[r, d] = slot
    for (d, s, j), slot in g_where.items():
        w, r = g_live[(d, s, j)]
        g_write[w, d] = slot
        g_read[r, d] = slot
    return Schedule(
        name=name,
        p=p,
        m=m,
        v=v,
        kind=kind,
        chunk=chunk,
        mb=mb,
        x_read=x_read,
        g_read=g_read,
        x_write=x_write,
        g_write=g_write,
        x_slots=nx,
        g_slots=ng,
    )


def plot(record: np.ndarray, path: Any, *, title: str = "", v: int = 1) -> Path:
    """The executed schedule as a picture (stage x tick; forward, backward, idle), as in the GPipe and
    Megatron papers; written atomically to ``path`` (PNG). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    record = np.asarray(record)
    ticks, p, _ = record.shape
    colors = {FWD: "#4c72b0", BWD: "#dd8452", IDLE: "#eeeeee"}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * ticks + 1.5), 0.45 * p + 1.6))
    for t in range(ticks):
        for d in range(p):
            kind, mb, s = (int(x) for x in record[t, d])
            ax.add_patch(plt.Rectangle((t, p - 1 - d), 1, 1, facecolor=colors[kind], edgecolor="white"))
            if kind != IDLE:
                label = f"{mb}" + ("" if v == 1 else "abcdefgh"[s // p])
                ax.text(t + 0.5, p - 0.5 - d, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(0, ticks)
    ax.set_ylim(0, p)
    ax.set_yticks([p - 0.5 - d for d in range(p)], [f"stage {d}" for d in range(p)])
    ax.set_xlabel("tick")
    ax.xaxis.get_major_locator().set_params(integer=True)
    idle = bubble_of(record)
    ax.set_title(f"{title}  bubble (idle ticks / ticks) = {idle:.3f}".strip())
    ax.legend(
        handles=[
            Patch(color=colors[k], label=n) for k, n in ((FWD, "forward"), (BWD, "backward"), (IDLE, "idle"))
        ],
        loc="lower center",
        bbox_to_anchor=(0.5, 1.08),
        ncol=3,
        frameon=False,
    )
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path
