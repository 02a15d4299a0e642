"""Pipeline plans: the schedule tables on their own, the SPMD pipeline's loss and gradients against
one device (float64, and NumPy for a user model), the Trainer's plans, validation and the ledger."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshkit
from meshkit.mesh import make_mesh
from meshkit.models import gpt
from meshkit.plans import _schedule, place
from meshkit.plans._pipeline import pipeline_gradients
from meshkit.plans._schedule import BWD, FWD, IDLE
from meshkit.plans._stages import relayout_moves, stage_placement
from meshkit.spec import ParallelSpec, PlanError, get_plan

CASES = [
    (name, p, m, v)
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
    for p in (2, 4, 8)
    for m in (p, 2 * p, 4 * p)
]


def _play(s: _schedule.Schedule) -> None:
    """Run the table's data flow in NumPy: every read finds the tag its F/B needs, and the order is legal."""
    S = s.stages
    xbuf = np.full((s.p, s.x_slots + 1), -1)
    gbuf = np.full((s.p, s.g_slots + 1), -1)
    done = {}
    for t in range(s.ticks):
        send_x, send_g = np.full(s.p, -1), np.full(s.p, -1)
        for d in range(s.p):
            kind, c, j = s.kind[t, d], s.chunk[t, d], s.mb[t, d]
            st = c * s.p + d
            if kind == IDLE:
                continue
            assert (kind, st, j) not in done, "an action runs twice"
            if kind == FWD:
                if st > 0:
                    assert xbuf[d, s.x_read[t, d]] == j * S + st and done[(FWD, st - 1, j)] < t
                send_x[d] = j * S + st + 1
            else:
                assert done[(FWD, st, j)] < t
                if st > 0:
                    assert xbuf[d, s.x_read[t, d]] == j * S + st
                if st < S - 1:
                    assert gbuf[d, s.g_read[t, d]] == j * S + st and done[(BWD, st + 1, j)] < t
                send_g[d] = j * S + st - 1
            done[(kind, st, j)] = t
        for d in range(s.p):  # ring: the receiver of device d's forward is d + 1, of its backward d - 1
            xbuf[d, s.x_write[t, d]] = send_x[(d - 1) % s.p] if s.x_write[t, d] < s.x_slots else -1
            gbuf[d, s.g_write[t, d]] = send_g[(d + 1) % s.p] if s.g_write[t, d] < s.g_slots else -1
    assert len(done) == 2 * S * s.m, "every micro-batch forwarded and backwarded once per virtual stage"


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES)
def test_schedule_table_is_legal_and_reaches_the_bubble(name, p, m, v):
    s = _schedule.build(name, p, m, v)
    _play(s)
    assert s.ticks == 2 * (v * m + p - 1)
    assert _schedule.bubble_of(s.table()) == pytest.approx(_schedule.bubble_model(p, m, v), abs=0)
    in_flight = np.cumsum(s.kind == FWD, axis=0) - np.cumsum(s.kind == BWD, axis=0)
    if name == "gpipe":
        assert in_flight.max() == m and s.x_slots == m
    if name == "1f1b":  # at most p - d micro-batches in flight on device d
        assert (in_flight.max(axis=0) == np.arange(p, 0, -1)).all() and s.x_slots <= p


def test_schedule_picture_and_text(tmp_path):
    s = _schedule.build("1f1b", 4, 8)
    lines = str(s).splitlines()
    assert lines[3].split()[2:9] == [
        ".",
        ".",
        ".",
        "F0",
        "B0",
        "F1",
        "B1",
    ]  # the last stage alternates at once
    out = _schedule.plot(s.table(), tmp_path / "schedule.png", title="1f1b")
    assert out.stat().st_size > 1000


@pytest.mark.parametrize(
    ("args", "fix"),
    [
        (("nope", 2, 2, 1), "choose one of gpipe, 1f1b, interleaved"),
        (("1f1b", 4, 2, 1), "use microbatches=4 or more"),
        (("interleaved", 4, 6, 2), "use microbatches=8"),
        (("gpipe", 2, 4, 2), "schedule='interleaved'"),
    ],
)
def test_schedule_refusals_name_the_fix(args, fix):
    with pytest.raises(PlanError, match=fix):
        _schedule.build(*args)


