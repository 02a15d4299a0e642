"""Each device's attention (``plans.attention``): the fused call (``jax.nn.dot_product_attention``; the
splash kernel on TPUs, run here by the Pallas interpreter) beside the written-out einsum and NumPy
float64, masks included (causal, sliding window, per-document segments), grouped-query heads as they
are; and both under every kind of plan, against one device in float64: einsum to 1e-10, fused to the
float32 digits of jax's softmax (its XLA path casts the scores to float32 whatever the input dtype, so
a fused float64 step cannot be certified closer: an Adam step amplified that noise to 1e-5 in the
parameters of dp's split batch against one device, hence one step's gradients here). A soft cap on the
scores (Gemma 2's) is written out whatever is asked: under every plan it is one device's to 1e-10."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _reference import max_rel
from _tiers import tiered
from meshkit.models import llama
from meshkit.models.token_loss import cross_entropy
from meshkit.plans import Stages, causal_attention, sequence_positions, use_attention
from meshkit.plans import attention as A
from meshkit.plans.tp_rules import vocab_rules
from meshkit.spec import ParallelSpec, PlanError, get_plan
from meshkit.train import Trainer
from meshkit.train import config as C

CFG = llama.LlamaConfig(
    vocab_size=64, seq_len=16, layers=2, width=32, heads=4, kv_heads=2, ffn=64, scan_layers=True
)
WINDOW = 5
SOFTCAP = 0.5
"""Small enough to bind: the test's scores reach about 4 (tanh(4 / 0.5) * 0.5 is 0.5, not 4)."""
MODEL_SOFTCAP = 0.02
"""Binds in the Llama below at its initial weights, whose scores are a few hundredths."""
FLOAT32_SOFTMAX = 1e-6
"""How far fused attention in float64 may be from einsum: jax's softmax in float32 (measured: 3e-7 on
the outputs; under the plans 2e-11 on the loss and 1.4e-7 on the gradients)."""


def _qkv(dtype, b=2, t=32, heads=4, kv=2, h=8, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, h)), dtype) for n in (heads, kv, kv))
    segments = jnp.asarray(np.sort(rng.integers(0, 3, size=(b, t)), axis=1), jnp.int32)
    return q, k, v, segments


def _numpy_attention(q, k, v, window, segments, softcap=None):
    """Causal attention in NumPy float64, one query at a time: the keys it sees, softmax (of the scores
    capped by ``tanh(s / softcap) * softcap`` where given), values."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, heads, h = q.shape
    groups = heads // k.shape[2]
    out = np.zeros_like(q)
    for i in range(b):
        for j in range(heads):
            for p in range(t):
                keys = [s for s in range(p + 1) if (window is None or p - s < window)
                        and (segments is None or segments[i, s] == segments[i, p])]  # fmt: skip
                scores = k[i, keys, j // groups] @ q[i, p, j] / np.sqrt(h)
                if softcap is not None:
                    scores = np.tanh(scores / softcap) * softcap
                w = np.exp(scores - scores.max())
                out[i, p, j] = (w / w.sum()) @ v[i, keys, j // groups]
    return out


@pytest.mark.parametrize(
    ("window", "segmented"), [(None, False), (WINDOW, False), (None, True), (WINDOW, True)]
)
def test_both_forms_equal_numpy_float64_masks_and_grouped_heads_included(window, segmented):
    """einsum equals NumPy float64 to 1e-12, fused to float32's softmax; their gradients agree as close."""
    with jax.enable_x64(True):
        q, k, v, segments = _qkv(jnp.float64)
        seg = segments if segmented else None
        want = _numpy_attention(q, k, v, window, None if seg is None else np.asarray(seg))
        got, grads = {}, {}
        for name in ("einsum", "fused"):
            with use_attention(name) as record:
                f = functools.partial(A.causal, window=window, segment_ids=seg)
                got[name] = np.asarray(f(q, k, v))
                grads[name] = jax.grad(lambda *x, f=f: jnp.sum(jnp.sin(f(*x))), argnums=(0, 1, 2))(q, k, v)
            assert record.used == {"einsum" if name == "einsum" else "xla"}
        assert np.max(np.abs(got["einsum"] - want)) < 1e-12
        assert 0 < np.max(np.abs(got["fused"] - want)) < FLOAT32_SOFTMAX
        assert max_rel(grads["fused"], grads["einsum"]) < 10 * FLOAT32_SOFTMAX


