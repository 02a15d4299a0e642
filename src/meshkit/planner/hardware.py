"""Accelerators the planner knows: peak bf16 FLOP/s, HBM capacity and bandwidth, link bandwidth.

Figures are per device, dense (no 2:4 sparsity), bandwidths per direction. Where a datasheet quotes
a bidirectional NVLink figure (A100: 600 GB/s, H100: 900 GB/s) the table holds half of it, the rate
one device sends at while it receives as much (what a ring collective sees). Inter-host figures are
the NIC bandwidth per device of the vendor's reference node (DGX: one InfiniBand port per GPU);
TPU slices connect chips by ICI inside and across hosts, so their inter-host figure is the ICI one
(a job spanning slices over the data-center network is slower than the table says). ``custom``
builds one from flags, ``override`` replaces a named device's figures with the user's. The
calibrated compute efficiency per family and software stack lives in ``planner.predict``.

Latency per ring step (``hop_s``, ``host_hop_s``) is NCCL's own tuning model for its ring with the
Simple protocol (NVIDIA/nccl ``src/graph/tuning.cc`` @ 01afd20a77b5804e0ecf1042509dd9d20ebf9e93:
``baseLat`` 8.4 us, ``hwLat`` NVLink 3.4 us, network 9.6 us per step); ``planner.predict`` counts
the steps. TPU ICI has no published per-hop figure that we found: NVLink's is assumed for it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from meshkit._errors import MeshkitError

GIB = 2**30
FAMILIES = ("gpu-hopper", "gpu-ampere", "tpu")
"""Device families, each with its own calibrated efficiency (the order: the first one an estimate borrows from)."""
BASE_LATENCY_S = 8.4e-6
"""Fixed cost of one collective (NCCL ``baseLat``, ring, Simple protocol)."""
NVLINK_HOP_S = 3.4e-6
NET_HOP_S = 9.6e-6


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """One accelerator and the node it usually sits in."""

    name: str
    family: str
    """One of ``FAMILIES``: devices sharing one calibrated matmul efficiency per software stack."""
    peak_flops: float
    """Dense bf16 matmul FLOP/s per device."""
    fp32_flops: float
    """FLOP/s of fp32 matmuls as XLA runs them by default (TF32 tensor cores on NVIDIA GPUs)."""
    memory_bytes: float
    """HBM capacity per device."""
    hbm_bytes_per_s: float
    intra_host_bytes_per_s: float
    """Per device, per direction, between devices of one host (NVLink / ICI)."""
    inter_host_bytes_per_s: float
    """Per device, per direction, between hosts (InfiniBand NIC per GPU / ICI inside a TPU slice)."""
    devices_per_host: int
    hop_s: float = NVLINK_HOP_S
    """Latency of one ring step between devices of a host (NCCL: NVLink)."""
    host_hop_s: float = NET_HOP_S
    """Latency of one ring step between hosts (NCCL: network; TPU: ICI, assumed as NVLink)."""
    source: str = ""

    def to_json(self) -> dict:
        return asdict(self)


HARDWARE: dict[str, Hardware] = {
    # A100 SXM4: NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf, as quoted
    # by glennklockwood.com/garden/processors/A100): bf16 312 TFLOP/s dense (624 with sparsity),
    # TF32 156; 40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at 2,039 GB/s; NVLink 3 "300+300 GB/s".
    # Capacity as the driver reports it (nvidia-smi: 40960 / 81920 MiB).
    # Inter-host: DGX A100, eight 200 Gb/s HDR InfiniBand NICs, one per GPU (25 GB/s per GPU);
    # clusters vary (BLOOM's Jean Zay nodes: 4 x 100 Gb/s Omni-Path per 8 GPUs).
    "a100-40gb": Hardware(
        name="a100-40gb", family="gpu-ampere", peak_flops=312e12, fp32_flops=156e12,
        memory_bytes=40 * GIB, hbm_bytes_per_s=1555e9, intra_host_bytes_per_s=300e9,
        inter_host_bytes_per_s=25e9, devices_per_host=8,
        source="NVIDIA A100 datasheet (SXM4 40GB); DGX A100: 8 x HDR 200 Gb/s",
    ),
    "a100-80gb": Hardware(
        name="a100-80gb", family="gpu-ampere", peak_flops=312e12, fp32_flops=156e12,
        memory_bytes=80 * GIB, hbm_bytes_per_s=2039e9, intra_host_bytes_per_s=300e9,
        inter_host_bytes_per_s=25e9, devices_per_host=8,
        source="NVIDIA A100 datasheet (SXM4 80GB); DGX A100: 8 x HDR 200 Gb/s",
    ),
    # H100 SXM5 (700 W): NVIDIA H100 datasheet (as reproduced by archive-lib.hpctech.co.jp and
    # glennklockwood.com/garden/processors/h100): bf16 989.4 TFLOP/s dense (1,979 is with sparsity),
    # TF32 494.7; 80 GB HBM3 at 3,350 GB/s (nvidia-smi: 81559 MiB); NVLink 4 900 GB/s bidirectional. Inter-host: DGX H100,
    # eight single-port ConnectX-7 at 400 Gb/s (docs.nvidia.com DGX BasePOD), 50 GB/s per GPU.
    "h100": Hardware(
        name="h100", family="gpu-hopper", peak_flops=989.4e12, fp32_flops=494.7e12,
        memory_bytes=81559 * 2**20, hbm_bytes_per_s=3350e9, intra_host_bytes_per_s=450e9,
        inter_host_bytes_per_s=50e9, devices_per_host=8,
        source="NVIDIA H100 datasheet (SXM5); DGX H100: 8 x ConnectX-7 400 Gb/s",
    ),
    # H200 SXM: the H100's compute die (bf16 989.4 TFLOP/s dense) with 141 GB HBM3e at 4.8 TB/s,
    # NVLink 4 450 GB/s per direction (NVIDIA H200 datasheet, as quoted by lzwjava.github.io and
    # saulelectric.com); DGX H200: 8 x ConnectX-7 400 Gb/s.
    "h200": Hardware(
        name="h200", family="gpu-hopper", peak_flops=989.4e12, fp32_flops=494.7e12,
        memory_bytes=141e9, hbm_bytes_per_s=4800e9, intra_host_bytes_per_s=450e9,
        inter_host_bytes_per_s=50e9, devices_per_host=8,
        source="NVIDIA H200 datasheet (SXM); DGX H200: 8 x ConnectX-7 400 Gb/s",
    ),
    # B200 (HGX, 1,000 W; glennklockwood.com/garden/processors/B200 quoting NVIDIA's HGX figures): bf16
    # 2,250 TFLOP/s dense (4,500 with sparsity), TF32 1,100; 180 GB HBM3e at 8 TB/s (HGX B200 as cloud
    # providers list it: 179 GB, 8.0 TB/s); NVLink 5 1,800 GB/s bidirectional. Inter-host: DGX B200,
    # eight ConnectX-7 400 Gb/s. No run on Blackwell has calibrated its own efficiency: it borrows
    # Hopper's (family gpu-hopper), so a prediction for it is an estimate.
    "b200": Hardware(
        name="b200", family="gpu-hopper", peak_flops=2250e12, fp32_flops=1100e12,
        memory_bytes=180e9, hbm_bytes_per_s=8000e9, intra_host_bytes_per_s=900e9,
        inter_host_bytes_per_s=50e9, devices_per_host=8,
        source="NVIDIA HGX B200 figures; DGX B200: 8 x ConnectX-7 400 Gb/s; efficiency borrowed from Hopper",
    ),
    # Cloud TPU system architecture pages. ICI joins every chip of a slice, across hosts: both link
    # figures are ICI per chip per direction (a job spanning slices over the data-center network,
    # v5e 25 Gb/s and v5p 50 Gb/s per chip, is far slower than this table says).
    # v4 (cloud.google.com/tpu/docs/v4): 275 TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s, 3D torus;
    # 4 chips per host (PaLM paper: 3,072 chips on 768 hosts). ICI 2,400 Gb/s per chip.
    "tpu-v4": Hardware(
        name="tpu-v4", family="tpu", peak_flops=275e12, fp32_flops=275e12 / 3,
        memory_bytes=32 * GIB, hbm_bytes_per_s=1200e9, intra_host_bytes_per_s=300e9,
        inter_host_bytes_per_s=300e9, devices_per_host=4, host_hop_s=NVLINK_HOP_S,
        source="cloud.google.com/tpu/docs/v4",
    ),
    # v5e (docs.cloud.google.com/tpu/docs/v5e): 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, ICI 400 GB/s
    # bidirectional per chip, 2D torus, 8 chips per host. Capacity: the 15.75 GiB XLA:TPU gives a program
    # (libtpu 0.0.50's CompileTimeHbmOom limit for v5e; the chip at hand reports the same 15.75 GiB).
    "tpu-v5e": Hardware(
        name="tpu-v5e", family="tpu", peak_flops=197e12, fp32_flops=197e12 / 3,
        memory_bytes=15.75 * GIB, hbm_bytes_per_s=819e9, intra_host_bytes_per_s=200e9,
        inter_host_bytes_per_s=200e9, devices_per_host=8, host_hop_s=NVLINK_HOP_S,
        source="docs.cloud.google.com/tpu/docs/v5e",
    ),
    # v5p (docs.cloud.google.com/tpu/docs/v5p-training): 459 TFLOP/s bf16, 95 GiB HBM at 2,765 GB/s,
    # ICI 1,200 GB/s bidirectional per chip, 3D torus, 4 chips per host. Capacity: the 95.73 GiB XLA:TPU
    # gives a program (libtpu 0.0.50's CompileTimeHbmOom limit for v5p).
    "tpu-v5p": Hardware(
        name="tpu-v5p", family="tpu", peak_flops=459e12, fp32_flops=459e12 / 3,
        memory_bytes=95.73 * GIB, hbm_bytes_per_s=2765e9, intra_host_bytes_per_s=600e9,
        inter_host_bytes_per_s=600e9, devices_per_host=4, host_hop_s=NVLINK_HOP_S,
        source="docs.cloud.google.com/tpu/docs/v5p-training",
    ),
    # v6e, Trillium (docs.cloud.google.com/tpu/docs/v6e): 918 TFLOP/s bf16, 32 GB HBM at 1,638 GB/s,
    # ICI 800 GB/s bidirectional per chip, 2D torus, 8 chips per host. Capacity: the 31.24 GiB XLA:TPU
    # gives a program (libtpu 0.0.50's CompileTimeHbmOom limit for v6e).
    "tpu-v6e": Hardware(
        name="tpu-v6e", family="tpu", peak_flops=918e12, fp32_flops=918e12 / 3,
        memory_bytes=31.24 * GIB, hbm_bytes_per_s=1638e9, intra_host_bytes_per_s=400e9,
        inter_host_bytes_per_s=400e9, devices_per_host=8, host_hop_s=NVLINK_HOP_S,
        source="docs.cloud.google.com/tpu/docs/v6e",
    ),
}  # fmt: skip
"""The known accelerators by name (``--hardware``); TPU fp32 matmuls as XLA's HIGH precision (3 bf16 passes)."""