def test_relayout_moves_every_virtual_stage_once():
    for p, v in ((2, 2), (4, 2), (2, 3), (4, 3)):
        got = sorted((c * p + d, e * v + i) for i, c, pairs in relayout_moves(p, v) for e, d in pairs)
        assert got == [(s, s) for s in range(p * v)]


# -- gradients against one device ------------------------------------------------------------------

CFG = gpt.GPTConfig(vocab_size=32, seq_len=8, layers=4, width=16, heads=2, scan_layers=True)


def _tokens(n=16, seed=0):
    tok = np.random.default_rng(seed).integers(0, CFG.vocab_size, size=(n, CFG.seq_len + 1)).astype(np.int32)
    return tok[:, :-1], tok[:, 1:]


def _pipeline_grads(stages, params, batch, mesh, plan, name, m, v=1, logical_axes=None):
    mesh = make_mesh(mesh, axis_types="auto")
    layout = stage_placement(place(params, get_plan(plan), mesh, logical_axes=logical_axes), stages)
    sched = _schedule.build(name, int(mesh.shape["stage"]), m, v)
    loss, aux, _, grads = jax.jit(pipeline_gradients(stages, layout, sched))(
        params, None, batch, jax.random.key(0)
    )
    assert np.array_equal(np.asarray(aux["schedule"]), sched.table()), "the executed record is the table"
    return loss, grads


def _max_diff(a, b):
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@functools.cache
def _float64_gpt():
    """(config, parameters, batch, loss, gradients) of the float64 GPT on one device, jitted (one
    compile, not one per op); call under ``jax.enable_x64``. Made once for the tests that compare with
    it (its arrays are read, never donated)."""
    cfg = dataclasses.replace(CFG, dtype="float64")
    params = gpt.init(jax.random.key(0), cfg)
    batch = _tokens()
    loss, grads = jax.jit(jax.value_and_grad(gpt.make_loss(cfg)))(params, batch)
    return cfg, params, batch, loss, grads


def test_gpt_loss_and_every_gradient_equal_one_device_in_float64():
    """3D: ZeRO-3 over data, Megatron over model, 1F1B over stages."""
    mesh, plan, name, m = "stage=2,data=2,model=2", "fsdp+tp+pp", "1f1b", 4
    with jax.enable_x64(True):
        cfg, params, batch, ref_loss, ref = _float64_gpt()
        loss, grads = _pipeline_grads(
            gpt.stages(cfg), params, batch, mesh, plan, name, m, logical_axes=gpt.logical_axes(params)
        )
        assert abs(float(loss) - float(ref_loss)) < 1e-13
        assert _max_diff(grads, ref) < 1e-13  # embedding and head included
        assert jax.tree.structure(grads) == jax.tree.structure(params)


# Tiers: sweeps (moved when make test measured 22 min): layer remat inside a pipeline's backward tick against
# one device, its redone all-reduces in the ledger, is core in
# test_trainer_fsdp_pp_and_tp_pp_match_one_device_and_their_model[tp+pp-stage=4,model=2-1f1b-layer], the dots
# policy's pipeline step compiled against the planner's peak in test_planner_compile.py's dp+pp remat=dots
# layout, Pipeline.working_bytes in every pipeline's report (the core cases below and the CLI's).
@pytest.mark.sweep
def test_remat_matches_one_device_in_float64_and_lowers_the_temporaries():
    """dp+pp, GPipe, 2 layers per stage: every block rematerialized (``layer``) or its matmuls kept
    (``dots``) inside the backward tick; the same loss and gradients, fewer temporaries, and the
    temporaries saved beside the model's (``Pipeline.working_bytes``: one chunk's residuals)."""
    from meshkit.analysis import memory
    from meshkit.plans import Pipeline

    with jax.enable_x64(True):
        cfg, params, batch, ref_loss, ref = _float64_gpt()
        layout = place(params, get_plan("dp+pp"), make_mesh("stage=2,data=4", axis_types="auto"))
        temps, model = {}, {}
        for remat in ("none", "layer", "dots"):
            spec = ParallelSpec(plan="dp+pp", microbatches=4, pipeline_schedule="gpipe", remat=remat)
            pipe = Pipeline.make(gpt.stages(cfg), params, layout, spec, extras={})
            compiled = jax.jit(pipe.gradients()).lower(params, None, batch, jax.random.key(0)).compile()
            loss, _, _, grads = compiled(params, None, batch, jax.random.key(0))
            assert abs(float(loss) - float(ref_loss)) < 1e-13 and _max_diff(grads, ref) < 1e-13, remat
            temps[remat], model[remat] = memory(compiled).temp_bytes, pipe.working_bytes(params, batch)
    for remat in ("layer", "dots"):
        saved, predicted = temps["none"] - temps[remat], model["none"] - model[remat]
        assert saved > 0 and 0.85 <= saved / predicted <= 1.15, (remat, temps, model)
    assert temps["layer"] < temps["dots"] < temps["none"]


