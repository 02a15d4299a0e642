"""meshkit: train JAX models across devices and hosts, and prove what it did.

Names are imported on first use, so that ``meshkit comm --hlo FILE`` (and any tool that only
reads HLO text) starts without importing JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from meshkit._errors import DeviceSetupError, HloParseError, MeshkitError, MeshSpecError, TargetError

__version__ = "0.1.0"

#: Public name -> module that defines it (imported on first access).
_LAZY = {
    "analysis": "meshkit.analysis",
    "Adapted": "meshkit.adapters",
    "from_equinox": "meshkit.adapters",
    "from_linen": "meshkit.adapters",
    "from_nnx": "meshkit.adapters",
    "DeviceReport": "meshkit.devices",
    "describe_devices": "meshkit.devices",
    "simulate_devices": "meshkit.devices",
    "prepare_deterministic": "meshkit.devices",
    "make_mesh": "meshkit.mesh",
    "parse_mesh_spec": "meshkit.mesh",
    "resolve_mesh_shape": "meshkit.mesh",
    "PLANS": "meshkit.spec",
    "ParallelSpec": "meshkit.spec",
    "PlanError": "meshkit.spec",
    "PlanReport": "meshkit.train",
    "Stages": "meshkit.plans",
    "Trainer": "meshkit.train",
    "layer": "meshkit.plans",
}

if TYPE_CHECKING:
    from meshkit import analysis
    from meshkit.adapters import Adapted, from_equinox, from_linen, from_nnx
    from meshkit.devices import DeviceReport, describe_devices, prepare_deterministic, simulate_devices
    from meshkit.mesh import make_mesh, parse_mesh_spec, resolve_mesh_shape
    from meshkit.plans import Stages, layer
    from meshkit.spec import PLANS, ParallelSpec, PlanError
    from meshkit.train import PlanReport, Trainer


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'meshkit' has no attribute {name!r}")
    module = importlib.import_module(target)
    value = module if target == f"meshkit.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "PLANS",
    "Adapted",
    "DeviceReport",
    "DeviceSetupError",
    "HloParseError",
    "MeshSpecError",
    "MeshkitError",
    "ParallelSpec",
    "PlanError",
    "PlanReport",
    "Stages",
    "TargetError",
    "Trainer",
    "analysis",
    "describe_devices",
    "from_equinox",
    "from_linen",
    "from_nnx",
    "layer",
    "make_mesh",
    "parse_mesh_spec",
    "prepare_deterministic",
    "resolve_mesh_shape",
    "simulate_devices",
]
