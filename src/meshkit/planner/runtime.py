"""Memory of meshkit's own compiled step for a layout (``Job(runtime="meshkit")``): the scanned
reference GPT as ``meshkit train`` and the planner's compile check build it, by the model of
``meshkit.plans.peak.predict_peak`` (and, for pipelines, ``plans._pipeline``'s stash model).

Where the standard model counts what a fused GPU implementation keeps (Korthikanti et al.), XLA's
scanned step keeps every residual the backward pass reads, each a stacked output of the loop. They
are read here from the reference block itself: ``saved_residuals`` of ``models.gpt``'s block (and
of its head and loss) traced on abstract shapes of one micro-batch (nothing allocated, no compile),
under the layout's remat policy; tensors with a heads or MLP dimension are split over tp.

Parameters stay float32 with AdamW's two float32 moments (4 + 8 bytes per parameter, bf16 only for
compute); the embedding and unembedding split over tp by their vocabulary as training places them
(``vocab_split``), whole in pipeline plans, which replicate them on every stage. Then, as ``predict_peak``: persistent (parameters at rest, optimizer state, the batch) plus
the larger of the backward phase and the update phase (the gradients with the update tree). The
backward phase holds the accumulator, the stacked layer gradients, ZeRO-3's gathered leaves and
the stash of every layer's residuals, and then the larger of what is live at three moments, each
read from XLA's live ranges at the compiled peak: the head's backward (its residuals, the top
leaves' gradient), one layer's backward inside the loop (its parameters, its gradient, under
remat its recomputed residuals), and fsdp+tp's float32 bucket of the top gradients after the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from meshkit.planner.layout import Layout, ModelShape
from meshkit.planner.sizes import attention_widths
from meshkit.plans import memory as M


def _config(shape: ModelShape, precision: str, layers: int = 1):
    from dataclasses import replace

    from meshkit.models import gpt

    return gpt.GPTConfig.from_shape(replace(shape, layers=layers), precision=precision, approximate=True)


def vocab_split(shape: ModelShape, layout: Layout) -> int:
    """The ways the GPT's token embedding and unembedding are split over the model axis, as
    ``meshkit train`` places them (``plans.tp_rules.vocab_rules``): over tp where the vocabulary
    divides (the default rules leave a dim that does not divide whole), whole under a pipeline plan."""
    return layout.tp if layout.pp == 1 and shape.vocab % layout.tp == 0 else 1


def whole_on_data(shape: ModelShape, layout: Layout) -> float:
    """Parameters of one layer, on one tensor-parallel shard, that ZeRO cannot split over data: under
    tensor parallelism the column-parallel biases (bq, bv, b_in: their one dim is on the model axis;
    the gated MLP has none)."""
    if layout.tp == 1 or shape.gated:
        return 0.0
    q, kv = attention_widths(shape)
    return (q + kv + shape.ffn) / layout.tp


def fused(job, layout: Layout, shape: ModelShape, microbatches: int = 1) -> bool:
    """Whether meshkit's step attends with a fused kernel that keeps no scores, where the job says the
    platform has one (``Job.flash_attention``): in bfloat16 (cuDNN's flash attention takes no float32),
    in the step's manual region (``plans.in_region``: a pipeline's, or the gradients' where
    it runs one) and with the query and key/value heads dividing over the model axis (splash then runs
    on each device's heads: ``plans.attention.heads_split``). Elsewhere the scores are counted: a layout
    refused rather than one that does not fit. Plain data parallelism of one micro-batch, left to the
    partitioner, attends with XLA's (compiled for v5e:2x2, a Llama of 2 layers: einsum at dp=4, splash
    under fsdp and under dp+tp with 2 micro-batches)."""
    from meshkit.plans import in_region
    from meshkit.spec import get_plan

    if not (job.flash_attention and job.precision == "bf16"):
        return False
    if shape.heads % layout.tp or shape.kv_heads % layout.tp:
        return False
    name = layout.meshkit_plan()
    if layout.pp > 1 or name is None:
        return True
    return in_region(get_plan(name), layout.batch_group > 1, layout.dp > 1, microbatches, False)


@lru_cache(maxsize=256)
def residuals(
    shape: ModelShape,
    batch: int,
    tp: int,
    precision: str,
    remat: str,
    kept: bool = True,
    vocab_tp: int = 1,
    flash: bool = False,
    sequence: int = 1,
) -> tuple[float, float, float, float]:
    """Per device, for ``batch`` sequences: (bytes one block saves under ``remat``, one block's
    matmul outputs, the block's input, what the head and loss save). ``kept``: only what a
    compiled scan keeps (``kept_residuals``); else every residual ``jax.vjp`` saves. ``vocab_tp``:
    the ways the head's vocabulary is split (``vocab_split``). ``flash``: the step attends with a fused
    kernel (splash on a TPU, ``Job.flash_attention``), which keeps no ``(seq, seq)`` scores, masks or
    probabilities but each query's float32 log-sum-exp (the block is traced with XLA's attention).
    ``sequence``: the ways sequence parallelism splits the block's input and every ``(batch, seq, x)``
    tensor not already split over tp (``Job.sequence_split``: the norms, the residual sums, the
    row-parallel outputs meshkit's step pins to the sequence split, ``plans._sequence``)."""
    block, head, layer_input = _traced(shape, batch, precision, remat)
    d, f, v = shape.width, shape.ffn, shape.vocab
    if flash:
        seq = shape.seq
        block = tuple(r for r in block if r[0][-2:] != (seq, seq))
        block += (((batch, shape.heads, seq, 1), 4, True),)  # the log-sum-exp, split over tp with the heads

    def size(dims: tuple[int, ...], itemsize: int) -> float:
        n = float(np.prod(dims)) * itemsize
        split = len(dims) == 4 or (f != d and dims[-1:] == (f,)) or len(dims) == 2
        split = split or (sequence > 1 and len(dims) == 3)  # (b, t, x) on the sequence split
        return n / tp if split else n  # heads (b,t,h,k) / (b,h,t,s), MLP width, weight copies

    def head_size(dims: tuple[int, ...], itemsize: int) -> float:  # logits and the unembedding's copy
        n = float(np.prod(dims)) * itemsize
        return n / vocab_tp if dims[-1:] == (v,) else n

    def saved(found, weights_only=False, sized=size, every=not kept) -> float:
        return sum(
            (
                sized(dims, itemsize)
                for dims, itemsize, keeps in found
                if (keeps or every) and not (weights_only and len(dims) != 2)
            ),
            0.0,
        )

    # weights: the compute-dtype copies of the matrices; the head's residuals as a compiled step keeps
    # them, in a pipeline's tick too (the loss's dead exponentials and target mask are not held there)
    return (
        saved(block),
        saved(block, weights_only=True),
        layer_input / sequence,
        saved(head, sized=head_size, every=False),
    )


@lru_cache(maxsize=64)
def _traced(shape: ModelShape, batch: int, precision: str, remat: str):
    """The residuals of one block under ``remat`` and of the head and loss, for ``batch`` sequences, as
    (dims, itemsize, whether a compiled scan keeps it) each, and the block input's bytes: traced once
    per shape, batch, precision and remat (abstract values only), whatever the tp and ``kept``. The
    block, head and loss are the shape's family's own (``_family_parts``); a block of a period of layers
    (Gemma's local and global pattern) counts each residual a period's share."""
    import jax
    import jax.numpy as jnp

    from meshkit.plans import remat_policy

    compute, block_fn, block, head_fn, top, period = _family_parts(shape, precision)
    x = jax.ShapeDtypeStruct((batch, shape.seq, shape.width), compute)
    policy = remat_policy(remat)

    def found(fn, args, share: int = 1) -> tuple:
        return tuple(
            (tuple(aval.shape), np.dtype(aval.dtype).itemsize / share, keeps)
            for aval, keeps in _residuals(fn, args)
        )

    def run(p, x):
        fn = block_fn if policy is None else jax.checkpoint(block_fn, policy=policy)
        return fn(p, x).astype(jnp.float32).sum()

    layer_input = float(np.prod(x.shape)) * compute.itemsize
    tokens = jnp.zeros((batch, shape.seq), jnp.int32)  # a constant: what only the targets make (the loss's
    # comparison with the vocabulary) the compiled backward pass makes again, as from the causal mask's iotas
    head = lambda top, x: head_fn(top, x, (tokens, tokens))  # noqa: E731
    return found(run, (block, x), period), found(head, (top, x)), layer_input


def _family_parts(shape: ModelShape, precision: str) -> tuple:
    """``(compute dtype, block function, one block's abstract parameters, head-and-loss function, the
    leaves outside the blocks, layers per block)``: the shape's family's own, from its scanned
    ``Stages``. A mixture of experts, which no family runs as ``Stages`` yet, is the reference GPT of its
    shape, its experts the GPT's."""
    import jax
    import jax.numpy as jnp

    from meshkit._errors import MeshkitError
    from meshkit.models import gpt, registry

    family = registry.family(shape.family)
    try:
        cfg = family.config.from_shape(shape, precision=precision, scan_layers=True)
        stages = family.module.stages(cfg)
    except MeshkitError:
        cfg = _config(shape, precision)
        block = jax.eval_shape(lambda: gpt._init_block(jax.random.key(0), cfg))
        top = jax.eval_shape(lambda: gpt.init(jax.random.key(0), cfg))
        top = {k: v for k, v in top.items() if k != "blocks"}

        def gpt_head(top, x, batch):
            logits = gpt._head(top, x, cfg)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[1][..., None], -1))

        def gpt_block(p, x):  # a mixture of experts: the block's output, its routing statistics dropped
            if not cfg.experts:
                return gpt._block(p, x, cfg)
            return gpt._moe_block(p, (x, jnp.zeros(2, jnp.float32)), cfg)[0]

        return jnp.dtype(cfg.compute_dtype or cfg.dtype), gpt_block, block, gpt_head, top, 1
    period = stages.period  # abstract: the whole stack costs nothing; one block's slice of it is traced
    top, blocks = stages.split(jax.eval_shape(lambda: family.module.init(jax.random.key(0), cfg)))
    one = (lambda a: a.shape[1:]) if period == 1 else (lambda a: (period, *a.shape[1:]))
    block = jax.tree.map(lambda a: jax.ShapeDtypeStruct(one(a), a.dtype), blocks)
    compute = jnp.dtype(cfg.compute_dtype or cfg.dtype)
    return (
        compute,
        stages.block,
        block,
        lambda top, x, batch: stages.loss(stages.head(top, x), batch),
        top,
        period,
    )