def hardware(name: str) -> Hardware:
    """A known accelerator by name; MeshkitError naming the choices for an unknown one."""
    key = name.strip().lower()
    if key not in HARDWARE:
        raise MeshkitError(
            f"unknown hardware {name!r}: choose one of {', '.join(HARDWARE)}, or custom with "
            "--peak-tflops --memory-gb --hbm-gbps --intra-gbps --inter-gbps"
        )
    return HARDWARE[key]


FIGURES = {
    "peak_tflops": ("peak_flops", 1e12),
    "memory_gb": ("memory_bytes", 1e9),
    "hbm_gbps": ("hbm_bytes_per_s", 1e9),
    "intra_gbps": ("intra_host_bytes_per_s", 1e9),
    "inter_gbps": ("inter_host_bytes_per_s", 1e9),
}
"""The user's figures (``--peak-tflops`` ...): the ``Hardware`` field each sets, and its unit."""


def check_number(flag: str, value: float | None, *, zero: bool = False) -> None:
    """A figure the user gave: finite and > 0 (``zero``: >= 0), else one line naming the flag."""
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise MeshkitError(f"--{flag.replace('_', '-')} {value}: give a finite number {bound}")


def override(hw: Hardware, **figures: float | None) -> Hardware:
    """``hw`` with the figures the user gave (``peak_tflops=``, ``memory_gb=``, ``hbm_gbps=``,
    ``intra_gbps=``, ``inter_gbps=``; None keeps the table's). A new peak scales the fp32 rate with it."""
    changes: dict[str, float] = {}
    for flag, value in figures.items():
        if flag not in FIGURES:
            raise MeshkitError(f"unknown hardware figure {flag!r}: choose one of {', '.join(FIGURES)}")
        check_number(flag, value)
        if value is not None:
            field, unit = FIGURES[flag]
            changes[field] = value * unit
    if not changes:
        return hw
    if "peak_flops" in changes:
        changes["fp32_flops"] = hw.fp32_flops * changes["peak_flops"] / hw.peak_flops
    given = ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in figures.items() if v is not None)
    return replace(hw, **changes, source=f"{hw.source}; overridden by {given}")


