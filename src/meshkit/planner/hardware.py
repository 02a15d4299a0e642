"""Accelerators the planner knows: peak bf16 FLOP/s, HBM capacity and bandwidth, link bandwidth.

Figures are per device, dense (no 2:4 sparsity), bandwidths per direction. Where a datasheet quotes
a bidirectional NVLink figure (A100: 600 GB/s, H100: 900 GB/s) the table holds half of it, the rate
one device sends at while it receives as much (what a ring collective sees). Inter-host figures are
the NIC bandwidth per device of the vendor's reference node (DGX: one InfiniBand port per GPU);
TPU slices connect chips by ICI inside and across hosts, so their inter-host figure is the ICI one
(a job spanning slices over the data-center network is slower than the table says). ``custom``
builds one from flags. The calibrated compute efficiency per family lives in ``planner.model``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshkit._errors import MeshkitError

GB = 1e9
GIB = 2**30


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """One accelerator and the node it usually sits in."""

    name: str
    family: str
    """``gpu-ampere``, ``gpu-hopper``, ``tpu``: devices sharing one calibrated matmul efficiency."""
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
    source: str = ""

    def to_json(self) -> dict:
        return asdict(self)


HARDWARE: dict[str, Hardware] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4): bf16 312 TFLOP/s dense, TF32 156, HBM2 40 GB at
    # 1,555 GB/s (40 GB) / HBM2e 80 GB at 2,039 GB/s (80 GB), NVLink 3 600 GB/s bidirectional.
    # DGX A100 user guide: 8 GPUs, 8 x 200 Gb/s HDR InfiniBand compute ports (25 GB/s per GPU).
    "a100-40gb": Hardware(
        name="a100-40gb", family="gpu-ampere", peak_flops=312e12, fp32_flops=156e12,
        memory_bytes=40 * GIB, hbm_bytes_per_s=1555 * GB, intra_host_bytes_per_s=300 * GB,
        inter_host_bytes_per_s=25 * GB, devices_per_host=8,
        source="NVIDIA A100 datasheet (SXM4 40GB); DGX A100 user guide (8x HDR 200 Gb/s)",
    ),
    "a100-80gb": Hardware(
        name="a100-80gb", family="gpu-ampere", peak_flops=312e12, fp32_flops=156e12,
        memory_bytes=80 * GIB, hbm_bytes_per_s=2039 * GB, intra_host_bytes_per_s=300 * GB,
        inter_host_bytes_per_s=25 * GB, devices_per_host=8,
        source="NVIDIA A100 datasheet (SXM4 80GB); DGX A100 user guide (8x HDR 200 Gb/s)",
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): bf16 989 TFLOP/s dense (1,979 with sparsity),
    # TF32 495 dense, HBM3 80 GB at 3.35 TB/s, NVLink 4 900 GB/s bidirectional. DGX H100: 8 GPUs,
    # 8 x 400 Gb/s NDR InfiniBand (ConnectX-7), 50 GB/s per GPU.
    "h100": Hardware(
        name="h100", family="gpu-hopper", peak_flops=989e12, fp32_flops=495e12,
        memory_bytes=80 * GIB, hbm_bytes_per_s=3350 * GB, intra_host_bytes_per_s=450 * GB,
        inter_host_bytes_per_s=50 * GB, devices_per_host=8,
        source="NVIDIA H100 datasheet (SXM5); DGX H100 datasheet (8x NDR 400 Gb/s)",
    ),
    # NVIDIA H200 datasheet (SXM): same compute as H100 SXM, HBM3e 141 GB at 4.8 TB/s, NVLink 900 GB/s
    # bidirectional; DGX H200: 8 x 400 Gb/s NDR.
    "h200": Hardware(
        name="h200", family="gpu-hopper", peak_flops=989e12, fp32_flops=495e12,
        memory_bytes=141 * GB, hbm_bytes_per_s=4800 * GB, intra_host_bytes_per_s=450 * GB,
        inter_host_bytes_per_s=50 * GB, devices_per_host=8,
        source="NVIDIA H200 datasheet (SXM); DGX H200 datasheet (8x NDR 400 Gb/s)",
    ),
    # Google Cloud TPU system architecture pages (v4, v5e, v5p): bf16 peak per chip, HBM per chip and
    # its bandwidth, ICI bandwidth per chip (v4 2,400 Gbps, v5e 1,600 Gbps, v5p 4,800 Gbps; all
    # links of a chip together, so the table takes the per-direction half); 4 chips per host
    # (v5e: 8 per host in the v5litepod-8 machine type, 4 in training slices' hosts).
    "tpu-v4": Hardware(
        name="tpu-v4", family="tpu", peak_flops=275e12, fp32_flops=275e12 / 3,
        memory_bytes=32 * GIB, hbm_bytes_per_s=1200 * GB, intra_host_bytes_per_s=150 * GB,
        inter_host_bytes_per_s=150 * GB, devices_per_host=4,
        source="cloud.google.com/tpu/docs/v4 (275 TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s, ICI 2,400 Gbps)",
    ),
    "tpu-v5e": Hardware(
        name="tpu-v5e", family="tpu", peak_flops=197e12, fp32_flops=197e12 / 3,
        memory_bytes=16 * GIB, hbm_bytes_per_s=819 * GB, intra_host_bytes_per_s=100 * GB,
        inter_host_bytes_per_s=100 * GB, devices_per_host=4,
        source="cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, ICI 1,600 Gbps)",
    ),
    "tpu-v5p": Hardware(
        name="tpu-v5p", family="tpu", peak_flops=459e12, fp32_flops=459e12 / 3,
        memory_bytes=95 * GIB, hbm_bytes_per_s=2765 * GB, intra_host_bytes_per_s=300 * GB,
        inter_host_bytes_per_s=300 * GB, devices_per_host=4,
        source="cloud.google.com/tpu/docs/v5p (459 TFLOP/s bf16, 95 GB HBM2e at 2,765 GB/s, ICI 4,800 Gbps)",
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
        if v is None or v <= 0:
            raise MeshkitError(f"custom hardware needs --{k.replace('_', '-')} > 0")
    families = sorted({h.family for h in HARDWARE.values()})
    if family not in families:
        raise MeshkitError(f"unknown hardware family {family!r}: choose one of {', '.join(families)}")
    return Hardware(
        name="custom", family=family, peak_flops=peak_tflops * 1e12, fp32_flops=peak_tflops * 1e12 / 2,
        memory_bytes=memory_gb * GB, hbm_bytes_per_s=hbm_gbps * GB, intra_host_bytes_per_s=intra_gbps * GB,
        inter_host_bytes_per_s=inter_gbps * GB, devices_per_host=devices_per_host, source="user flags",
    )  # fmt: skip
