"""Targets: the abstract devices of a TPU slice, compiled for from any machine, no TPU needed.

libtpu's compiler (``pip install 'meshkit[tpu]'``) gives the devices of a topology such as ``v5e:16x16``
(``jax.experimental.topologies``); a step lowered over them compiles for that pod, to be measured (memory,
collectives, XLA's cost model), never run. A Cloud TPU slice's name (``v5e-256``, ``v5p-128``) reads as its
topology. Where libtpu is installed on a machine without a TPU, JAX's start would make it look for one and
print to stderr: ``quiet_libtpu`` gives it what it asks for, so that such a process says nothing.

Nothing here imports JAX at import time (the CLI asks ``quiet_libtpu`` before JAX starts).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from meshkit._errors import DeviceSetupError

# -- targets: a TPU pod's devices, compiled for from any machine --------------------------------------------
TPU_GRIDS = {
    2: {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    3: {
        4: "2x2x1",
        8: "2x2x2",
        16: "2x2x4",
        32: "2x4x4",
        64: "4x4x4",
        128: "4x4x8",
        256: "4x8x8",
        512: "8x8x8",
    },
}
"""A slice's chip grid by its chip count: 2D tori (v5e, v6e) and 3D (v4, v5p), as Cloud TPU lays them out."""
TPU_GENERATIONS = {"v5e": 2, "v5litepod": 2, "v6e": 2, "v4": 3, "v5p": 3}
"""Cloud TPU names of a slice's generation (``v5e-256``), with its grid's rank; v4 and v5p slices are named by
their TensorCores (two a chip: ``v5p-128`` is 64 chips)."""
TARGET_EXAMPLES = "v5e:2x2, v5e:16x16 (= v5e-256), v5p:4x4x4 (= v5p-128), v6e:16x16"
_GOOGLE_PCI_VENDOR = "0x1ae0"


def tpu_present() -> bool:
    """Whether this machine has a TPU chip: Google's PCI devices, as libtpu finds them."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return bool(glob.glob("/dev/accel*"))


def quiet_libtpu() -> None:
    """Where libtpu is installed on a machine without a TPU, JAX's start makes it look for one and print five
    lines to stderr: give it the two settings it asks for (never over a user's own, never where a TPU chip is
    present), so that a process that does not run on a TPU says nothing. Before JAX starts its backends."""
    if "TPU_ACCELERATOR_TYPE" in os.environ or importlib.util.find_spec("libtpu") is None or tpu_present():
        return
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # libtpu takes /tmp/libtpu_lockfile to keep a chip to one process: with no chip, every process that
    # compiles for a target loads it (two at once failed: "Internal error when accessing libtpu
    # multi-process lockfile")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def topology_name(target: str) -> str:
    """libtpu's topology name of a target: itself (``v5e:16x16``), or from a Cloud TPU slice's name
    (``v5e-256``, ``v5litepod-16``, ``v6e-256``; ``v5p-128`` and ``v4-128`` by their TensorCores)."""
    text = target.strip().lower()
    if ":" in text:
        return text
    named = re.fullmatch(r"(v5e|v5litepod|v6e|v4|v5p)-(\d+)", text)
    if named is None:
        raise DeviceSetupError(f"unknown TPU target {target!r}: give a topology such as {TARGET_EXAMPLES}")
    generation, count = named.group(1), int(named.group(2))
    rank = TPU_GENERATIONS[generation]
    chips = count // 2 if rank == 3 else count
    grid = TPU_GRIDS[rank].get(chips)
    if grid is None:
        raise DeviceSetupError(
            f"TPU target {target!r}: no {generation} slice of {chips} chips is known; give its topology as "
            f"GENERATION:GRID, such as {TARGET_EXAMPLES}"
        )
    return f"{'v5e' if generation == 'v5litepod' else generation}:{grid}"


def target_devices(target: str) -> list[Any]:
    """The abstract devices of TPU slice ``target`` (``topology_name``) that libtpu's compiler compiles for
    on any machine, no TPU needed: a step lowered with them compiles for that pod (``jax.jit(...).lower(
    ...).compile()``), to be measured, never run. Needs libtpu (``pip install 'meshkit[tpu]'``)."""
    if importlib.util.find_spec("libtpu") is None:
        raise DeviceSetupError(
            f"--target {target} compiles with libtpu's compiler, which is not installed: pip install 'meshkit[tpu]'"
        )
    name = topology_name(target)
    quiet_libtpu()
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # libtpu's own error: an unknown generation or grid
        if name.endswith(":1x1"):  # libtpu before 0.0.50 (JAX 0.10's) needs one chip's host bounds said
            try:
                one = topologies.get_topology_desc(
                    platform="tpu", topology_name=name, chips_per_host_bounds=(1, 1, 1)
                )
                return list(one.devices)
            except Exception:
                pass
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise DeviceSetupError(
            f"libtpu knows no TPU topology {name!r} ({first}): give one such as {TARGET_EXAMPLES}"
        ) from None