def custom(
    *,
    peak_tflops: float,
    memory_gb: float,
    hbm_gbps: float,
    intra_gbps: float,
    inter_gbps: float,
    devices_per_host: int = 8,
    family: str = "gpu-hopper",
) -> Hardware:
    """An accelerator from its figures (TFLOP/s, GB, GB/s per direction); ``family`` picks the
    calibrated efficiency (``gpu-ampere``, ``gpu-hopper`` or ``tpu``)."""
    figures = dict(peak_tflops=peak_tflops, memory_gb=memory_gb, hbm_gbps=hbm_gbps, intra_gbps=intra_gbps,
                   inter_gbps=inter_gbps)  # fmt: skip
    for k, v in figures.items():
        if v is None:
            raise MeshkitError(f"custom hardware needs --{k.replace('_', '-')} > 0")
        check_number(k, v)
    if family not in FAMILIES:
        raise MeshkitError(f"unknown hardware family {family!r}: choose one of {', '.join(FAMILIES)}")
    return Hardware(
        name="custom", family=family, peak_flops=peak_tflops * 1e12, fp32_flops=peak_tflops * 1e12 / 2,
        memory_bytes=memory_gb * 1e9, hbm_bytes_per_s=hbm_gbps * 1e9, intra_host_bytes_per_s=intra_gbps * 1e9,
        inter_host_bytes_per_s=inter_gbps * 1e9, devices_per_host=devices_per_host, source="user flags",
    )  # fmt: skip