def kept_residuals(fn, args: tuple, everything: bool = False) -> list:
    """The residuals of ``fn``'s gradient that a compiled step keeps: those ``jax.vjp`` saves, less
    the function's own arguments, those its backward pass never reads (JAX saves both the masked
    scores and their exponential; XLA drops the dead one), and those that depend on no argument
    (the causal mask: iota compares, loop-invariant, so a scan does not stack them). Their
    abstract values (measured at 24 layers, width 2048, seq 1024, bf16: 0.35 GB per layer kept of
    the 0.44 GB ``saved_residuals`` lists, which made the fsdp peak 1.20x the compiled one).
    ``everything``: every residual but the arguments."""
    return [aval for aval, keeps in _residuals(fn, args) if everything or keeps]


def _residuals(fn, args: tuple) -> list:
    """Every residual ``jax.vjp`` of ``fn`` saves but the arguments, as (abstract value, whether a
    compiled step keeps it: see ``kept_residuals``)."""
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
        (aval, used and dep)
        for var, aval, used, dep in zip(fwd.outvars, avals, read, depends, strict=True)
        if not isinstance(var, core.Literal) and var not in inputs
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
           layers_here: int, microbatches: int, shard: int = 0) -> dict[str, float]:  # fmt: skip
    """Per-device bytes at the step's peak by component (they sum to the peak); ``shard``: the devices
    ZeRO shards over (hybrid sharding's group; 0: all of dp)."""
    rule = M.zero_stage(layout.zero)
    n = rule.shard_group(layout.dp, shard)
    zero3 = rule.shards("params") and n > 1
    b = _Bytes(layer=layers_here * params_per_layer * 4, top=top_params * 4, layers=layers_here,
               whole=layers_here * whole_on_data(shape, layout) * 4)  # fmt: skip
    at_rest = {
        "params": rule.at_rest("params", b.total, n, b.sharded),
        "optimizer": 2 * rule.at_rest("optimizer", b.total, n, b.sharded),  # AdamW's two float32 moments
        "batch": 2 * 4 * job.global_batch * shape.seq / layout.dp,
    }
    if layout.pp > 1:
        return _pipeline(shape, layout, job, b, microbatches, zero3, at_rest)
    return _step(shape, layout, job, b, microbatches, zero3, at_rest, n)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Bytes:
    """Float32 parameter bytes per device: the layers here, the leaves outside them, a layer."""

    layer: float
    top: float
    layers: int
    whole: float = 0.0
    """Of ``layer``, the leaves ZeRO keeps whole on data (``whole_on_data``)."""

    @property
    def total(self) -> float:
        return self.layer + self.top

    @property
    def sharded(self) -> float:
        """The bytes ZeRO splits over data: every leaf but ``whole``."""
        return self.total - self.whole

    @property
    def one_layer(self) -> float:
        return self.layer / max(self.layers, 1)