@pytest.mark.parametrize("window", [None, WINDOW])
def test_a_capped_attention_equals_numpy_float64_written_out_whatever_is_asked(window):
    """With ``softcap`` every implementation writes attention out (the fused call takes no cap): NumPy
    float64's to 1e-12, and the cap binds (without it the output is 1e-1 away)."""
    with jax.enable_x64(True):
        q, k, v, segments = _qkv(jnp.float64)
        want = _numpy_attention(q, k, v, window, np.asarray(segments), SOFTCAP)
        for name in ("einsum", "fused", "auto"):
            with use_attention(name) as record:
                got = np.asarray(A.causal(q, k, v, window=window, segment_ids=segments, softcap=SOFTCAP))
            assert record.used == {"einsum"} and np.max(np.abs(got - want)) < 1e-12, name
        uncapped = np.asarray(A.causal(q, k, v, window=window, segment_ids=segments))
        assert np.max(np.abs(uncapped - want)) > 1e-1


def test_in_float32_fused_and_einsum_agree_and_auto_takes_a_flash_kernel_only():
    """auto on a CPU (no flash kernel) writes attention out, as it does for float64 anywhere."""
    q, k, v, segments = _qkv(jnp.float32)
    with use_attention("einsum"):
        ref = A.causal(q, k, v, window=WINDOW, segment_ids=segments)
    with use_attention("fused") as record:
        out = A.causal(q, k, v, window=WINDOW, segment_ids=segments)
    assert record.used == {"xla"} and float(jnp.max(jnp.abs(out - ref))) < 1e-5
    with use_attention("auto") as record:
        A.causal(q, k, v)
    assert record.used == {"einsum"}


def _value_and_grads(f, q, k, v):
    return f(q, k, v), jax.grad(lambda *x: jnp.sum(jnp.sin(f(*x))), argnums=(0, 1, 2))(q, k, v)


def test_splash_kernel_interpreted_equals_einsum():
    """The TPU's splash kernel, run by the Pallas interpreter on the CPU: 384 tokens in three blocks of
    128, grouped-query heads, window and segments, forward and gradients as einsum's to float32."""
    q, k, v, segments = _qkv(jnp.float32, b=1, t=384, heads=4, kv=2, h=16, seed=1)
    for window, seg in [(None, None), (40, segments)]:
        with use_attention("einsum"):
            ref, ref_grads = _value_and_grads(
                functools.partial(A.causal, window=window, segment_ids=seg), q, k, v
            )
        f = functools.partial(A.splash, window=window, segment_ids=seg, interpret=True)
        out, grads = _value_and_grads(f, q, k, v)
        assert float(jnp.max(jnp.abs(out - ref))) < 1e-5
        assert max_rel(grads, ref_grads) < 1e-5
    assert A.splash(q[:, :100], k[:, :100], v[:, :100], interpret=True) is None  # not whole 128-token blocks