DEVICE_KINDS: tuple[tuple[str, str | None], ...] = (
    ("h100 pcie", None),  # lower clocks and power than the SXM part the table holds
    ("h100 nvl", None),
    ("h200 nvl", None),
    ("tpu v4 lite", None),  # v4i, an inference chip
    ("h200", "h200"),
    ("h100", "h100"),
    ("b200", "b200"),
    ("a100-sxm4-40gb", "a100-40gb"),
    ("a100", "a100-80gb"),
    ("tpu v4", "tpu-v4"),
    ("tpu v5 lite", "tpu-v5e"),
    ("tpu v5e", "tpu-v5e"),
    ("tpu v5", "tpu-v5p"),
    ("tpu v6 lite", "tpu-v6e"),
    ("tpu v6e", "tpu-v6e"),
)
"""A JAX ``device_kind`` (lower-cased) -> the table's accelerator: the first entry the kind contains
(``NVIDIA H100 80GB HBM3``: h100; ``TPU v5 lite``: v5e; ``TPU v5``: v5p, as JAX and libtpu name them);
None for variants whose figures differ from the table's (their peak is the user's to give)."""


def for_device(kind: str) -> Hardware | None:
    """The accelerator of ``HARDWARE`` a JAX device kind names, or None (a CPU, a device not in the table)."""
    low = kind.lower()
    name = next((name for part, name in DEVICE_KINDS if part in low), None)
    return None if name is None else HARDWARE[name]


def peak_flops(
    device_kind: str, precision: str, peak_tflops: float | None = None
) -> tuple[float | None, str]:
    """A run's peak FLOP/s per device and where the figure comes from: ``peak_tflops`` (``--peak-tflops``)
    where given, else the table's figure for ``device_kind`` at the precision the step computes in
    (``bf16``: the dense bf16 peak; ``fp32``: fp32 matmuls as XLA runs them, TF32 on NVIDIA GPUs), else
    None (a CPU, or a device the table does not hold: MFU is then not reported)."""
    check_number("peak_tflops", peak_tflops)
    if peak_tflops is not None:
        return peak_tflops * 1e12, f"--peak-tflops {peak_tflops:g}"
    hw = for_device(device_kind)
    if hw is None:
        return None, f"no peak known for {device_kind!r}: give --peak-tflops"
    return (hw.fp32_flops, f"{hw.name} fp32") if precision == "fp32" else (hw.peak_flops, f"{hw.name} bf16")
