"""The Llama family's configuration (``meshkit.models.llama``'s model): its sizes, dtypes and the switches that
make it the decoders of other families (``docs/families.md``), each checked once here. Kept apart from the model
module, which builds blocks from it, so that neither outgrows what one reader holds."""

from __future__ import annotations

import dataclasses

from meshkit._errors import MeshkitError
from meshkit.models import llama_windows
from meshkit.models.rope import LinearRope, Llama3Rope, YarnRope
from meshkit.models.shape import ModelShape
from meshkit.spec import PRECISIONS


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class LlamaConfig:
    """Sizes and dtypes of a Llama decoder. Hashable (a static argument of ``jax.jit``)."""

    vocab_size: int
    """Number of token ids."""
    seq_len: int
    """Longest sequence trained on (rotary positions extend past it; generation may go further)."""
    layers: int
    """Number of transformer blocks."""
    width: int
    """Model width D (residual stream)."""
    heads: int
    """Query heads."""
    kv_heads: int = 0
    """Key/value heads (grouped-query attention; must divide ``heads``); 0 means ``heads``."""
    head_dim: int = 0
    """Width of one head; 0 means ``width // heads``."""
    ffn: int = 0
    """Hidden width of the SwiGLU MLP; 0 means 4 x width."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding's frequencies."""
    rope_scaling: Llama3Rope | LinearRope | YarnRope | None = None
    """Llama 3.1's rescaled frequencies; None: the plain rotary."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2; none on the output projection)."""
    qk_norm: bool = False
    """An RMSNorm over each head's width on the queries and the keys before the rotary (Qwen3)."""
    qk_norm_whole: bool = False
    """An RMSNorm over all the heads' width at once on the queries and on the keys, before the rotary
    (OLMo 2's ``q_norm``, ``k_norm``; leaves ``q_width_norm`` ``(H h,)``, ``k_width_norm`` ``(K h,)``)."""
    post_norms: bool = False
    """Each sublayer's output normalised before the residual sum, its input not (OLMo 2): ``attn_norm`` and
    ``mlp_norm`` move to the outputs."""
    rotary_dim: int = 0
    """How many of each head's dims the rotary turns, the rest passing unturned (Phi-3's
    ``partial_rotary_factor x head_dim``); 0 means ``head_dim``."""
    fused: bool = False
    """Stored with fused q/k/v and gate/up tensors (Phi-3's ``qkv_proj``, ``gate_up_proj``): a checkpoint's
    layout only, split on import and fused on export; the model computes the same."""
    window: int | None = None
    """Sliding-window attention (transformers' ``sliding_window``): a position attends to itself and the
    ``window - 1`` positions before it, in the layers ``sliding`` names; None: to every earlier position."""
    sliding: tuple[bool, ...] | None = None
    """The layers the window binds in, one flag per layer (Qwen2's ``layer_types``); None: every layer.
    The scanned form runs one block function in every layer: layers of different windows take the loop form."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Use the token embedding (transposed) as the output head; no ``unembed`` leaf."""
    dtype: str = "float32"
    """Dtype of the parameters as stored and updated."""
    compute_dtype: str | None = None
    """Dtype of the forward pass; None means ``dtype``."""
    scan_layers: bool = False
    """Stack the blocks' parameters and ``lax.scan`` over them."""
    experts: int = 0
    """Mixture of experts: SwiGLU MLPs per layer, a token routed to ``experts_per_token``; 0: dense."""
    experts_per_token: int = 2
    """Mixture of experts: top-k."""
    capacity_factor: float = 1.25
    """Mixture of experts: an expert takes ``ceil(capacity_factor x T x k / experts)`` slots of a sequence;
    0: dropless (every slot runs, one grouped matmul per weight)."""
    router_renormalize: bool = False
    """Mixture of experts: the top-k gates divided by their sum (Mixtral; Qwen3-MoE's ``norm_topk_prob``)."""
    router_aux_weight: float = 0.01
    """Mixture of experts: weight of the load-balancing loss added to the cross-entropy."""
    shared_ffn: int = 0
    """Mixture of experts: hidden width of a shared SwiGLU expert every token runs beside its routed ones,
    gated by ``sigmoid(h w_shared_gate)`` (Qwen2-MoE's; leaves under ``"shared"``); 0: none."""
    dense_layers: tuple[bool, ...] | None = None
    """Mixture of experts: the layers whose MLP is dense, of width ``dense_ffn`` (Qwen3-MoE's
    ``mlp_only_layers``, ``decoder_sparse_step``); None: every layer routed. The layers form only."""
    dense_ffn: int = 0
    """Hidden width of those dense MLPs; 0 means 4 x width."""
    o_bias: bool = False
    """A bias on the attention's output projection (GPT-OSS's ``attention_bias``, beside ``qkv_bias``): leaf ``bo``."""
    sinks: bool = False
    """A learned logit per query head in every softmax, a key with no value (GPT-OSS's attention sinks): leaf
    ``sinks`` ``(H,)``. Written-out attention; refused under context plans."""
    moe_bias: bool = False
    """Mixture of experts: biases on the router's logits (``router_bias`` ``(E,)``) and on each expert's
    projections (``b_gate``, ``b_up`` ``(E, F)``, ``b_down`` ``(E, D)``), GPT-OSS's."""
    swiglu_limit: float = 0.0
    """Mixture of experts: GPT-OSS's clamped SwiGLU in the experts, ``(clip(x w_up, -l, l) + 1) g sigmoid(alpha
    g)`` with ``g = min(x w_gate, l)``; 0: the plain SwiGLU."""
    swiglu_alpha: float = 1.702
    """The clamped SwiGLU's ``alpha`` (read where ``swiglu_limit`` is set)."""
    sigmoid_router: bool = False
    """Mixture of experts: DeepSeek-V3's router (GLM-4.5's): each expert's sigmoid score, the gates those of the
    chosen (renormalised where ``router_renormalize``, times ``routed_scale``), chosen by the scores plus a held
    bias (leaf ``router_choice_bias`` ``(E,)``: its ``e_score_correction_bias``, no gradient)."""
    expert_groups: int = 1
    """Mixture of experts: DeepSeek-V3's ``n_group``: the experts in that many equal groups, a token choosing
    among the ``top_groups`` best groups only (a group ranked by its two best scores)."""
    top_groups: int = 1
    """Mixture of experts: DeepSeek-V3's ``topk_group``."""
    routed_scale: float = 1.0
    """Mixture of experts: DeepSeek-V3's ``routed_scaling_factor`` on the routed experts' gates."""
    shared_gate: bool = True
    """A shared expert's sigmoid gate (Qwen2-MoE's ``shared_expert_gate``); False: none, every token's output
    added whole (DeepSeek's, GLM-4.5's ``shared_experts``)."""
    wide_norms: bool = False
    """The RMSNorms' scale multiplied in float32 and the result cast (GPT-OSS's, as OLMo 2's with ``post_norms``);
    else in the compute dtype (the Llama's)."""

    def _check_groups(self) -> None:
        """DeepSeek-V3's groups: equal groups of at least 2 experts, the top ones holding the top-k."""
        g, top, e = self.expert_groups, self.top_groups, self.experts
        if g == top == 1 and self.routed_scale > 0:
            return
        size = e // g if e and g >= 1 else 0
        if not (
            g >= 1 and e % g == 0 and size >= 2 and 1 <= top <= g and top * size >= self.experts_per_token
        ):
            raise MeshkitError(
                f"expert_groups={g}, top_groups={top} of {e} experts (top-{self.experts_per_token}): give groups that "
                f"divide the experts into groups of at least 2, and top groups holding at least the top-k"
            )
        if not self.routed_scale > 0:
            raise MeshkitError(f"routed_scale={self.routed_scale}: give a scale above 0")

    @property
    def norms_wide(self) -> bool:
        """Whether the RMSNorms scale in float32 (``wide_norms``, or OLMo 2's ``post_norms``)."""
        return self.wide_norms or self.post_norms

    def __post_init__(self):
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim == 0:
            if self.width % self.heads:
                raise MeshkitError(
                    f"width {self.width} is not divisible by heads {self.heads}: give head_dim"
                )
            object.__setattr__(self, "head_dim", self.width // self.heads)
        for name in ("ffn", "dense_ffn"):
            object.__setattr__(self, name, getattr(self, name) or 4 * self.width)
        if self.heads % self.kv_heads:
            raise MeshkitError(
                f"heads {self.heads} is not divisible by kv_heads {self.kv_heads}: pick kv_heads dividing it"
            )
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise MeshkitError(
                f"rotary_dim {self.rotary_dim} (head_dim {self.head_dim}): rotary embeddings turn an even number "
                f"of a head's dims, at most all of them"
            )
        routed_only = {
            "moe_bias": self.moe_bias,
            "swiglu_limit": self.swiglu_limit,
            "sigmoid_router": self.sigmoid_router,
        }
        if any(routed_only.values()) and not self.experts:
            said = ", ".join(f"{k}={v}" for k, v in routed_only.items() if v)
            raise MeshkitError(f"{said} without experts: these are a mixture of experts' settings")
        if not (self.swiglu_limit >= 0 and self.swiglu_alpha > 0):
            raise MeshkitError(
                f"swiglu_limit={self.swiglu_limit}, swiglu_alpha={self.swiglu_alpha}: give a limit of at least 0 "
                f"(0: none) and an alpha above 0"
            )
        self._check_groups()
        if self.shared_ffn and not self.experts:
            raise MeshkitError(
                f"shared_ffn={self.shared_ffn} without experts: a shared expert sits beside routed ones"
            )
        if self.qk_norm and self.qk_norm_whole:
            raise MeshkitError(
                "qk_norm and qk_norm_whole both set: normalise each head, or all heads at once"
            )
        if self.experts:
            self.shape()  # ModelShape checks the mixture-of-experts fields (one owner)
        dense = llama_windows.settle_dense(self.dense_layers, self.layers, self.experts, self.scan_layers)
        object.__setattr__(self, "dense_layers", dense)
        window, sliding = llama_windows.settle(self.window, self.sliding, self.layers, self.scan_layers)
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "sliding", sliding)

    @classmethod
    def from_shape(
        cls, shape: ModelShape, *, precision: str = "fp32", scan_layers: bool = False
    ) -> LlamaConfig:
        """The Llama of ``shape`` (the planner's presets are these models): float32 parameters,
        computing in ``precision``'s dtype. A shape without a gated MLP is refused."""
        if not shape.gated:
            raise MeshkitError(f"{shape.name}: a Llama has a gated (SwiGLU) MLP; this shape is a GPT")
        return cls(
            vocab_size=shape.vocab,
            seq_len=shape.seq,
            layers=shape.layers,
            width=shape.width,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            ffn=shape.ffn,
            rope_theta=shape.rope_theta,
            norm_eps=shape.norm_eps,
            tie_embeddings=shape.tie_embeddings,
            compute_dtype=PRECISIONS[precision],
            scan_layers=scan_layers,
            experts=shape.experts,
            experts_per_token=shape.experts_per_token,
            capacity_factor=shape.capacity_factor,
            shared_ffn=shape.shared_ffn,
        )

    def shape(self, name: str = "llama") -> ModelShape:
        """This model's shape, as the planner describes models."""
        return ModelShape(
            name=name,
            family="llama",
            layers=self.layers,
            width=self.width,
            heads=self.heads,
            vocab=self.vocab_size,
            seq=self.seq_len,
            ffn=self.ffn,
            gated=True,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
            tie_embeddings=self.tie_embeddings,
            experts=self.experts,
            experts_per_token=self.experts_per_token,
            capacity_factor=self.capacity_factor,
            shared_ffn=self.shared_ffn,
        )

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's window (None: every earlier position)."""
        return tuple(self.window if s else None for s in self.sliding or (True,) * self.layers)

    @property
    def sparse_layers(self) -> int:
        """Layers whose MLP is routed (a mixture of experts'; 0 for a dense model)."""
        return (self.layers - sum(self.dense_layers or ())) if self.experts else 0

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    @property
    def compute(self) -> str:
        return self.compute_dtype or self.dtype
