"""``meshkit plan``'s options: one alias each (its panel and help), read by ``meshkit.cli.plan``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from meshkit.spec import (
    CONTEXT_ATTENTION,
    PIPELINE_SCHEDULES,
    PRECISIONS,
    REMAT_ALIASES,
    REMAT_POLICIES,
    one_of,
)

_M = "Model"
_C = "Cluster"
_J = "Job"
_L = "One layout (--layout)"
_O = "Output"


def _opt(panel: str, help: str, *decls: str, **kw) -> typer.models.OptionInfo:
    return typer.Option(*decls, help=help, rich_help_panel=panel, **kw)


_Model = Annotated[
    str | None,
    _opt(
        _M,
        "A preset (gpt2-124m ... gpt-13b, llama-7b ... llama3-8b, mixtral-8x7b, mixtral-8x22b), or "
        "module:function returning a ModelShape or meshkit GPT parameters (with --heads).",
    ),
]
_Layers = Annotated[int | None, _opt(_M, "Transformer blocks.")]
_Width = Annotated[int | None, _opt(_M, "Model width.")]
_Heads = Annotated[int | None, _opt(_M, "Attention heads.")]
_Vocab = Annotated[int | None, _opt(_M, "Vocabulary size.")]
_Seq = Annotated[int | None, _opt(_M, "Sequence length.")]
_Ffn = Annotated[int | None, _opt(_M, "MLP hidden size (default 4 x width).")]
_Gated = Annotated[bool | None, _opt(_M, "SwiGLU MLP (LLaMA-style), no biases.", "--gated/--no-gated")]
_KvHeads = Annotated[int | None, _opt(_M, "Key/value heads (grouped-query attention; default heads).")]
_HeadDim = Annotated[int | None, _opt(_M, "Width of one head (default width / heads).")]
_Experts = Annotated[
    int | None, _opt(_M, "Mixture of experts: MLPs of width --ffn per layer (0: a dense MLP).")
]
_ExpertsPerToken = Annotated[int | None, _opt(_M, "Mixture of experts: experts a token is routed to.")]
_CapacityFactor = Annotated[
    float | None, _opt(_M, "Mixture of experts: expert buffers' slots per routed token (1.25 usual).")
]
_Devices = Annotated[int | None, _opt(_C, "Devices in the cluster.", show_default="8, or --target's chips")]
_DevicesPerHost = Annotated[int | None, _opt(_C, "Devices per host (default: the hardware's node).")]
_Hardware = Annotated[
    str | None,
    _opt(
        _C,
        "a100-40gb, a100-80gb, h100, h200, b200, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e, or custom.",
        show_default="h100, or --target's chip",
    ),
]
_TargetOpt = Annotated[
    str | None,
    _opt(
        _C,
        "A TPU slice to plan for: v5e-256, v5p-128, v6e-64, or a topology such as v5e:16x16 (its chips set "
        "--hardware and --devices); --compile then compiles for it with libtpu's compiler (XLA:TPU), no TPU "
        "needed (pip install 'meshkit[tpu]').",
    ),
]
_PeakTflops = Annotated[
    float | None, _opt(_C, "Dense bf16 TFLOP/s per device (custom; overrides a named device's).")
]
_MemoryGb = Annotated[float | None, _opt(_C, "HBM GB per device (custom; overrides).")]
_HbmGbps = Annotated[float | None, _opt(_C, "HBM GB/s (custom; overrides).")]
_IntraGbps = Annotated[
    float | None, _opt(_C, "GB/s per device per direction inside a host (custom; overrides).")
]
_InterGbps = Annotated[
    float | None, _opt(_C, "GB/s per device per direction between hosts (custom; overrides).")
]
_Family = Annotated[str, _opt(_C, "custom: calibrated efficiency of gpu-ampere, gpu-hopper or tpu.")]
_GlobalBatch = Annotated[int, _opt(_J, "Sequences per optimizer step.")]
_Precision = Annotated[
    str,
    _opt(_J, f"{one_of(PRECISIONS)}; bytes per parameter: mixed-precision Adam 2+2+12, fp32 Adam 4+4+8."),
]
_OptimizerBytes = Annotated[
    float | None, _opt(_J, "Optimizer state bytes per parameter (default 12 bf16, 8 fp32).")
]
_FlashAttention = Annotated[
    bool,
    _opt(_J, "Attention without a stored S x S score matrix.", "--flash-attention/--no-flash-attention"),
]
_SequenceParallel = Annotated[
    bool,
    _opt(
        _J,
        "Under tensor parallelism, the activations between its matmuls split over the sequence (Megatron's "
        "sequence parallelism; meshkit's plans without a pipeline or an expert axis).",
        "--sequence-parallel/--no-sequence-parallel",
    ),
]
_Runtime = Annotated[str, _opt(_J, "standard (Megatron-style) or meshkit (meshkit's compiled programs).")]
_Stack = Annotated[
    str,
    _opt(
        _J,
        "Software whose efficiency to assume: maxtext-xla (JAX/XLA, what meshkit runs), megatron-te, "
        "torchtitan or deepspeed, each calibrated on its published runs.",
    ),
]
_ContextAttention = Annotated[str, _opt(_J, f"Context parallelism's attention: {one_of(CONTEXT_ATTENTION)}.")]
_Layout = Annotated[
    str | None,
    _opt(
        _L,
        "Evaluate one layout, e.g. dp=24,tp=8,pp=8, or with context / expert degrees dp=4,tp=8,pp=16,cp=16.",
    ),
]
_MicrobatchSize = Annotated[int, _opt(_L, "Sequences per micro-batch per replica.")]
_Schedule = Annotated[str, _opt(_L, f"{one_of(PIPELINE_SCHEDULES)}.")]
_VirtualStages = Annotated[
    int,
    _opt(
        _L,
        "Interleaved: chunks per device.",
        show_default="interleaved: 2 where it divides the layers per stage, else 1",
    ),
]
_Remat = Annotated[
    str, _opt(_L, one_of(REMAT_POLICIES, notes={v: f"= {k}" for k, v in REMAT_ALIASES.items()}) + ".")
]
_Zero = Annotated[int, _opt(_L, "ZeRO stage over the data axis: 0, 1, 2, 3.")]
_ShardGroup = Annotated[
    int,
    _opt(
        _L,
        "ZeRO-3 over groups of N data-parallel devices, replicated across the groups (hybrid sharding).",
        show_default="all of dp",
    ),
]
_Top = Annotated[int, _opt(_O, "Ranked layouts to show.")]
_Json = Annotated[bool, _opt(_O, "Print JSON instead of tables.")]
_Plot = Annotated[Path | None, _opt(_O, "Write the step time vs peak memory plot to FILE (.png).")]
_Out = Annotated[Path | None, _opt(_O, "Write plan.json and plan.png into DIR.")]
_Compile = Annotated[
    int,
    _opt(
        _O, "Compile the top K layouts ahead of time: on simulated CPU devices, or for --target's TPU chips."
    ),
]
_Calibration = Annotated[
    Path | None,
    _opt(
        _J,
        "The time model calibrated on a chip: benchmarks/device_check.py's JSON from that hardware (e.g. "
        "tpu-v5e, the chip meshkit ships), or a calibration's own JSON. Default: fitted on published runs.",
    ),
]