def _residual_stack():
    """A user model written against the public interface: linear in, tanh residual blocks, linear out, MSE."""
    return meshkit.Stages(
        embed=lambda top, b: b[0] @ top["w_in"],
        block=lambda p, x: x + jnp.tanh(x @ p["w"] + p["b"]),
        head=lambda top, x: x @ top["w_out"],
        loss=lambda out, b: jnp.mean((out - b[1]) ** 2),
    )


def _residual_stack_numpy(params, x, y):
    """Loss and gradients by hand in NumPy float64."""
    h = [x @ params["w_in"]]
    for w, b in zip(params["blocks"]["w"], params["blocks"]["b"], strict=True):
        h.append(h[-1] + np.tanh(h[-1] @ w + b))
    out = h[-1] @ params["w_out"]
    loss = np.mean((out - y) ** 2)
    g_out = 2 * (out - y) / out.size
    grads = {"w_out": h[-1].T @ g_out, "blocks": {"w": [], "b": []}}
    g = g_out @ params["w_out"].T
    for layer in reversed(range(len(h) - 1)):
        w, b = params["blocks"]["w"][layer], params["blocks"]["b"][layer]
        pre = h[layer] @ w + b
        g_pre = g * (1 - np.tanh(pre) ** 2)
        grads["blocks"]["w"].insert(0, h[layer].T @ g_pre)
        grads["blocks"]["b"].insert(0, g_pre.sum(0))
        g = g + g_pre @ w.T
    grads["w_in"] = x.T @ g
    grads["blocks"] = {k: np.stack(v) for k, v in grads["blocks"].items()}
    return loss, grads


# Tiers: dp+pp's 1F1B over 4 stages sweeps (a user model's 1F1B over stages is core in
# test_stages_of_a_period_run_whole_periods_per_stage_and_refuse_parts_of_one, over stage=2,data=4).
@pytest.mark.parametrize(
    ("mesh", "plan", "name", "m", "v"),
    [("stage=8", "pp", "gpipe", 8, 1), ("stage=2,data=4", "dp+pp", "interleaved", 2, 2),
     pytest.param("stage=4,data=2", "dp+pp", "1f1b", 8, 1, marks=pytest.mark.sweep),
     ("stage=1,data=8", "dp+pp", "1f1b", 2, 1)],
)  # fmt: skip
def test_user_stages_model_matches_numpy_float64(mesh, plan, name, m, v):
    rng = np.random.default_rng(1)
    layers = 8 if mesh == "stage=8" else 4
    params = {"w_in": rng.normal(size=(6, 8)) / 3, "w_out": rng.normal(size=(8, 3)) / 3,
              "blocks": {"w": rng.normal(size=(layers, 8, 8)) / 3, "b": rng.normal(size=(layers, 8)) / 3}}  # fmt: skip
    x, y = rng.normal(size=(16, 6)), rng.normal(size=(16, 3))
    ref_loss, ref = _residual_stack_numpy(params, x, y)
    with jax.enable_x64(True):
        stages = _residual_stack()
        assert abs(float(stages(params, (x, y))) - ref_loss) < 1e-13  # the same model off the pipeline
        loss, grads = _pipeline_grads(stages, params, (x, y), mesh, plan, name, m, v=v)
    assert abs(float(loss) - ref_loss) < 1e-13
    assert _max_diff(grads, ref) < 1e-13


