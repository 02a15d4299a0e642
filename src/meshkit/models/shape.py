"""A model by its shape: the one description of a decoder-only transformer that the reference
models are built from and the planner predicts from (``meshkit plan --model``)."""

from __future__ import annotations

from dataclasses import dataclass

from meshkit._errors import MeshkitError


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """A decoder-only transformer by its sizes: what the planner predicts from, and what a model
    family's config is built from (``from_shape``) and describes itself as (``shape()``); the family is
    its registry row's (``meshkit.models.registry``). ``gated`` chooses the MLP the formulas count: two
    matrices (meshkit's reference GPT: learned positions, untied unembedding, biases, LayerNorm) or a
    SwiGLU's three (its Llama: rotary positions, RMSNorm, no biases)."""

    name: str = "gpt"
    """A family's name (a run's ``--model``) or a preset's (``llama-7b``): a label, never dispatched on."""
    family: str = ""
    """The model family whose step is built for this shape (``meshkit.models.registry``: the planner's
    compile check builds that family's own step); '' means by the MLP: ``llama`` where gated, else ``gpt``."""
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
    rope_theta: float = 10000.0
    """Gated (Llama) models: the base of the rotary embedding's frequencies."""
    norm_eps: float = 1e-5
    """Gated (Llama) models: the RMSNorm epsilon."""
    tie_embeddings: bool = False
    """The output head is the token embedding, transposed (one table instead of two)."""
    experts: int = 0
    """Mixture of experts: every layer's MLP is this many MLPs of width ``ffn`` and a router; 0 means a
    dense MLP (Mixtral-8x7B: 8)."""
    experts_per_token: int = 2
    """Mixture of experts: the experts each token is routed to (top-k; Mixtral: 2)."""
    capacity_factor: float = 1.25
    """Mixture of experts: an expert takes at most ``capacity_factor x tokens x experts_per_token /
    experts`` tokens of a batch; the rest are dropped (they pass through the residual), counted, reported.
    0: dropless, every slot runs (one grouped matmul per weight, ``plans._experts._dropless``)."""
    shared_ffn: int = 0
    """Mixture of experts: the hidden width of a shared (gated) MLP every token runs beside its routed ones,
    with a gate of one output (Qwen2-MoE's ``shared_expert``); 0: none."""

    def __post_init__(self):
        for name in ("layers", "width", "heads", "vocab", "seq"):
            if getattr(self, name) < 1:
                raise MeshkitError(f"model {name}={getattr(self, name)}: must be at least 1")
        if self.head_dim == 0 and self.width % self.heads:
            raise MeshkitError(
                f"width {self.width} is not divisible by heads {self.heads}: pick heads dividing it"
            )
        if not self.family:
            object.__setattr__(self, "family", "llama" if self.gated else "gpt")
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.width)
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.width // self.heads)
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.experts:
            if self.experts < 2:
                raise MeshkitError(f"experts={self.experts}: give 0 (a dense MLP) or at least 2")
            if not 1 <= self.experts_per_token <= self.experts:
                raise MeshkitError(
                    f"experts_per_token={self.experts_per_token}: must be between 1 and experts={self.experts}"
                )
            if self.capacity_factor < 0:
                raise MeshkitError(
                    f"capacity_factor={self.capacity_factor}: give 0 (dropless) or a factor above 0 (1.25 is usual)"
                )
        if self.shared_ffn and not (self.experts and self.gated):
            raise MeshkitError(
                f"shared_ffn={self.shared_ffn}: a shared expert sits beside a gated mixture of experts"
            )
        if self.heads % self.kv_heads:
            raise MeshkitError(
                f"heads {self.heads} is not divisible by kv_heads {self.kv_heads}: pick kv_heads dividing it"
            )

    @property
    def q_width(self) -> int:
        """The queries' width: heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """The keys' (and the values') width: kv_heads x head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def routed(self) -> int:
        """MLPs each token passes through: ``experts_per_token`` for a mixture of experts, else 1."""
        return self.experts_per_token if self.experts else 1
