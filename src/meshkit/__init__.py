"""meshkit: train JAX models across devices and hosts, and prove what it did."""

from meshkit import analysis
from meshkit._errors import DeviceSetupError, HloParseError, MeshkitError, MeshSpecError, TargetError
from meshkit.devices import DeviceReport, describe_devices, simulate_devices
from meshkit.mesh import make_mesh, parse_mesh_spec, resolve_mesh_shape
from meshkit.plans import PLANS, PlanError
from meshkit.plans._hook import layer
from meshkit.train import PlanReport, Trainer

__version__ = "0.1.0"

__all__ = [
    "PLANS",
    "DeviceReport",
    "DeviceSetupError",
    "HloParseError",
    "MeshSpecError",
    "MeshkitError",
    "PlanError",
    "PlanReport",
    "TargetError",
    "Trainer",
    "analysis",
    "describe_devices",
    "layer",
    "make_mesh",
    "parse_mesh_spec",
    "resolve_mesh_shape",
    "simulate_devices",
]
