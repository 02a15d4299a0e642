"""``plan="auto"``: the Trainer's ZeRO ladder by meshkit's cost model, and ``meshkit train --plan auto``
through the planner's search; each says which plan and why."""

import json

import jax
import numpy as np
import optax
import pytest

from meshkit import Trainer
from meshkit.cli import main
from meshkit.models import mlp
from meshkit.planner.auto import choose_generic, choose_gpt, runnable
from meshkit.planner.layout import Layout, ModelShape
from meshkit.spec import PlanError


def test_trainer_auto_takes_dp_where_memory_is_plenty_and_says_why():
    params = mlp.init(jax.random.key(0), [16, 64, 64, 4])
    t = Trainer(mlp.loss, params, optax.adamw(1e-3), plan="auto")
    assert t.plan.name == "dp" and dict(t.mesh.shape) == {"data": 8}
    assert t.plan_choice.plan == "dp" and "fewest bytes per step" in t.plan_choice.line()
    x = np.ones((16, 16), np.float32)
    assert np.isfinite(float(t.step((x, np.zeros((16, 4), np.float32)))["loss"]))
    with pytest.raises(PlanError, match="drop mesh="):
        Trainer(mlp.loss, params, optax.adamw(1e-3), plan="auto", mesh="data=8")


def test_the_ladder_climbs_as_memory_shrinks():
    params = mlp.init(jax.random.key(0), [16, 256, 256, 4])
    total = sum(a.size * 4 for a in jax.tree.leaves(params))  # float32
    adam = optax.adamw(1e-3)
    # state per device: dp 4x the params (params, grads, two moments), zero1 2 + 2/8, zero2 1 + 3/8,
    # fsdp 4/8 (the biases of 4 do not divide: a little more)
    picks = [choose_generic(params, adam, memory_limit=2 * total * f).plan for f in (4.1, 2.3, 1.4, 0.6)]
    assert picks == ["dp", "zero1", "zero2", "fsdp"]
    with pytest.raises(Exception, match="over half of"):
        choose_generic(params, adam, memory_limit=2 * total * 0.3)


def test_gpt_auto_is_the_fastest_layout_meshkit_runs():
    shape = ModelShape(name="gpt-1.3b", layers=24, width=2048, heads=16, vocab=50304, seq=2048)
    c = choose_gpt(shape, global_batch=256, precision="bf16", devices=64, devices_per_host=8,
                   device_kind="NVIDIA H100 80GB HBM3")  # fmt: skip
    assert "as h100" in c.why and "stand-in" not in c.why and c.plan in ("dp", "zero1", "zero2", "fsdp",
                                                                        "dp+tp", "fsdp+tp", "dp+pp", "fsdp+pp",
                                                                        "tp+pp", "dp+tp+pp", "fsdp+tp+pp")  # fmt: skip
    assert not runnable(Layout(dp=2, tp=4, zero=1), shape)  # meshkit has no zero1+tp
    assert runnable(Layout(dp=8, pp=8, remat="full"), shape)
    assert not runnable(Layout(dp=4, pp=16), shape)  # 24 layers over 16 stages
    tiny = ModelShape(layers=2, width=32, heads=4, vocab=64, seq=16)
    assert "as h100, a stand-in" in choose_gpt(tiny, global_batch=16, precision="fp32").why  # 8 cpu devices


def test_meshkit_train_plan_auto_says_which_and_why(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--plan", "auto", "--steps", "2", "--eval-every", "0",
            "--sample-chars", "0", "--run-dir", str(run)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    saved = json.loads((run / "config.json").read_text())
    cfg = saved["parallel"]
    assert (
        cfg["plan"] != "auto"
        and saved["run"]["plan_reason"]
        and f"plan auto: {cfg['plan']} on {cfg['mesh']}" in out
    )
    assert json.loads((run / "report.json").read_text())["plan"] == cfg["plan"]
    bad = [
        "train",
        "--preset",
        "tiny",
        "--plan",
        "auto",
        "--mesh",
        "data=8",
        "--run-dir",
        str(tmp_path / "x"),
    ]
    assert main(bad) == 2
    assert (
        capsys.readouterr().err.strip()
        == "error: --plan auto chooses --mesh itself: drop --mesh, or name a plan"
    )
