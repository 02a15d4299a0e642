"""A model's sizes as the planner counts them: parameters per layer and outside layers (split over
tensor parallelism), matmul FLOPs per token, activation and elementwise bytes per layer, and the
layer-micro-batches a pipeline stage holds (the conventions are stated in ``planner.predict``)."""

from __future__ import annotations

from meshkit.planner.cluster import Job
from meshkit.planner.layout import Layout, ModelShape


def attention_widths(shape: ModelShape) -> tuple[int, int]:
    """(query width, key/value width): heads x head_dim and kv_heads x head_dim."""
    return shape.q_width, shape.kv_width


def mlp_params(shape: ModelShape) -> float:
    """Parameters of one MLP of width ``ffn`` (three matrices gated, else two and their biases)."""
    d, f = shape.width, shape.ffn
    return 3 * d * f if shape.gated else 2 * d * f + f + d


def expert_params(shape: ModelShape) -> float:
    """Parameters of one layer's experts (all of them; 0 for a dense MLP)."""
    return shape.experts * mlp_params(shape)


def layer_params(shape: ModelShape, tp: int = 1, ep: int = 1) -> float:
    """Parameters of one layer on one tensor-parallel shard (matrices and their column-parallel
    biases split over tp; row-parallel biases and norms replicated). A mixture of experts holds
    ``experts / ep`` of its experts (each split over tp as a dense MLP is) and the whole router."""
    d, f, q, kv = shape.width, shape.ffn, *attention_widths(shape)
    if shape.gated:  # LLaMA: no biases, RMSNorm scales
        attention, mlp, mlp_whole, whole = 2 * d * q + 2 * d * kv, 3 * d * f, 0, 2 * d
    else:  # bq bv b_in split; bo, b_out and 2 LayerNorms whole
        attention, mlp, mlp_whole, whole = 2 * d * q + 2 * d * kv + q + kv, 2 * d * f + f, d, d + 4 * d
    if not shape.experts:
        return (attention + mlp) / tp + mlp_whole + whole
    per_device = shape.experts / ep
    shared = 3 * d * shape.shared_ffn / tp + (d if shape.shared_ffn else 0)  # its gate (D, 1) whole
    return (attention + mlp * per_device) / tp + mlp_whole * per_device + whole + d * shape.experts + shared


def embed_params(shape: ModelShape, tp: int = 1) -> float:
    """Token (and, ungated, position) embedding on the first stage; vocab split over tp."""
    return shape.vocab * shape.width / tp + (0 if shape.gated else shape.seq * shape.width)


def head_params(shape: ModelShape, tp: int = 1, *, copy: bool = False) -> float:
    """Final norm and the unembedding on the last stage, vocab split over tp: a tied head is the token
    embedding's table, counted with it, but where a stage apart from the first holds its own copy
    (``copy``: a pipeline's last stage, as Megatron keeps one)."""
    table = shape.width * shape.vocab / tp if copy or not shape.tie_embeddings else 0.0
    return table + (1 if shape.gated else 2) * shape.width


def param_count(shape: ModelShape) -> float:
    """Every parameter (a mixture of experts: all its experts and routers)."""
    return shape.layers * layer_params(shape) + embed_params(shape) + head_params(shape)


def active_param_count(shape: ModelShape) -> float:
    """Parameters one token passes through: a mixture of experts counts ``experts_per_token`` of its
    experts (Mixtral-8x7B: 12.9 B of 46.7 B); a dense model all of them."""
    unused = (shape.experts - shape.experts_per_token) * mlp_params(shape) if shape.experts else 0
    return param_count(shape) - shape.layers * unused


def layer_flops(shape: ModelShape) -> float:
    """Forward matmul FLOPs of one layer per token (the S^2 terms counted whole; a mixture of experts:
    the router and the ``experts_per_token`` experts the token is sent to, and a shared expert and its gate)."""
    d, f, q, kv = shape.width, shape.ffn, *attention_widths(shape)
    mlp = 2 * (3 if shape.gated else 2) * d * f * shape.routed + 2 * d * shape.experts
    mlp += 2 * (3 * d * shape.shared_ffn + d) if shape.shared_ffn else 0
    return 2 * (2 * d * q + 2 * d * kv) + 4 * shape.seq * q + mlp