def _alternating(period: int):
    """A residual stack whose layers alternate (tanh, then sin: two kinds, as Gemma's local and global
    layers), its block one period of them (``Stages.period``), or each layer's kind by its index."""
    kinds = (jnp.tanh, jnp.sin)

    def group(p, x):
        for j, f in enumerate(kinds):
            x = x + f(x @ p["w"][j] + p["b"][j])
        return x

    return meshkit.Stages(embed=lambda top, b: b[0] @ top["w_in"], block=group, head=lambda top, x: x @ top["w_out"],
                          loss=lambda out, b: jnp.mean((out - b[1]) ** 2), period=period)  # fmt: skip


def test_stages_of_a_period_run_whole_periods_per_stage_and_refuse_parts_of_one():
    """8 layers alternating in pairs, a block a pair: 1F1B over 2 stages and interleaved over 2 x 2 virtual
    stages equal the layers run one by one in float64 (1e-13); 8 stages of one layer each are refused
    in one line naming the period and the stage axes that hold whole pairs."""
    rng = np.random.default_rng(2)
    params = {"w_in": rng.normal(size=(6, 8)) / 3, "w_out": rng.normal(size=(8, 3)) / 3,
              "blocks": {"w": rng.normal(size=(8, 8, 8)) / 3, "b": rng.normal(size=(8, 8)) / 3}}  # fmt: skip
    x, y = rng.normal(size=(16, 6)), rng.normal(size=(16, 3))

    def one_by_one(params):
        h = x @ params["w_in"]
        for i in range(8):
            h = h + (jnp.tanh, jnp.sin)[i % 2](h @ params["blocks"]["w"][i] + params["blocks"]["b"][i])
        return jnp.mean((h @ params["w_out"] - y) ** 2)

    with jax.enable_x64(True):
        ref_loss, ref = jax.value_and_grad(one_by_one)(params)
        stages = _alternating(2)
        assert abs(float(stages(params, (x, y))) - float(ref_loss)) < 1e-13
        for mesh, name, v in [("stage=2,data=4", "1f1b", 1), ("stage=2,data=4", "interleaved", 2)]:
            loss, grads = _pipeline_grads(stages, params, (x, y), mesh, "dp+pp", name, 4, v=v)
            assert abs(float(loss) - float(ref_loss)) < 1e-13 and _max_diff(grads, ref) < 1e-13, (name, v)
    with pytest.raises(
        PlanError, match=r"give each stage 1, not whole periods of 2 .* use a stage axis of 1, 2, 4$"
    ):
        meshkit.Trainer(stages, params, optax.sgd(0.1), plan="pp", mesh="stage=8", microbatches=8)
    with pytest.raises(PlanError, match="3 layers are not whole periods of 2"):
        _alternating(2)({**params, "blocks": jax.tree.map(lambda a: a[:3], params["blocks"])}, (x, y))


# -- the Trainer -----------------------------------------------------------------------------------


def _one_device_adam(steps):
    """``steps`` Adam steps (lr 1e-2) of the GPT (``gpt.init`` of key 0) on ``_tokens()`` on one device:
    the Trainer tests' reference."""
    return _one_device_adam_run()[steps]


@functools.cache
def _one_device_adam_run(most=3):
    """The parameters after 0, 1, ..., ``most`` Adam steps of ``_one_device_adam``'s run, made once for
    the Trainer tests (jitted: one compile, not one per op)."""
    opt = optax.adam(1e-2)
    params, batch = gpt.init(jax.random.key(0), CFG), _tokens()

    @jax.jit
    def step(p, s):
        updates, s = opt.update(jax.grad(gpt.make_loss(CFG))(p, batch), s, p)
        return optax.apply_updates(p, updates), s

    state, out = opt.init(params), [params]
    for _ in range(most):
        params, state = step(params, state)
        out.append(params)
    return out