def _pipeline(
    shape, layout, job, b: _Bytes, microbatches: int, zero3: bool, at_rest: dict
) -> dict[str, float]:
    """A pipeline's stage: the stash of stage inputs and cotangents, one chunk recomputed, the head.
    A stage runs its chunk's forward and backward inside the tick's conditional branches: counted
    with every residual the vjp saves (under the layout's remat policy)."""
    saved, _, layer_in, head = residuals(shape, layout.microbatch_size, layout.tp, job.precision, layout.remat,
                                         kept=False, flash=fused(job, layout, shape))  # fmt: skip
    p, m, v = layout.pp, microbatches, layout.virtual_stages
    # the schedule table's slots (plans._schedule: stash x_slots, cotangents g_slots, 2 scratch)
    x_slots = m if layout.schedule == "gpipe" else min(p, m) if v == 1 else min(v * p + p - 2, v * m)
    g_slots = 1 if v == 1 else 2
    chunk = b.layers // v
    activations = (x_slots + g_slots + 2) * layer_in + chunk * saved
    working = body = 2 * b.one_layer if chunk > 1 else 0.0  # a chunk's loop: a layer's slices, its gradient
    if layout.remat != "none":
        # the backward tick recomputes one layer of its chunk at a time: that layer holds every
        # residual the block makes, its saved ones among them (so under dots a chunk of one
        # layer compiles to the step without remat; counted twice, 8 devices: 1.12-1.16); under
        # layer remat a chunk's scan stacks each block's input. As without a pipeline, the
        # recomputed layer sits beside its parameters' slices, its gradient written matrix by matrix
        # as the recomputed values die
        redo = (
            residuals(
                shape,
                layout.microbatch_size,
                layout.tp,
                job.precision,
                "none",
                False,
                1,
                fused(job, layout, shape),
            )[0]
            - saved
        )
        activations += chunk * layer_in if chunk > 1 and layout.remat == "layer" else 0.0
        working = max(body, body / 2 + redo)
    # the last stage's backward tick runs the head's backward before its chunk's: the head's
    # residuals and the logits' float32 cotangent die before the chunk's loop runs (dp+tp+pp,
    # 8 devices: 1.06 -> 1.04). That cotangent (1.3 B GPT, fsdp+tp+pp at 64 devices, the peak:
    # the head's backward, two float32 [tokens, vocab] buffers beside the chunk's residuals and
    # the float32 unembedding and its gradient) is counted once
    cotangent = 4.0 * layout.microbatch_size * shape.seq * shape.vocab
    activations += max(head + cotangent, working)
    # fsdp+pp gathers the stage's parameters once for the step, in their own dtype (the pipeline's
    # ``_gather`` casts nothing); interleaved keeps its layers permuted into schedule order beside them
    gathered = b.total if zero3 else 0.0
    relayout = b.layer if v > 1 else 0.0
    # the tick's branch returns the gradients of the leaves outside the layers (``dt`` out of
    # ``lax.switch``, every stage) beside the accumulator they are added into; and a chunk of several
    # layers (a loop) writes its gradient layer by layer into its own stacked buffer before the tick
    # adds it: one chunk's gradient more (a chunk of one layer has no loop)
    tick = b.top + (b.layer / v if chunk > 1 else 0.0)
    backward = b.total + activations + gathered + relayout + tick
    return _parts(at_rest, backward, 2 * b.total, b.total, activations, gathered)