# Tiers: sweeps (moved when make test measured 22 min): the splash kernel in every layer of meshkit's step,
# its loss einsum's, is core under fsdp+tp in
# test_splash_kernel_runs_on_each_devices_heads_under_tensor_parallelism, the kernel on whole heads (no model
# axis to split them) in test_splash_kernel_interpreted_equals_einsum; fsdp's ledger and peak against the
# model with XLA's attention in test_fsdp.py's and test_peak.py's core cases.
@pytest.mark.sweep
def test_splash_kernel_under_meshkits_step_trains_as_einsum_and_keeps_ledger_and_peak(monkeypatch):
    """fsdp over the 8 CPU devices with the splash kernel (interpreted) in every layer, as a TPU runs it:
    the loss of einsum's step, the ledger equal to the model, the peak within 10% of the model."""
    cfg = llama.LlamaConfig(
        vocab_size=64, seq_len=128, layers=2, width=64, heads=4, kv_heads=2, ffn=128, scan_layers=True
    )
    params = llama.init(jax.random.key(0), cfg)
    tokens = np.random.default_rng(0).integers(0, 64, size=(8, 129)).astype(np.int32)
    batch = (tokens[:, :-1], tokens[:, 1:])
    losses = {}
    for attention in ("einsum", "fused"):
        if attention == "fused":
            monkeypatch.setattr(
                A, "_fused", lambda q, k, v, w, s, xla: (A.splash(q, k, v, interpret=True), "splash")
            )
        t = Trainer(llama.make_loss(cfg), params, optax.adamw(1e-3), plan="fsdp", mesh="data=8", attention=attention,
                    logical_axes=llama.logical_axes(params), units=llama.units(cfg), tokens_per_example=128)  # fmt: skip
        losses[attention] = float(t.step(batch)["loss"])
    assert t.assembled.attention.used == {"splash"}
    assert losses["fused"] == pytest.approx(losses["einsum"], rel=1e-6)
    r = t.report(batch)
    assert r.ok and 0.9 <= r.peak["ratio"] <= 1.1, str(r)


def test_splash_kernel_runs_on_each_devices_heads_under_tensor_parallelism(monkeypatch):
    """fsdp+tp on data=4,model=2 (the splash kernel interpreted, as a TPU runs it): the kernel runs in a
    shard_map over the model axis on each device's query and key/value heads (``heads_split``), here
    under sequence parallelism, with einsum's loss. Where the heads do not divide over the model
    axis (one key/value head on two devices) XLA's partitioner is left the attention."""
    cfg = llama.LlamaConfig(
        vocab_size=64, seq_len=128, layers=2, width=64, heads=4, kv_heads=2, ffn=128, scan_layers=True
    )
    params = llama.init(jax.random.key(0), cfg)
    tokens = np.random.default_rng(0).integers(0, 64, size=(8, 129)).astype(np.int32)
    batch = (tokens[:, :-1], tokens[:, 1:])
    splits = []

    def fused(q, k, v, w, s, xla):
        splits.append(A.heads_split(q.shape[2], k.shape[2]))
        return A.splash(q, k, v, interpret=True), "splash"

    def loss(attention, sequence_parallel=False):
        t = Trainer(llama.make_loss(cfg), params, optax.adamw(1e-3), plan="fsdp+tp", mesh="data=4,model=2",
                    attention=attention, sequence_parallel=sequence_parallel, logical_axes=llama.logical_axes(params),
                    units=llama.units(cfg), tokens_per_example=128)  # fmt: skip
        return float(t.step(batch)["loss"]), t.assembled.attention.used

    reference, _ = loss("einsum")
    monkeypatch.setattr(A, "_fused", fused)
    value, used = loss("fused", sequence_parallel=True)  # (without the split: the same shard_map)
    assert used == {"splash"} and set(splits) == {2}
    assert value == pytest.approx(reference, rel=1e-6)
    mesh = jax.make_mesh(
        (2,), ("model",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
    )
    with jax.set_mesh(mesh):
        assert A.heads_split(4, 2) == 2 and A.heads_split(4, 1) is None


# -- under the plans -------------------------------------------------------------------------------------
def _block(p, x, window, segments, cfg, softcap=None):
    """The Llama's block (``llama._block``) with a window, segments and a soft cap."""
    p = llama.cast_block(p, cfg)
    b, t, _ = x.shape
    pos = jnp.broadcast_to(sequence_positions(t), (b, t))
    q, k, v = llama.project_qkv(p["attn"], llama.rms_norm(p["attn_norm"], x, cfg.norm_eps), pos, cfg)
    out = causal_attention(q, k, v, window=window, segment_ids=segments, softcap=softcap).reshape(b, t, -1)
    x = x + out @ p["attn"]["wo"]
    return x + llama.mlp(p["mlp"], llama.rms_norm(p["mlp_norm"], x, cfg.norm_eps))


def _loss(cfg, window, segmented, pipeline, softcap=None):
    """The Llama with masks: a loss over the stacked blocks, or the same as ``Stages`` (a pipeline's)."""
    stages = Stages(embed=lambda top, b: llama.embed(top, b[0], cfg),
                    block=lambda p, x: _block(p, x, window, None, cfg, softcap), head=lambda top, x: llama.head(top, x, cfg),
                    loss=lambda logits, b: cross_entropy(logits, b[1]))  # fmt: skip
    if pipeline:
        return stages

    def loss(params, batch):
        top = {k: v for k, v in params.items() if k != "blocks"}
        seg = batch[2] if segmented else None
        block = lambda h, p: (_block(p, h, window, seg, cfg, softcap), None)  # noqa: E731
        return stages.loss(
            stages.head(top, jax.lax.scan(block, stages.embed(top, batch), params["blocks"])[0]), batch
        )

    return loss


def _batch(segmented):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, size=(8, CFG.seq_len + 1)).astype(np.int32)
    segments = np.sort(rng.integers(0, 3, size=(8, CFG.seq_len)), axis=1).astype(np.int32)
    return (tokens[:, :-1], tokens[:, 1:], *([segments] if segmented else []))


