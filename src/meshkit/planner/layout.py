"""The planner's vocabulary: a model by shape, a parallel layout, and the meshkit plan that runs it.

Shared by the analytic model (what a layout costs on a cluster far larger than this machine) and the
ahead-of-time compile check (what XLA does with that layout on simulated devices), so that both
speak of the same layout. A ``Layout`` is data; ``meshkit_plan`` and ``mesh_spec`` name the plan and
mesh under which meshkit executes it (``None`` where meshkit has no such plan, e.g. ZeRO-1 combined
with tensor parallelism: the model can still predict it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshkit._errors import MeshkitError

REMAT = ("none", "layer", "dots", "regather")
"""meshkit's activation checkpointing policies (``meshkit.plans._fsdp.REMAT``)."""
REMAT_ALIASES = {"full": "layer", "selective": "dots"}
"""Names other tools use: Megatron's full recompute is per-layer remat, its selective one saves matmuls."""
SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """A decoder-only transformer by its sizes (meshkit's reference GPT when ``gated`` is False:
    learned positions, untied unembedding, biases, LayerNorm)."""

    name: str = "gpt"
    layers: int
    width: int
    heads: int
    vocab: int
    seq: int
    ffn: int = 0
    """MLP hidden size; 0 means 4 x width."""
    gated: bool = False
    """A SwiGLU MLP (three matrices, LLaMA-style) instead of two."""
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0 means ``heads`` (multi-head attention)."""
    head_dim: int = 0
    """Width of one head; 0 means width / heads (some models, e.g. PaLM, attend wider or narrower)."""

    def __post_init__(self):
        for name in ("layers", "width", "heads", "vocab", "seq"):
            if getattr(self, name) < 1:
                raise MeshkitError(f"model {name}={getattr(self, name)}: must be at least 1")
        if self.head_dim == 0 and self.width % self.heads:
            raise MeshkitError(
                f"width {self.width} is not divisible by heads {self.heads}: pick heads dividing it"
            )
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.width)
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.width // self.heads)
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.heads % self.kv_heads:
            raise MeshkitError(
                f"heads {self.heads} is not divisible by kv_heads {self.kv_heads}: pick kv_heads dividing it"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """One parallel layout: degrees of data (dp), tensor (tp) and pipeline (pp) parallelism, the ZeRO
    stage over the data axis, micro-batch size and pipeline schedule, and activation checkpointing."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    """0 (replicated, plain data parallel), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters, FSDP)."""
    microbatch_size: int = 1
    """Sequences per micro-batch per data-parallel replica (pipeline: per micro-batch in flight)."""
    schedule: str = "1f1b"
    virtual_stages: int = 1
    remat: str = "none"

    def __post_init__(self):
        remat = REMAT_ALIASES.get(self.remat, self.remat)
        object.__setattr__(self, "remat", remat)
        for name in ("dp", "tp", "pp", "microbatch_size", "virtual_stages"):
            if getattr(self, name) < 1:
                raise MeshkitError(f"layout {name}={getattr(self, name)}: must be at least 1")
        if self.zero not in (0, 1, 2, 3):
            raise MeshkitError(f"layout zero={self.zero}: choose 0, 1, 2 or 3")
        if self.schedule not in SCHEDULES:
            raise MeshkitError(f"unknown schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if remat not in REMAT:
            choices = ", ".join((*REMAT, *REMAT_ALIASES))
            raise MeshkitError(f"unknown remat {self.remat!r}: choose one of {choices}")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise MeshkitError("virtual_stages > 1 needs schedule=interleaved")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    @classmethod
    def parse(cls, text: str, **options) -> Layout:
        """``"dp=24,tp=8,pp=8"`` (any order; a missing degree is 1), plus keyword ``options``."""
        degrees: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in ("dp", "tp", "pp") or not value.strip().isdigit():
                raise MeshkitError(f"bad layout part {part!r}: write e.g. dp=24,tp=8,pp=8")
            if key in degrees:
                raise MeshkitError(f"layout {text!r} gives {key} twice")
            degrees[key] = int(value)
        return cls(**degrees, **options)

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    def meshkit_plan(self) -> str | None:
        """The meshkit plan that executes this layout, or None where meshkit has none."""
        parts = []
        if self.dp > 1:
            parts.append({0: "dp", 1: "zero1", 2: "zero2", 3: "fsdp"}[self.zero])
        elif self.zero:
            return None  # ZeRO over a data axis of one device means nothing
        if self.tp > 1:
            parts.append("tp")
        if self.pp > 1:
            parts.append("pp")
        if not parts:
            return "dp"  # one device
        if len(parts) > 1 and parts[0] in ("zero1", "zero2"):
            return None  # meshkit combines only dp and fsdp with tp/pp
        name = "+".join(parts)
        from meshkit.plans import PLANS

        return name if name in PLANS else None

    def mesh_spec(self) -> str:
        """meshkit's mesh string for this layout, axes named as the plans name them."""
        axes = [("stage", self.pp), ("data", self.dp), ("model", self.tp)]
        kept = [f"{k}={v}" for k, v in axes if v > 1] or ["data=1"]
        return ",".join(kept)

    def label(self) -> str:
        text = f"dp={self.dp},tp={self.tp},pp={self.pp}"
        if self.zero:
            text += f" zero{self.zero}"
        text += f" mb={self.microbatch_size}"
        if self.pp > 1:
            text += f" {self.schedule}" + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")
        if self.remat != "none":
            text += f" remat={self.remat}"
        return text

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
