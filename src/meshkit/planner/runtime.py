"""Memory of meshkit's own compiled step for a layout (``Job(runtime="meshkit")``): the scanned
reference GPT as ``meshkit train`` and the planner's compile check build it, by the model of
``meshkit.analysis.peak.predict_peak`` (and, for pipelines, ``plans._pipeline``'s stash model).

Where the standard model counts what a fused GPU implementation keeps (Korthikanti et al.), XLA's
scanned step keeps every residual the backward pass reads, each a stacked output of the loop. They
are read here from the reference block itself: ``saved_residuals`` of ``models.gpt``'s block (and
of its head and loss) traced on abstract shapes of one micro-batch (nothing allocated, no compile),
under the layout's remat policy; tensors with a heads or MLP dimension are split over tp.

Parameters stay float32 with AdamW's two float32 moments (4 + 8 bytes per parameter, bf16 only for
compute); embeddings and unembedding are not split over tp; pipeline plans replicate them on every
stage. Then, as ``predict_peak``: persistent (parameters at rest, optimizer state, the batch) plus
the larger of the backward phase (gradients, two layers of loop buffers, ZeRO-3's gathered
parameters, activations) and the update phase (the gradients with the update tree).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from meshkit.planner.layout import Layout, ModelShape


def _config(shape: ModelShape, precision: str, layers: int = 1):
    from meshkit.models import gpt

    return gpt.GPTConfig(vocab_size=shape.vocab, seq_len=shape.seq, layers=layers, width=shape.width,
                         heads=shape.heads, mlp_ratio=max(shape.ffn // shape.width, 1),
                         compute_dtype="bfloat16" if precision == "bf16" else None)  # fmt: skip


@lru_cache(maxsize=256)
def residuals(
    shape: ModelShape, batch: int, tp: int, precision: str, remat: str, kept: bool = True
) -> tuple[float, float, float, float]:
    """Per device, for ``batch`` sequences: (bytes one block saves under ``remat``, one block's
    matmul outputs, the block's input, what the head and loss save). ``kept``: only what a
    compiled scan keeps (``kept_residuals``); else every residual ``jax.vjp`` saves."""
    import jax
    import jax.numpy as jnp

    from meshkit.models import gpt
    from meshkit.plans._fsdp import REMAT

    cfg = _config(shape, precision)
    compute = jnp.dtype(cfg.compute_dtype or cfg.dtype)
    x = jax.ShapeDtypeStruct((batch, shape.seq, shape.width), compute)
    block = jax.eval_shape(lambda: gpt._init_block(jax.random.key(0), cfg))
    d, f = shape.width, shape.ffn

    def size(aval) -> float:
        n = float(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
        split = len(aval.shape) == 4 or (f != d and aval.shape[-1:] == (f,)) or len(aval.shape) == 2
        return n / tp if split else n  # heads (b,t,h,k) / (b,h,t,s), MLP width, weight copies

    def saved(fn, args, weights_only=False) -> float:
        total = 0.0
        for aval in kept_residuals(fn, args, everything=not kept):
            if weights_only and len(aval.shape) != 2:
                continue
            total += size(aval)
        return total

    policy = REMAT[remat]

    def run(p, x):
        fn = (
            (lambda p, x: gpt._block(p, x, cfg))
            if policy is None
            else jax.checkpoint(lambda p, x: gpt._block(p, x, cfg), policy=policy)
        )
        return fn(p, x).astype(jnp.float32).sum()

    layer = saved(run, (block, x))
    weights = saved(run, (block, x), weights_only=True)  # compute-dtype copies of the matrices
    layer_input = float(np.prod(x.shape)) * compute.itemsize
    top = jax.eval_shape(lambda: gpt.init(jax.random.key(0), _config(shape, precision)))
    top = {k: v for k, v in top.items() if k != "blocks"}
    targets = jnp.zeros((batch, shape.seq), jnp.int32)

    def head(top, x):  # the unembedding and a cross-entropy, as the GPT's loss ends
        logits = gpt._head(top, x, cfg)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))

    head_b = saved(head, (top, x))
    return layer, weights, layer_input, head_b


def kept_residuals(fn, args: tuple, everything: bool = False) -> list:
    """The residuals of ``fn``'s gradient that a compiled step keeps: those ``jax.vjp`` saves, less
    the function's own arguments, those its backward pass never reads (JAX saves both the masked
    scores and their exponential; XLA drops the dead one), and those that depend on no argument
    (the causal mask: iota compares, loop-invariant, so a scan does not stack them). Their
    abstract values (measured at 24 layers, width 2048, seq 1024, bf16: 0.35 GB per layer kept of
    the 0.44 GB ``saved_residuals`` lists, which made the fsdp peak 1.20x the compiled one).
    ``everything``: every residual but the arguments."""
    import jax
    import jax.numpy as jnp
    from jax._src import core
    from jax._src.interpreters import partial_eval as pe

    tree = {}

    def forward(*a):
        _, vjp = jax.vjp(fn, *a)
        leaves, tree["def"] = jax.tree.flatten(vjp)
        return leaves

    fwd = jax.make_jaxpr(forward)(*args).jaxpr
    avals = [v.aval for v in fwd.outvars]
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    one = jnp.ones((), jnp.float32)
    bwd = jax.make_jaxpr(lambda r: jax.tree.unflatten(tree["def"], r)(one))(shapes).jaxpr
    _, read = pe.dce_jaxpr(bwd, [True] * len(bwd.outvars))
    depends = _depends(fwd, [True] * len(fwd.invars))
    inputs = set(fwd.invars)
    return [
        aval
        for var, aval, used, dep in zip(fwd.outvars, avals, read, depends, strict=True)
        if (everything or (used and dep)) and not isinstance(var, core.Literal) and var not in inputs
    ]


def _depends(jaxpr, inputs: list[bool]) -> list[bool]:
    """Which outputs of ``jaxpr`` depend on the inputs flagged (through nested jit calls, where a
    mask built from iotas is broadcast inside ``jnp.where``'s own jit)."""
    from jax._src import core

    dep = {v for v, d in zip(jaxpr.invars, inputs, strict=True) if d}
    for eqn in jaxpr.eqns:
        ins = [not isinstance(v, core.Literal) and v in dep for v in eqn.invars]
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        sub = getattr(sub, "jaxpr", sub)
        if (
            isinstance(sub, core.Jaxpr)
            and len(sub.invars) == len(ins)
            and len(sub.outvars) == len(eqn.outvars)
        ):
            outs = _depends(sub, ins)
        else:
            outs = [any(ins)] * len(eqn.outvars)
        dep.update(v for v, d in zip(eqn.outvars, outs, strict=True) if d)
    return [not isinstance(v, core.Literal) and v in dep for v in jaxpr.outvars]


def memory(shape: ModelShape, layout: Layout, job, params_per_layer: float, top_params: float,
           layers_here: int, microbatches: int) -> dict[str, float]:  # fmt: skip
    """Per-device bytes at the step's peak by component (they sum to the peak)."""
    n, zero3 = layout.dp, layout.zero == 3 and layout.dp > 1
    layer_b = layers_here * params_per_layer * 4
    top_b = top_params * 4
    total = layer_b + top_b
    params = total / n if zero3 else total
    optimizer = 2 * (total / n if layout.zero >= 1 and n > 1 else total)  # AdamW's two float32 moments
    batch = 2 * 4 * job.global_batch * shape.seq / n
    # a pipeline's stage runs its chunk's forward and backward inside the tick's conditional
    # branches: counted with every residual the vjp saves (under the layout's remat policy)
    pipe = layout.pp > 1
    saved, weights, layer_in, head = residuals(shape, layout.microbatch_size, layout.tp, job.precision,
                                               layout.remat, kept=not pipe)  # fmt: skip
    one_layer = layer_b / max(layers_here, 1)
    if layout.pp > 1:  # the stash of stage inputs and cotangents, one chunk recomputed, the head
        p, m, v = layout.pp, microbatches, layout.virtual_stages
        # the schedule table's slots (plans._schedule: stash x_slots, cotangents g_slots, 2 scratch)
        x_slots = m if layout.schedule == "gpipe" else min(p, m) if v == 1 else min(v * p + p - 2, v * m)
        g_slots = 1 if v == 1 else 2
        chunk = layers_here // v
        activations = (x_slots + g_slots + 2) * layer_in + chunk * saved
        if layout.remat != "none":  # the backward tick recomputes one layer of its chunk at a time
            mb, t = layout.microbatch_size, layout.tp
            activations += residuals(shape, mb, t, job.precision, "none", kept=False)[0]
        body = 2 * one_layer if chunk > 1 else 0.0  # the loop over a chunk's layers keeps two in buffers
        # fsdp+pp gathers the stage's parameters once for the step, in their own dtype (float32: the
        # pipeline's ``_gather`` casts nothing; 1.3 B at 64 devices, bf16, fsdp+tp+pp: 1.40 -> 1.23
        # compiled / predicted); interleaved keeps its layers permuted into schedule order beside them
        gathered = total if zero3 else 0.0
        relayout = layer_b if v > 1 else 0.0
        # the tick's branch returns the gradients of the leaves outside the layers (``dt`` out of
        # ``lax.switch``, every stage: embeddings, unembedding, final norm) beside the accumulator
        # they are added into; and a chunk of several layers (a loop) writes its gradient layer by
        # layer into its own stacked buffer (a dynamic-update-slice, 0.2 GB per matrix at the peak of
        # the 1.3 B GPT's fsdp+tp+pp step) before the tick adds it: one chunk's gradient more (a
        # chunk of one layer has no loop). 1.3 B at 64 devices, fsdp+tp+pp with pp=2 and pp=4:
        # 1.23-1.40 -> within 10% compiled / predicted
        tick = top_b + (layer_b / v if chunk > 1 else 0.0)
        backward = total + body + activations + head + gathered + relayout + tick
        return _parts(params, optimizer, batch, backward, 2 * total, total, activations + head, gathered)
    # gradient accumulation (m > 1 micro-batches without a pipeline): the scan over micro-batches
    # carries the summed gradients beside each micro-batch's own, whole under dp and zero1 (reduced
    # once at the end), a shard under zero2 and zero3 (reduce-scattered per micro-batch)
    accumulator = 0.0 if microbatches == 1 else total / n if layout.zero >= 2 and n > 1 else total
    if zero3:  # a layer's weights are its gathered parameters, counted with them
        saved -= weights
    # the saved residuals of every layer; under remat one layer's residuals recreated on top (in
    # the scan every one of them: XLA does not fuse across the loop body's recomputation). The
    # head's backward runs before the layers' loop and its residuals die there: under remat the
    # peak holds the larger of the two, not both (1.3 B GPT, 64 devices, zero3 with layer remat:
    # predicted / compiled 1.22 -> 1.05, with dots 1.09 -> 1.02)
    if layout.remat != "none":
        recomputed = residuals(shape, layout.microbatch_size, layout.tp, job.precision, "none")[0]
        activations = layers_here * saved + max(recomputed, head)
    else:
        activations = layers_here * saved + head
    body = (1 if zero3 and layout.remat != "none" else 2) * one_layer  # the scan's loop buffers
    if zero3:  # gathered in the compute dtype (bf16 gathers under bf16)
        g = (2 if job.precision == "bf16" else 4) / 4
        # the leaves outside layers, gathered for the step: bucket, slices and whole gradient in the
        # compute dtype; in float32 nothing is cast and the slices are views of the bucket (8
        # devices fp32, zero3 and fsdp+tp: 1.04 and 1.06 -> 1.00 and 1.01 predicted / compiled)
        top = 2 * top_b if g == 1 else 3 * g * top_b
        gathered = top + g * (layer_b if layout.remat == "none" else 2 * one_layer)
        body *= g
        if layout.tp > 1 and microbatches > 1:
            # fsdp+tp reduce-scatters in float32 (``Plan.gathers_in_compute_dtype``); inside the
            # micro-batch loop the gradient of the leaves outside layers is concatenated into a
            # float32 reduce-scatter bucket beside the leaves' gradients (live ranges at the peak of
            # the 1.3 B GPT, tp=4, layer remat: a 0.53 GB concatenate beside the float32 embedding and
            # unembedding gradients): bf16 1.31 -> 0.98 compiled / predicted; with one micro-batch
            # XLA fuses it into the reduce-scatter
            gathered += top_b
        grads = layer_b / n + body + accumulator
        backward = gathered + grads + activations
        update = 2 * total / n
        return _parts(params, optimizer, batch, backward, update, grads, activations, gathered)
    grads = total + body + accumulator
    backward = grads + activations
    update = total if layout.zero == 0 else 2 * total
    return _parts(params, optimizer, batch, backward, update, grads, activations, 0.0)


def _parts(params, optimizer, batch, backward, update, grads, activations, gathered) -> dict[str, float]:
    out = {"parameters": params, "optimizer": optimizer, "batch": batch}
    if backward >= update:
        out.update(gradients=grads, activations=activations, gathered_parameters=gathered)
        out["other"] = backward - grads - activations - gathered
    else:
        out["update"] = update
    return out