def head_flops(shape: ModelShape) -> float:
    """Forward FLOPs of the logits per token."""
    return 2 * shape.width * shape.vocab


def model_flops_per_token(shape: ModelShape) -> float:
    """Training FLOPs per token without recompute (3 x forward): what MFU counts (a mixture of
    experts: its active parameters)."""
    return 3 * (shape.layers * layer_flops(shape) + head_flops(shape))


def layer_activation_bytes(shape: ModelShape, layout: Layout, job: Job) -> tuple[float, float, float]:
    """(all saved activations, those ``dots`` remat keeps, the layer's input) of one layer and one
    micro-batch on one device, in bytes (Korthikanti et al. 2022: 16-bit activations, 1-byte
    dropout masks where ``job.dropout``; what precedes a tensor-parallel matmul is whole unless
    ``job.sequence_parallel`` splits it).
    ``dots`` keeps the layer input and the matmul outputs (Q, K, V, attention output, the MLP's
    first matmul(s)) and recomputes the elementwise rest (norms, activation function, masks, softmax).
    Context parallelism holds ``seq / cp`` tokens of each sequence (its scores span the whole
    sequence's keys); a mixture of experts holds each token's ``experts_per_token`` MLP activations
    and the dispatched copies of its input."""
    t, e, k = layout.tp, job.act_bytes, shape.routed
    sb = shape.seq * layout.microbatch_size / layout.sequence_ways
    d, f, q, kv = shape.width, shape.ffn, *attention_widths(shape)
    split = job.sequence_split(layout)
    mask = 1 if job.dropout else 0
    replicated = sb * d * (4 * e + 2 * mask) / split  # QKV and MLP inputs, 2 norm inputs, dropout masks
    attention = sb * (q + 2 * kv + q) * e / t  # Q, K, V and the output projection's input
    mlp = (
        k * sb * f * (3 if shape.gated else 2) * e / t
    )  # GeLU: its input and output; SwiGLU: gate, up, product
    if shape.experts:  # the tokens dispatched to the experts (k copies of the MLP input)
        mlp += k * sb * d * e / split
    shared = sb * shape.shared_ffn * e / t  # a shared expert's gate, up and product (dots: gate, up)
    mlp += 3 * shared
    scores = 0.0 if job.flash_attention else sb * shape.heads * shape.seq * (2 * e + mask) / t
    full = replicated + attention + mlp + scores
    dots = sb * d * e / split + attention + k * sb * f * (2 if shape.gated else 1) * e / t + 2 * shared
    return full, dots, sb * d * e / split


def elementwise_bytes(shape: ModelShape, layout: Layout, job: Job) -> float:
    """HBM bytes the non-matmul ops of one layer's forward pass move for one micro-batch on one
    device: two norms (read and write D), two residual adds (read 2 D, write D), the MLP's
    activation function (read and write F; SwiGLU: read 2 F, write F). The backward pass moves
    about twice as much, a recomputed forward as much again: ``ELEMENTWISE`` is this per pass
    (``seq / cp`` tokens a sequence under context parallelism; a mixture of experts: k MLPs a token, and
    the permutations that gather each expert's tokens and scatter them back, read and write k D twice)."""
    split = job.sequence_split(layout)
    d, f = shape.width, shape.ffn
    return (
        layout.microbatch_size
        * shape.seq
        / layout.sequence_ways
        * job.act_bytes
        * (
            (10 + (4 * shape.experts_per_token if shape.experts else 0)) * d / split
            + (shape.routed * (3 if shape.gated else 2) * f + 3 * shape.shared_ffn) / layout.tp
        )
    )


def in_flight(layout: Layout, layers: int, m: int) -> float:
    """Layer-micro-batches whose activations the busiest device (the first stage) holds at once:
    its stage's layers times the micro-batch chunks it stashes, as meshkit's schedule tables count
    them (``plans._schedule``: GPipe m, 1F1B p, interleaved ``v p + p - 2`` chunks of ``L / (p v)``
    layers; Korthikanti et al. count one chunk more)."""
    p, v = layout.pp, layout.virtual_stages
    if p == 1:
        return float(layers)
    per_stage = -(-layers // (p * v)) * v
    if layout.schedule == "gpipe":
        return float(per_stage * m)
    if v == 1:
        return float(per_stage * min(p, m))
    return per_stage / v * min(v * p + p - 2, v * m)
