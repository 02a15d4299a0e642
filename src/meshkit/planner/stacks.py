"""The software stacks a job can run (their kernels set the matmul efficiency, their ZeRO-3 engine
how many collectives a layer costs), and what the published runs calibrated for each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshkit._errors import MeshkitError
from meshkit.planner.hardware import FAMILIES, Hardware


@dataclass(frozen=True, kw_only=True, slots=True)
class Stack:
    """The software a job runs: its kernels set the matmul efficiency, its ZeRO-3 engine how many
    collectives a layer costs."""

    name: str
    label: str
    zero3_per_tensor: bool = False
    """ZeRO-3 gathers and reduces each parameter tensor by itself (DeepSpeed's engine) rather than a
    layer at a time (PyTorch FSDP's unit, XLA's combined collectives, Megatron's buckets)."""
    one_nic: bool = False
    """Its data-parallel collectives leave a host through one NIC, whatever the group's members on
    the host (``network.group_bandwidth(one_nic=True)``). DeepSpeed's ZeRO engine of 2021: its
    published ZeRO-3 runs (Narayanan et al. 2021, 384-2240 A100) reach one of a DGX A100's eight NICs:
    with it they need no fitted fraction of ring bandwidth (``Calibration.comm_efficiency`` fits to 1)."""
    tpu: bool = False
    """Runs on TPUs (JAX/XLA only)."""


STACKS: dict[str, Stack] = {
    s.name: s
    for s in (
        Stack(name="maxtext-xla", label="JAX/XLA (MaxText, Pax, meshkit)", tpu=True),
        Stack(name="megatron-te", label="Megatron-LM/NeMo (Megatron-Core, Transformer Engine)"),
        Stack(name="torchtitan", label="PyTorch FSDP (torchtitan, fms-fsdp)"),
        Stack(name="deepspeed", label="DeepSpeed (ZeRO, pipeline engine) on Megatron's kernels",
              zero3_per_tensor=True, one_nic=True),
    )
}  # fmt: skip
"""The software stacks ``--stack`` names; the corpus rows of each calibrate its efficiency."""


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What the published runs set (``planner.calibrate.fit`` finds them again)."""

    efficiency: dict[str, float]
    """Fraction of peak FLOP/s a large matmul-bound transformer layer reaches, by ``stack/family``."""
    overlap_tax: float
    """Fraction of its own time a collective hidden behind compute still costs."""
    straggler: float
    """Relative spread of one device's step time (stragglers: the step waits for the slowest)."""
    comm_efficiency: dict[str, float] = field(default_factory=dict)
    """Fraction of the ring model's bandwidth a stack's data-parallel collectives reach (1 where absent)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where an ``efficiency`` key's figure comes from, where it is not the published runs (a chip's
    measurement: ``planner.measured``)."""

    def efficiency_of(self, stack: str, family: str, hardware: str = "") -> tuple[float, str]:
        """(efficiency, where it comes from): measured on that hardware (a ``stack/tpu-v5e`` key,
        ``planner.measured``), else fitted on the stack's runs on that family, else carried from a family
        it has runs on by another stack's ratio between the two families."""
        if (on_chip := self.efficiency.get(f"{stack}/{hardware}")) is not None:
            return on_chip, self.sources.get(f"{stack}/{hardware}", f"measured on {hardware}")
        own = self.efficiency.get(f"{stack}/{family}")
        if own is not None:
            return own, f"calibrated on {stack}'s published runs on {family}"
        for there in FAMILIES:
            mine = self.efficiency.get(f"{stack}/{there}")
            for ref in STACKS if mine is not None else ():
                a, b = self.efficiency.get(f"{ref}/{family}"), self.efficiency.get(f"{ref}/{there}")
                if a is not None and b is not None and ref != stack:
                    return (
                        mine * a / b,
                        f"estimated: {stack} has no published run on {family}; its {there} figure x {ref}'s {family}/{there}",
                    )
        raise MeshkitError(f"no calibration for the {stack} stack on {family}: choose another --stack")

    def to_json(self) -> dict:
        return {"efficiency": dict(self.efficiency), "overlap_tax": self.overlap_tax, "straggler": self.straggler,
                "comm_efficiency": dict(self.comm_efficiency), "sources": dict(self.sources)}  # fmt: skip


CALIBRATION = Calibration(
    efficiency={"deepspeed/gpu-ampere": 0.691, "maxtext-xla/gpu-hopper": 0.668, "maxtext-xla/tpu": 0.842,
                "megatron-te/gpu-ampere": 0.61, "megatron-te/gpu-hopper": 0.696, "torchtitan/gpu-ampere": 0.709,
                "torchtitan/gpu-hopper": 0.508},
    overlap_tax=0.45,
    straggler=0.0,
)  # fmt: skip
"""Fitted on the calibration rows of tests/corpus/published_runs.json (``planner.calibrate.fit_scale``;
tests/test_planner_scale.py refits it): the straggler spread fits to 0 there (the latency and the
overlap tax account for the growth with scale those rows show)."""


def stack_for(job: Any, hardware: Hardware) -> Stack:
    """The job's stack, refused in one line where it does not run on the hardware."""
    stack = STACKS[job.stack]
    if hardware.family == "tpu" and not stack.tpu:
        raise MeshkitError(
            f"the {stack.name} stack does not run on TPUs ({hardware.name}): use --stack maxtext-xla"
        )
    return stack