KEEP = optax.chain(optax.trace(decay=0.0), optax.scale(0.0))
"""Keeps the step's gradients as its state and moves nothing (``tests/test_axis_combos.py``'s)."""


@functools.cache
def _one_device(window, segmented, softcap=None):
    """Loss and gradients of one step on one device in float64, attention written out."""
    with jax.enable_x64(True), use_attention("einsum"):
        cfg = dataclasses.replace(CFG, dtype="float64")
        loss = jax.jit(jax.value_and_grad(_loss(cfg, window, segmented, False, softcap)))
        value, grads = loss(llama.init(jax.random.key(0), cfg), _batch(segmented))
        return float(value), jax.tree.map(np.asarray, grads)


def _step(plan, mesh, options, window, segmented, attention, softcap=None):
    """One float64 step of the plan: relative differences of its loss and gradients from one device's
    einsum step, and the kernels it traced."""
    with jax.enable_x64(True):
        cfg = dataclasses.replace(CFG, dtype="float64")
        params = llama.init(jax.random.key(0), cfg)
        spec = ParallelSpec(plan=plan, mesh=mesh, attention=attention, **options)
        t = Trainer(_loss(cfg, window, segmented, get_plan(plan).pipeline, softcap), params, KEEP, spec=spec,
                    logical_axes=llama.logical_axes(params), rules=vocab_rules(get_plan(plan)), units=llama.units(cfg))  # fmt: skip
        loss = float(t.step(_batch(segmented))["loss"])
        value, grads = _one_device(window, segmented, softcap)
        return (
            abs(loss - value) / abs(value),
            max_rel(t.opt_state[0].trace, grads),
            t.assembled.attention.used,
        )


#: (plan, mesh, options, window, segments): the batch split, ZeRO-3, the heads split (grouped kv heads
#: too), both, a pipeline, and both context forms (segments are refused under a context split)
PLANS = [
    ("dp", "data=8", {}, WINDOW, True),
    ("fsdp", "data=8", {}, WINDOW, True),
    ("dp+tp", "data=4,model=2", {}, None, True),
    ("fsdp+tp", "data=4,model=2", {}, WINDOW, True),
    ("dp+pp", "data=4,stage=2", {"microbatches": 2}, WINDOW, False),
    ("dp+cp", "data=2,context=4", {"context_attention": "all-to-all"}, WINDOW, False),
    ("cp", "context=8", {"context_attention": "ring"}, WINDOW, False),
]