# Tiers: sweeps (moved when make test measured 22 min): the interleaved schedule is core in
# test_user_stages_model_matches_numpy_float64[stage=2,data=4-dp+pp-interleaved-2-2] and
# test_stages_of_a_period_run_whole_periods_per_stage_and_refuse_parts_of_one (float64), tensor parallelism in
# a pipeline in test_gpt_loss_and_every_gradient_equal_one_device_in_float64 (fsdp+tp+pp) and tp+pp below,
# a pipeline's report (its ledger and executed schedule against the model) in
# test_trainer_fsdp_pp_and_tp_pp_match_one_device_and_their_model, a pipeline's checkpoint restored under
# fsdp and back, bit for bit, in
# test_meshkit_train_dp_pp_resumes_under_fsdp_and_back_bitwise_and_writes_the_schedule.
@pytest.mark.sweep
def test_trainer_3d_interleaved_matches_one_device_and_its_report_measures_the_schedule(tmp_path):
    """dp+tp+pp, interleaved (v=2) on stage=2,data=2,model=2, 3 Adam steps beside the same steps on
    one device; then the report, and the checkpoint restored under fsdp and back (bitwise)."""
    params = gpt.init(jax.random.key(0), CFG)
    batch = _tokens()
    kwargs = dict(plan="dp+tp+pp", mesh="stage=2,data=2,model=2", microbatches=4, pipeline_schedule="interleaved",
                  virtual_stages=2, logical_axes=gpt.logical_axes(params))  # fmt: skip
    t = meshkit.Trainer(gpt.stages(CFG), params, optax.adam(1e-2), **kwargs)
    for _ in range(3):
        t.step(batch)
    assert _max_diff(t.params, _one_device_adam(3)) < 1e-5
    assert tuple(t.params["blocks"]["attn"]["wq"].sharding.spec) == ("stage", None, "model")
    assert t.params["tok_embed"].sharding.is_fully_replicated

    r = t.report(batch)
    assert r.ok, str(r)
    rows = {(c.op, c.axes): c for c in r.communication}
    assert {("collective-permute", "stage"), ("all-reduce", "data"), ("all-reduce", "model")} <= set(rows)
    assert all(c.ratio == 1.0 for c in r.communication)
    assert r.pipeline.ticks == 18 and r.pipeline.bubble_measured == r.pipeline.bubble_model == 1 / 9
    assert r.pipeline.executed_as_planned
    assert "pipeline" in r.to_json() and "bubble" in str(r)
    with pytest.raises(PlanError, match=r"data=2 x microbatches=4: use a batch of 8 \(a multiple of 8\)"):
        t.check_examples(12)
    with pytest.raises(PlanError, match=r"data=2 x microbatches=4: use a batch of 8 \(a multiple of 8\)"):
        t.step(_tokens(12))

    t.save(tmp_path / "pp")
    opt = optax.adam(1e-2)
    fsdp = meshkit.Trainer.restore(tmp_path / "pp", gpt.stages(CFG), params, opt, plan="fsdp", mesh="data=8")
    assert fsdp.steps_done == 3 and _bitwise(fsdp.params, t.params) and _bitwise(fsdp.opt_state, t.opt_state)
    assert (
        fsdp.params["blocks"]["mlp"]["w_in"].sharding.spec != t.params["blocks"]["mlp"]["w_in"].sharding.spec
    )
    fsdp.save(tmp_path / "fsdp")
    back = meshkit.Trainer.restore(tmp_path / "fsdp", gpt.stages(CFG), params, opt, **kwargs)
    assert _bitwise(back.params, t.params) and _bitwise(back.opt_state, t.opt_state)


@pytest.mark.parametrize(
    ("plan", "mesh", "schedule", "remat"),
    [("fsdp+pp", "stage=4,data=2", "gpipe", "none"), ("tp+pp", "stage=4,model=2", "1f1b", "layer")],
)
def test_trainer_fsdp_pp_and_tp_pp_match_one_device_and_their_model(plan, mesh, schedule, remat):
    """The two plans the other tests leave out, as ``meshkit verify`` checks them (fewer steps): the
    parameters against one device, every collective and the bubble against the model (tp+pp with
    layer remat: the backward's redone output all-reduces counted)."""
    params = gpt.init(jax.random.key(0), CFG)
    batch = _tokens()
    t = meshkit.Trainer(gpt.stages(CFG), params, optax.adam(1e-2), plan=plan, mesh=mesh, pipeline_schedule=schedule,
                        remat=remat, logical_axes=gpt.logical_axes(params))  # fmt: skip
    for _ in range(2):
        t.step(batch)
    assert _max_diff(t.params, _one_device_adam(2)) < 1e-5
    r = t.report(batch)
    assert r.ok and all(c.ratio == 1.0 for c in r.communication), str(r)
    axis = "data" if plan == "fsdp+pp" else "model"
    assert {("collective-permute", "stage"), ("all-reduce" if axis == "model" else "all-gather", axis)} <= {
        (c.op, c.axes) for c in r.communication
    }


