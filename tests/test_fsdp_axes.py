"""fsdp combined with the context axis (plan fsdp+cp, issue 27): ZeRO-3 over ``data``, replicated over
``context``, whose devices each hold T/C of every sequence. Each attention form equals one device in
float64 (GPT ring, Llama all-to-all), its ledger equals the model (zero3's gathers and reduce-scatters
over data, the context axis's attention rows, the gradient shards' all-reduce over context), and
``meshkit train --plan fsdp+cp`` runs and refuses bad input in one line."""

import json

import jax
import pytest

from _reference import max_rel
from _tiers import tiered
from meshkit.cli import main
from meshkit.spec import ParallelSpec, PlanError
from test_context import _batch, _one_device_float64, _trainer
from test_moe import _ep_trainer, _one_device, _tokens

#: (model, mesh, attention form, options): the GPT's hooked blocks round the ring with two micro-batches,
#: the Llama's scanned layers by all-to-all under layer remat (the backward pass gathers again)
CP = [
    ("gpt", "data=2,context=4", "ring", {"accumulate": 2}),
    ("llama", "data=4,context=2", "all-to-all", {"remat": "layer"}),
]


# Tiers: fsdp+cp is core on the Llama's all-to-all (the ring: cp in test_attention.py's
# test_each_plan_caps_the_scores_as_one_device[cp], dp+cp in test_context.py, tp+cp in test_axis_combos.py),
# fsdp+ep on the Llama; the GPT's cases and the two meshkit train runs (the CLI's
# combinations: test_llama_cli.py's fsdp+tp run, dropped tokens: test_moe.py) sweep.
@pytest.mark.parametrize(
    ("name", "mesh", "form", "options"), tiered(CP, [f"{c[0]}-{c[2]}" for c in CP], core={"llama-all-to-all"})
)
def test_fsdp_cp_matches_one_device_in_float64_and_its_ledger_the_model(name, mesh, form, options):
    with jax.enable_x64(True):
        t = _trainer(name, "fsdp+cp", mesh, form, "float64", **options)
        for _ in range(2):
            t.step(_batch())
        assert max_rel(t.params, _one_device_float64(name, 2)) < 1e-10
    r = _trainer(name, "fsdp+cp", mesh, form, **options).report(_batch())
    assert r.ok, str(r)
    rows = {(c.op, c.axes): c for c in r.communication}
    op = "collective-permute" if form == "ring" else "all-to-all"
    assert {
        ("all-gather", "data"),
        ("reduce-scatter", "data"),
        ("all-reduce", "context"),
        (op, "context"),
    } <= set(rows)
    assert all(row.ok for row in rows.values()), str(r)  # bytes: measured / model within the check band
    for key in (("all-reduce", "context"), (op, "context")):  # one shard all-reduce; the attention's passes
        assert rows[key].measured_runs == rows[key].model_runs and rows[key].ratio == pytest.approx(1.0), str(
            r
        )
    memory = {m.component: m for m in r.memory}
    assert memory["params"].ok and memory["optimizer"].ok
    data = int(mesh.split(",")[0].split("=")[1])
    params = sum(x.nbytes for x in jax.tree.leaves(t.params))
    assert memory["params"].measured_bytes <= params / data * 1.05  # ZeRO-3 at rest: ~ 1/D per device
    assert 0.9 <= r.peak["ratio"] <= 1.1, r.peak  # the peak model composes (GPT 0.95, Llama 1.01)


def _train(capsys, *argv):
    code = main(
        ["train", "--preset", "tiny", "--steps", "1", "--eval-every", "0", "--sample-chars", "0", *argv]
    )
    _, err = capsys.readouterr()
    return code, err


@pytest.mark.sweep
def test_meshkit_train_runs_fsdp_cp_and_its_report_checks_out(tmp_path, capsys):
    code, err = _train(
        capsys, "--plan", "fsdp+cp", "--mesh", "data=4,context=2", "--run-dir", str(tmp_path / "run")
    )
    assert code == 0, err
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["plan"] == "fsdp+cp" and report["checks_ok"] is True
    ops = {(r["op"], r["axes"]) for r in report["communication"]}
    assert {("all-gather", "data"), ("reduce-scatter", "data"), ("all-reduce", "context")} <= ops


BAD = [
    (["--plan", "fsdp+cp", "--mesh", "data=8"], "plan fsdp+cp needs a mesh axis 'context'"),
    (["--plan", "fsdp", "--mesh", "data=4,context=2"], "use dp+cp or fsdp+cp"),
    (
        ["--plan", "fsdp+cp", "--mesh", "data=2,context=4", "--seq-len", "20"],
        "sequence of 20 tokens does not split into 2 x context=4",
    ),
]


@pytest.mark.parametrize(("args", "says"), BAD, ids=["no-context", "zero3-on-context", "sequence"])
def test_bad_fsdp_cp_input_is_one_line_and_exit_2(tmp_path, capsys, args, says):
    code, err = _train(capsys, *args, "--run-dir", str(tmp_path / "run"))
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run" / "report.json").exists()