# Tiers (this file): the masks are core in a pipeline (dp+pp) and under all-to-all (dp+cp); dp (each device
# one device's attention on its rows: window, segments and grouped heads core on one device, einsum and fused,
# in test_both_forms_equal_numpy_float64_masks_and_grouped_heads_included, packed segments under the batch's
# rows split over data in test_packing.py's llama-fsdp+tp-data=4,model=2), fsdp, dp+tp and fsdp+tp (the same
# attention on split parameters or heads: core in test_plans.py and the Llama's plans) sweep, as does the ring
# (cp: its window, einsum and fused asked, is core in test_each_plan_caps_the_scores_as_one_device[cp], fused
# asked written out on the ring in the scanned windows' [cp]). The cap is core on the ring's blocks (cp);
# under all-to-all (dp+cp: Gemma 2's binding caps, float64 = one device, in test_gemma.py's gemma-scan-dp+cp),
# dp and dp+pp (one device's capped call, written out whatever is asked: core in
# test_a_capped_attention_equals_numpy_float64_written_out_whatever_is_asked, in a pipeline's blocks in
# test_each_plan_attends_as_one_device_masks_included[dp+pp]) it sweeps. The scanned windows are core on the
# ring (cp), their dp and all-to-all forms sweep (all-to-all's: core in test_gemma.py's gemma-scan-dp+cp).
@pytest.mark.parametrize(
    ("plan", "mesh", "options", "window", "segmented"),
    tiered(PLANS, [p[0] for p in PLANS], core={"dp+pp", "dp+cp"}),
)
def test_each_plan_attends_as_one_device_masks_included(plan, mesh, options, window, segmented):
    """Written out, the plan's loss and gradients are one device's to 1e-10 (window and segments in
    force); fused, to the float32 digits of jax's softmax. The ring's blocks are written out whatever is
    asked (``_context._ring``): there fused is einsum."""
    dloss, dgrad, used = _step(plan, mesh, options, window, segmented, "einsum")
    assert dloss <= 1e-10 and dgrad <= 1e-10 and used == {"einsum"}, (dloss, dgrad, used)
    dloss, dgrad, used = _step(plan, mesh, options, window, segmented, "fused")
    if options.get("context_attention") == "ring":
        assert dloss <= 1e-10 and dgrad <= 1e-10 and used == {"einsum"}, (dloss, dgrad, used)
    else:
        assert dloss <= FLOAT32_SOFTMAX and 0 < dgrad <= FLOAT32_SOFTMAX and used == {"xla"}, (dloss, dgrad)


#: the soft cap under the plans whose attention differs: one device's, the ring's blocks, all-to-all, a pipeline
CAPPED = [p for p in PLANS if p[0] in ("dp", "dp+pp", "dp+cp", "cp")]


@pytest.mark.parametrize(
    ("plan", "mesh", "options", "window", "segmented"),
    tiered(CAPPED, [p[0] for p in CAPPED], core={"cp"}),
)
def test_each_plan_caps_the_scores_as_one_device(plan, mesh, options, window, segmented):
    """With ``softcap`` (Gemma 2's), einsum or fused asked, the plan's loss and gradients are one device's
    in float64 to 1e-10, written out; the cap binds (uncapped, the loss is another)."""
    for attention in ("einsum", "fused"):
        dloss, dgrad, used = _step(plan, mesh, options, window, segmented, attention, MODEL_SOFTCAP)
        assert dloss <= 1e-10 and dgrad <= 1e-10 and used == {"einsum"}, (attention, dloss, dgrad, used)
    capped, uncapped = _one_device(window, segmented, MODEL_SOFTCAP), _one_device(window, segmented)
    assert max_rel(capped[1], uncapped[1]) > 1e-2


def _alternating_loss(cfg, scanned):
    """The Llama whose first layer is windowed and second is not: scanned with each layer's kind as data
    (``causal_attention(windowed=)``), or a loop of the two static calls."""

    def block(p, x, windowed):
        p = llama.cast_block(p, cfg)
        b, t, _ = x.shape
        pos = jnp.broadcast_to(sequence_positions(t), (b, t))
        q, k, v = llama.project_qkv(p["attn"], llama.rms_norm(p["attn_norm"], x, cfg.norm_eps), pos, cfg)
        if isinstance(windowed, bool):
            out = causal_attention(q, k, v, window=WINDOW if windowed else None)
        else:
            out = causal_attention(q, k, v, window=WINDOW, windowed=windowed)
        x = x + out.reshape(b, t, -1) @ p["attn"]["wo"]
        return x + llama.mlp(p["mlp"], llama.rms_norm(p["mlp_norm"], x, cfg.norm_eps))

    def loss(params, batch):
        top = {k: v for k, v in params.items() if k != "blocks"}
        x = llama.embed(top, batch[0], cfg)
        kinds = (True, False)
        if scanned:
            body = lambda h, xs: (block(xs[0], h, xs[1]), None)  # noqa: E731
            x = jax.lax.scan(body, x, (params["blocks"], jnp.asarray(kinds)))[0]
        else:
            for i, kind in enumerate(kinds):
                x = block(jax.tree.map(lambda a, i=i: a[i], params["blocks"]), x, kind)
        return cross_entropy(llama.head(top, x, cfg), batch[1])

    return loss