def _bitwise(a, b):
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        (dict(plan="pp", mesh="stage=8"), "4 layers do not divide over stage=8"),
        (dict(plan="dp+pp", mesh="stage=4,data=2", microbatches=2), "use microbatches=4 or more"),
        (dict(plan="dp+pp", mesh="stage=4,data=2", microbatches=4, rng=0), "does not take rng="),
        (dict(plan="dp+pp", mesh="stage=2,data=4", remat="regather"), "use remat='layer'"),
        (dict(plan="dp", mesh="data=8", microbatches=4), "are for pipeline plans"),
        (dict(plan="pp", mesh="stage=8", loss=gpt.make_loss(CFG)), "needs the model as meshkit.Stages"),
        (dict(plan="pp", mesh="stage=8", params=gpt.to_layers), r"is a list of layers: stack them"),
    ],
)
def test_trainer_refusals_name_the_fix(kwargs, fix):
    loss = kwargs.pop("loss", gpt.stages(CFG))
    params = kwargs.pop("params", lambda p: p)(gpt.init(jax.random.key(0), CFG))
    with pytest.raises(PlanError, match=fix):
        meshkit.Trainer(loss, params, optax.adam(1e-2), **kwargs)


# -- the CLI ---------------------------------------------------------------------------------------


def test_meshkit_train_dp_pp_resumes_under_fsdp_and_back_bitwise_and_writes_the_schedule(tmp_path, capsys):
    """`meshkit train --plan dp+pp` (1F1B, bf16 compute) stopped at step 2, resumed with `--plan fsdp`
    (the checkpoint's stacked blocks converted to the loop form fsdp runs) to step 3, then with
    `--plan dp+pp` to the end: at each switch the restored parameters and optimizer state are the
    saved ones, bit for bit; the finished run writes the executed schedule and its proof. The bf16
    permutes move bf16 activations, as f32 on XLA's CPU compiler (the model says so)."""
    from meshkit.cli import main
    from meshkit.train import job
    from meshkit.train import resume as R

    run = tmp_path / "run"
    pp = ["--plan", "dp+pp", "--mesh", "stage=4,data=2"]
    fsdp = ["--plan", "fsdp", "--mesh", "data=8"]
    assert main(["train", "--preset", "tiny", "--layers", "4", "--microbatches", "8", "--schedule", "1f1b",
                 "--precision", "bf16", "--steps", "4", "--eval-every", "0", "--sample-chars", "0",
                 "--run-dir", str(run), *pp, "--stop-after", "2"]) == 0, capsys.readouterr().err  # fmt: skip

    def restored(plan, mesh):
        cfg, _ = R.resumed(job.saved_config(run), {"plan": plan, "mesh": mesh}, str(run))  # as --resume does
        t = job.prepare(cfg, resume=True).trainer
        return gpt.to_form((t.params, t.opt_state), True), t  # (the stacked form, to compare; the trainer)

    saved, _ = restored("dp+pp", "stage=4,data=2")
    back, t = restored("fsdp", "data=8")
    assert isinstance(t.params["blocks"], list) and _bitwise(back, saved)
    assert main(["train", "--resume", "--run-dir", str(run), *fsdp, "--stop-after", "3"]) == 0
    saved, _ = restored("fsdp", "data=8")
    back, t = restored("dp+pp", "stage=4,data=2")
    assert t.params["blocks"]["mlp"]["w_in"].sharding.spec[0] == "stage" and _bitwise(back, saved)
    # fsdp dropped the pipeline options (said in a line): back on a pipeline, they are given again
    assert (
        main(["train", "--resume", "--run-dir", str(run), *pp, "--microbatches", "8", "--schedule", "1f1b"])
        == 0
    )
    out = capsys.readouterr().out
    assert "resume: --plan: dp+pp -> fsdp" in out and "resume: --plan: fsdp -> dp+pp" in out
    assert "resume: --microbatches: 8 -> " in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    report = json.loads((run / "report.json").read_text())
    pipe = report["pipeline"]
    assert report["checks_ok"] is True and pipe["bubble_measured"] == pipe["bubble_model"] == 3 / 11
    assert np.asarray(pipe["record"]).shape == (22, 4, 3)
    assert (run / "schedule.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["train", "--preset", "tiny", "--plan", "pp", "--mesh", "stage=8"],
            "1 layers do not divide over stage=8",
        ),
        (["train", "--preset", "tiny", "--plan", "pp", "--mesh", "stage=4,data=2"], "use dp+pp"),
        (["verify", "--plan", "dp+pp", "--model", "mlp", "--mesh", "stage=4,data=2"], "use --model gpt"),
    ],
)
def test_cli_refusals_are_one_line_naming_the_fix(tmp_path, capsys, args, message):
    from meshkit.cli import main

    assert main([*args, *(["--run-dir", str(tmp_path / "run")] if args[0] == "train" else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


# -- two processes ---------------------------------------------------------------------------------


# Tiers: sweeps; two processes under launch are core in test_multiprocess.py, pipelines' float64
# equality with one device in test_gpt_loss_and_every_gradient_equal_one_device_in_float64.
@pytest.mark.slow
@pytest.mark.sweep
def test_dp_pp_over_two_processes_one_stage_each_and_spanning_matches_one_device(tmp_path):
    """2 processes x 4 devices: stage=2,data=4 (one stage per process) and stage=4,data=2 (two stages
    per process, the pipeline spanning both), 2 Adam steps each, against the same plan in one process.
    One stage per process sums 4 data shards' gradients across processes in gloo's order, not the
    one process's: a float32 rounding that depends on the machine, so that mesh runs in float64 and
    must agree to the certificates' float64 bound (``verify.TOL_EXACT``). Spanning, every gradient
    element has at most 2 nonzero partial sums, which round alike in any order: bitwise in float32."""
    import io
    import sys
    from pathlib import Path

    from meshkit.launch import launch
    from meshkit.verify import TOL_EXACT, relative_difference

    worker = str(Path(__file__).parent / "mp" / "pipeline_worker.py")
    out = io.StringIO()
    # Measured (2 cores): 42 s CPU for the whole test, 62 s wall at load 6, 261 s wall beside two
    # `while 1: pass` burners. The job's waits are sized to that loaded run with 2x headroom, not to
    # the defaults (30 s heartbeat, 300 s start-up), which a starved process can outlast.
    loaded_wall_s = 261
    code = launch([sys.executable, worker, str(tmp_path)], 2, devices_per_process=4, env={"JAX_PLATFORMS": "cpu"},
                  output=out, timeout_s=2 * loaded_wall_s, heartbeat_timeout_s=2 * loaded_wall_s)  # fmt: skip
    assert code == 0, out.getvalue()[-3000:]
    res = {r["process"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob("result-*.json"))}
    assert sorted(res) == [0, 1] and res[0]["meshes"] == res[1]["meshes"]
    one, spanning = res[0]["meshes"]["stage=2,data=4"], res[0]["meshes"]["stage=4,data=2"]
    assert one["stage_processes"] == [[0], [1]]  # every permute crosses processes
    assert sorted(map(tuple, spanning["stage_processes"])) == [(0,), (0,), (1,), (1,)]  # two stages each
    assert one["bubble"] == 1 / 5 and spanning["bubble"] == 3 / 7  # (p-1)/(m+p-1), m=4
    for mesh, run in (("stage=2,data=4", one), ("stage=4,data=2", spanning)):  # the same plan, one process
        cfg = dataclasses.replace(CFG, dtype=run["dtype"])
        with jax.enable_x64(run["dtype"] == "float64"):
            t = meshkit.Trainer(gpt.stages(cfg), gpt.init(jax.random.key(0), cfg), optax.adam(1e-2), plan="dp+pp",
                                mesh=mesh, microbatches=4, pipeline_schedule="1f1b")  # fmt: skip
            for _ in range(2):
                t.step(_tokens())
            want = [np.asarray(a) for a in jax.tree.leaves(t.params)]
        got = [np.asarray(a, dtype=w.dtype) for a, w in zip(run["params"], want, strict=True)]
        if run["dtype"] == "float64":
            assert relative_difference(got, want) <= TOL_EXACT, mesh
        else:
            assert _bitwise(got, want), mesh