def _step(
    shape, layout, job, b: _Bytes, microbatches: int, zero3: bool, at_rest: dict, n: int
) -> dict[str, float]:
    """Without a pipeline: a scan over micro-batches around the layers' forward scan, the head, and
    the layers' backward scan. The plan's terms are ``plans.memory``'s rules (the same the peak report
    uses); the activations are counted from the block's residuals.

    What is live together (XLA's live ranges at the peak, ``--xla_dump_to``, 8 devices, GPT 4 layers
    width 64, and 64 devices at 1.3 B): the accumulator (``memory.accumulator``); the layers' stacked
    gradient (the backward scan's output, whole; zero3: a stack of shards); the stash: each layer's
    kept residuals, and under layer remat its input (the checkpoint's argument, stacked by the scan for
    the backward pass to recompute the block from); then either the head's backward (its residuals) or
    one layer's backward inside the loop, not both: the head runs before the loop and its residuals
    die there (1.3 B GPT, 64 devices, zero3 with layer remat: predicted / compiled 1.22 -> 1.05 when
    counted apart). One layer's backward holds its parameters (sliced from the stack: a copy) and its
    gradient before it is written into the stack; under remat, while the block is recomputed and
    differentiated, its parameters and the recomputed residuals (the gradient is written matrix by
    matrix as the recomputed values die), whichever moment is larger. The head's backward computes the
    gradient of the leaves outside layers: with a whole accumulator it is added as it comes."""
    remat, m = layout.remat != "none", microbatches  # n: the devices ZeRO shards over
    from meshkit.plans import keeps_forward

    # without recomputation the backward pass reads the forward's own values, each column-parallel input
    # among them gathered whole: the sequence split saves nothing there (GPT of 4 layers, dp=2,tp=4
    # without remat: compiled 1.84 -> 1.89 MB with the split; under layer remat 1.37 -> 1.34)
    split = 1 if keeps_forward(layout.remat) else job.sequence_split(layout)
    of = lambda policy, **k: residuals(shape, layout.microbatch_size, layout.tp, job.precision, policy,  # noqa: E731
                                      flash=fused(job, layout, shape, microbatches), sequence=split, **k)  # fmt: skip
    saved, weights, layer_in, head = of(layout.remat, vocab_tp=vocab_split(shape, layout))
    rule = M.zero_stage(layout.zero)
    accumulator = M.accumulator(b.total, b.sharded, n, microbatches=m, shards_gradients=rule.shards("grads"))
    stacked = M.at_rest(b.layer, b.layer - b.whole, n, zero3)
    if zero3:  # a layer's weights are its gathered parameters, counted with them
        saved -= weights
    stash = b.layers * (saved + (layer_in if layout.remat == "layer" else 0.0))
    recomputed = of("none")[0] if remat else 0.0
    one = b.one_layer
    if not zero3:
        whole_accumulator = m > 1 and not (rule.shards("grads") and n > 1)
        top_grads = 0.0 if whole_accumulator else b.top
        working = max(2 * one, one + recomputed)
        grads = stacked + top_grads + accumulator
        backward = grads + stash + max(head + b.top - top_grads, working)
        activations = stash + max(head, recomputed)
        update = M.update_phase(b.total, 0.0, zero=layout.zero, scan=True)
        return _parts(at_rest, backward, update, grads, activations, 0.0)
    # ZeRO-3 gathers in the compute dtype (bf16 under bf16) except under tensor parallelism
    # (``Plan.gathers_in_compute_dtype``); a layer's leaves are held in the compute dtype either way
    # (fsdp+tp's model casts the float32 leaves it gathers)
    compute = (2 if job.precision == "bf16" else 4) / 4
    top = M.gathered_top(b.top, 0.0, 0.0, gather_ratio=compute if layout.tp == 1 else 1.0)
    layer = compute * one
    if not remat:  # every layer's gathered parameters are residuals of the forward pass
        gathered = top + M.zero3_layers_held(compute * b.layer, one, n, scan=True, remat="none")
        working = 2 * layer
    else:
        # each layer leaf is gathered and reduce-scattered by itself (``plans._fsdp._gather_vjp``):
        # a leaf's gathered value dies at its last use, its gradient at its reduce-scatter, so one
        # layer's parameters at a time beside the recomputed residuals
        gathered, working = top + layer, max(layer, recomputed)
    concat = 0.0
    if layout.tp > 1 and m > 1:
        # fsdp+tp reduce-scatters in float32 (``Plan.gathers_in_compute_dtype``); inside the
        # micro-batch loop the gradient of the leaves outside layers is concatenated into a
        # float32 reduce-scatter bucket beside the leaves' gradients (live ranges at the peak of
        # the 1.3 B GPT, tp=4, layer remat: a 0.53 GB concatenate beside the float32 embedding and
        # unembedding gradients); with one micro-batch XLA fuses it into the reduce-scatter. It is
        # made after the layers' backward loop, whose residuals and working set are dead by then
        concat = b.top
    grads = stacked + accumulator
    loop = stash + max(head, working)
    backward = gathered + grads + max(loop, concat)
    activations = stash + max(head, recomputed) if loop >= concat else 0.0  # the rest: "other"
    update = M.update_phase(b.total, M.at_rest(b.total, b.sharded, n, True), zero=3, scan=True)
    return _parts(at_rest, backward, update, grads, activations, gathered)


def _parts(at_rest: dict, backward: float, update: float, grads: float, activations: float,
           gathered: float) -> dict[str, float]:  # fmt: skip
    out = {"parameters": at_rest["params"], "optimizer": at_rest["optimizer"], "batch": at_rest["batch"]}
    if backward >= update:
        out.update(gradients=grads, activations=activations, gathered_parameters=gathered)
        out["other"] = backward - grads - activations - gathered
    else:
        out["update"] = update
    return out