def test_the_spec_declares_fsdp_cp_once():
    plan = ParallelSpec(plan="fsdp+cp").plan_info
    assert plan.shards_params and plan.context and plan.needs == ("data", "context")
    assert ParallelSpec(plan="fsdp+cp").mesh_sizes(8) == {"data": 4, "context": 2}
    with pytest.raises(PlanError, match="does not use mesh axis model=2"):
        ParallelSpec(plan="fsdp+cp", mesh="data=2,context=2,model=2")


# -- fsdp+ep ------------------------------------------------------------------------------------------
EP = [("gpt", "data=2,expert=4"), ("llama", "data=4,expert=2")]


@pytest.mark.parametrize(("name", "mesh"), tiered(EP, [c[0] for c in EP], core={"llama"}))
def test_fsdp_ep_matches_one_device_in_float64_and_its_ledger_the_model(name, mesh):
    """Dense leaves ZeRO-3 over data, expert leaves over expert: after 2 Adam steps (float64) the
    parameters and each step's dropped slots are one device's; zero3's rows over data, the dense shards'
    all-reduce over expert, the expert gradients' over data and the all_to_alls all equal the model."""
    slots = 8 * 16 * 2 * 2  # tokens x k x layers
    with jax.enable_x64(True):
        t = _ep_trainer(name, "fsdp+ep", mesh, "float64")
        dropped = [round(float(t.step(_tokens(8))["dropped_fraction"]) * slots) for _ in range(2)]
        want, want_dropped = _one_device(name, 2)
        assert max_rel(t.params, want) < 1e-10
        assert dropped == [round(d * slots) for d in want_dropped] and dropped[0] > 0
        moe = t.params["blocks"][0]["moe"]["w_in" if name == "gpt" else "w_gate"]
        assert moe.sharding.spec[0] == "expert" and "data" not in moe.sharding.spec
        assert "data" in t.params["blocks"][0]["attn"]["wq"].sharding.spec  # a dense leaf: ZeRO-3
        r = t.report(_tokens(8))
    assert r.ok, str(r)
    rows = {(c.op, c.axes): c for c in r.communication}
    assert {("all-gather", "data"), ("reduce-scatter", "data"), ("all-reduce", "expert"),
            ("all-reduce", "data"), ("all-to-all", "expert")} <= set(rows)  # fmt: skip
    assert all(row.ok for row in rows.values()), str(r)
    for key in (("all-reduce", "expert"), ("all-to-all", "expert")):
        assert rows[key].measured_runs == rows[key].model_runs and rows[key].ratio == pytest.approx(1.0), str(
            r
        )
    assert 0.9 <= r.peak["ratio"] <= 1.1, r.peak  # the peak model composes (GPT 1.03, Llama 1.00 in float32)


@pytest.mark.sweep
def test_meshkit_train_runs_fsdp_ep_with_dropped_tokens_and_its_report_checks_out(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, err = _train(capsys, "--plan", "fsdp+ep", "--mesh", "data=2,expert=4", "--experts", "8",
                       "--capacity-factor", "0.5", "--run-dir", str(run_dir))  # fmt: skip
    assert code == 0, err
    report = json.loads((run_dir / "report.json").read_text())
    assert report["plan"] == "fsdp+ep" and report["checks_ok"] is True and report["dropped_tokens"] > 0
    ops = {(r["op"], r["axes"]) for r in report["communication"]}
    assert {("all-gather", "data"), ("all-reduce", "expert"), ("all-to-all", "expert")} <= ops


BAD_EP = [
    (["--plan", "fsdp+ep", "--mesh", "data=8", "--experts", "8"], "plan fsdp+ep needs a mesh axis 'expert'"),
    (["--plan", "fsdp+ep", "--mesh", "data=2,expert=4"], "need a mixture-of-experts model: set experts"),
    (
        ["--plan", "fsdp+ep", "--mesh", "data=2,expert=4", "--experts", "6"],
        "6 experts do not divide over expert=4",
    ),
]


@pytest.mark.parametrize(("args", "says"), BAD_EP, ids=["no-expert-axis", "dense", "indivisible"])
def test_bad_fsdp_ep_input_is_one_line_and_exit_2(tmp_path, capsys, args, says):
    code, err = _train(capsys, *args, "--run-dir", str(tmp_path / "run"))
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run" / "report.json").exists()


def test_a_leaf_kept_whole_on_data_names_the_axis_it_is_split_on():
    # fsdp+ep keeps expert leaves whole on data; the report's reason said "the model axis" for them
    from meshkit.plans._zero_split import data_dim as _data_dim

    assert _data_dim((8, 4, 4), ("expert", None, None), 2, 1, two_d=False) == (
        None,
        "split on the expert axis (a leaf is not split on both axes)",
    )
    assert _data_dim((8, 4), (None, "model"), 2, 1, two_d=False)[1] == (
        "split on the model axis (a leaf is not split on both axes)"
    )