@pytest.mark.parametrize(
    ("plan", "mesh", "options"),
    [pytest.param("dp", "data=8", {}, marks=pytest.mark.sweep), ("cp", "context=8", {"context_attention": "ring"}),
     pytest.param("dp+cp", "data=2,context=4", {"context_attention": "all-to-all"}, marks=pytest.mark.sweep)],
)  # fmt: skip
def test_a_window_in_some_scanned_layers_only_attends_as_their_loop_and_keeps_collectives_unconditional(
    plan, mesh, options
):
    """``windowed`` (a layer's kind scanned as data, Gemma's local and global layers): the plan's loss and
    gradients in float64 are those of the loop of static calls on one device (1e-10), fused asked
    included; in float32 the ledger equals the model (no collective of the context split under the
    choice's ``lax.cond``, which the ledger counts in both branches: a cond around the whole call measured
    2.0x on the Gemma's)."""
    with jax.enable_x64(True):
        cfg = dataclasses.replace(CFG, dtype="float64")
        params, batch = llama.init(jax.random.key(0), cfg), _batch(False)
        with use_attention("einsum"):
            value, grads = jax.jit(jax.value_and_grad(_alternating_loss(cfg, False)))(params, batch)
        for attention in ("einsum", "fused"):
            spec = ParallelSpec(plan=plan, mesh=mesh, attention=attention, **options)
            t = Trainer(_alternating_loss(cfg, True), params, KEEP, spec=spec, logical_axes=llama.logical_axes(params),
                        units=llama.units(cfg))  # fmt: skip
            loss = float(t.step(batch)["loss"])
            tol = (
                1e-10
                if attention == "einsum" or options.get("context_attention") == "ring"
                else FLOAT32_SOFTMAX
            )
            assert abs(loss - float(value)) / abs(float(value)) <= tol, (attention, loss, float(value))
            assert max_rel(t.opt_state[0].trace, grads) <= tol, attention
    params = llama.init(jax.random.key(0), CFG)  # the ledger's model is of float32 activations
    t = Trainer(_alternating_loss(CFG, True), params, KEEP, spec=ParallelSpec(plan=plan, mesh=mesh, **options),
                logical_axes=llama.logical_axes(params), units=llama.units(CFG))  # fmt: skip
    t.step(batch)
    assert all(r.ok for r in t.report(batch).communication), str(t.report(batch))


def test_refusals_name_the_fix():
    with pytest.raises(PlanError, match="unknown attention 'flash'"):
        ParallelSpec(attention="flash")
    with pytest.raises(PlanError, match="window must be a whole number"):
        A.causal(*_qkv(jnp.float32)[:3], window=0)
    with pytest.raises(PlanError, match="softcap must be a number above 0"):
        causal_attention(*_qkv(jnp.float32)[:3], softcap=0.0)
    # (segments under a context split are taken since issue 37: tests/test_packing.py)
    with pytest.raises(PlanError, match=r"segment_ids must be \(batch, sequence\) = \(2, 32\)"):
        causal_attention(*_qkv(jnp.float32)[:3], segment_ids=jnp.zeros((2, 16), jnp.int32))


def test_precision_is_resolved_by_platform_unless_given():
    cfg = C.tiny()
    assert cfg.parallel.precision is None
    assert C.by_platform(cfg, "tpu").parallel.precision == "bf16"
    assert C.by_platform(cfg, "gpu").parallel.precision == "bf16"
    assert C.by_platform(cfg, "cpu").parallel.precision == "fp32"
    assert C.by_platform(cfg.replace(precision="fp32"), "tpu").parallel.precision == "fp32"
