"""Profiles: a jax.profiler trace read into time per step in compute, in each collective and exposed,
beside the ledger's bytes; through ``Trainer.profile``-made fixtures and the real ``meshkit train --profile``."""

import gzip
import json
from pathlib import Path

import pytest

from meshkit.analysis import communication
from meshkit.analysis.trace import TraceError, kind_of, summarize
from meshkit.cli import main
from meshkit.train.profile import parse_steps

FIXTURES = Path(__file__).parent / "fixtures" / "trace"
TRACE = FIXTURES / "zero3_mlp.trace.json.gz"


# -- the parser, on a trace jax.profiler wrote (tests/fixtures/trace/make.py) -----------------------
def test_fixture_trace_names_the_ledgers_collectives_with_their_times_and_bandwidth():
    ledger = communication((FIXTURES / "zero3_mlp.hlo.txt").read_text())
    s = summarize(TRACE, ledger)
    assert s.module == ledger.module == "jit_step" and len(s.steps) == 2
    assert all(step.devices == 8 for step in s.steps)
    assert {c.name: c.kind for c in s.collectives} == {r.name: r.op for r in ledger.records}
    assert s.missing == () and {"all-gather", "reduce-scatter"} <= set(s.kinds())
    assert all(c.time_s > 0 and c.runs_per_step == 1 for c in s.collectives)
    for step in s.steps:  # exposed is collective time outside compute: at most all of it, within the wall
        assert (
            0 < step.compute_s < step.wall_s and 0 < step.exposed_s <= sum(step.collective_s.values()) + 1e-12
        )
        assert sum(step.collective_s.values()) + step.compute_s <= step.wall_s * (1 + 1e-9)
    for kind, k in s.kinds().items():
        bytes_ = sum(r.total_traffic_bytes for r in ledger.records if r.op == kind)
        assert k["traffic_bytes"] == bytes_ and k["achieved_gbps"] == pytest.approx(
            bytes_ / k["time_s"] / 1e9
        )
    # without a ledger the kinds come from the names and, for XLA:CPU's psum.N, its rendezvous
    bare = summarize(TRACE)
    assert {c.name: c.kind for c in bare.collectives} == {c.name: c.kind for c in s.collectives}
    assert (
        bare.exposed_s == pytest.approx(s.exposed_s)
        and bare.to_json()["kinds"]["all-gather"]["traffic_bytes"] is None
    )


def _event(name, ts, dur, tid=1, **args):
    return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name,
            "args": {"hlo_op": name, "hlo_module": "m", "run_id": "7", **args}}  # fmt: skip


def _rendezvous(what, ts, tid):
    key = f"{what} RendezvousKey{{run_id=RunId: 7, global_devices=[0, 1]}}"
    return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": 1, "name": "Rendezvous", "args": {"name": key}}


def test_exposed_is_collective_time_not_overlapped_by_compute_on_the_same_device(tmp_path):
    events = [
        _event("while.1", 0, 100, device_ordinal="0"),  # a container: its body counts, not it
        _event("fusion.1", 0, 10, device_ordinal="0"),
        _event("all-reduce-start.2", 5, 10, tid=2, device_ordinal="0"),  # 5 us under fusion.1, 5 exposed
        _event("fusion.2", 40, 20, device_ordinal="0"),
        _event("cp.3", 50, 30, tid=2, device_ordinal="0"),  # 10 under fusion.2, 20 exposed
        _rendezvous("collective permute", 55, tid=2),  # what says cp.3 is a collective
        _rendezvous("all reduce", 20, tid=1),  # in while.1, outside its leaves: says nothing of while.1
        _event("fusion.1", 0, 60, device_ordinal="1"),
        _event("all-reduce-start.2", 60, 40, device_ordinal="1"),  # all exposed
        _event("fusion.2", 200, 5, device_ordinal="0", run_id="8"),  # an execution cut by the trace's end
        _event("all-reduce-start.2", 206, 5, device_ordinal="1", run_id="8"),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = summarize(path)
    (step,) = summary.steps
    assert summary.partial == 1 and step.run == "7"
    assert step.devices == 2 and step.wall_s == pytest.approx(100e-6)
    assert step.collective_s == pytest.approx(
        {"all-reduce": (10 + 40) / 2 * 1e-6, "collective-permute": 15e-6}
    )
    assert step.compute_s == pytest.approx((30 + 60) / 2 * 1e-6)
    assert step.exposed_s == pytest.approx((5 + 20 + 40) / 2 * 1e-6)


@pytest.mark.parametrize(
    "name, kind",
    [("all_gather.3", "all-gather"), ("reduce-scatter.12", "reduce-scatter"), ("psum.7", "all-reduce"),
     ("all-gather-done.1", "all-gather"), ("collective-permute-start", "collective-permute"),
     ("all_to_all.2", "all-to-all"), ("fusion.3", None), ("dot_general.18", None)],
)  # fmt: skip
def test_collective_kinds_read_from_names(name, kind):
    assert kind_of(name) == kind


def test_what_is_not_a_trace_is_one_clear_error(tmp_path):
    with pytest.raises(TraceError, match="no trace under"):
        summarize(tmp_path)
    (tmp_path / "x.json.gz").write_bytes(gzip.compress(b"{not json"))
    with pytest.raises(TraceError, match="cannot read trace"):
        summarize(tmp_path / "x.json.gz")
    (tmp_path / "y.json").write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(TraceError, match="no XLA op events"):
        summarize(tmp_path / "y.json")
    with pytest.raises(TraceError, match="no op events of module 'jit_other'"):
        summarize(TRACE, module="jit_other")


# -- meshkit train --profile --------------------------------------------------------------------------
@pytest.mark.parametrize("text, steps", [("5", (5, 5)), ("5-7", (5, 7)), (" 2 - 3 ", (2, 3))])
def test_profile_steps_parse(text, steps):
    assert parse_steps(text) == steps


@pytest.mark.parametrize(
    "value, message",
    [("0", "--profile '0': give a step or a range"), ("7-5", "--profile '7-5': give a step"),
     ("a", "--profile 'a': give a step"), ("11-13", "--profile 11-13: the run has 12 steps")],
)  # fmt: skip
def test_bad_profile_is_one_line_and_writes_nothing(tmp_path, capsys, value, message):
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--run-dir", str(run), "--profile", value]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not run.exists()


def test_train_profile_writes_a_tensorboard_trace_whose_summary_names_the_ledgers_collectives(
    tmp_path, capsys
):
    run = tmp_path / "run"
    args = [
        "--steps",
        "3",
        "--eval-every",
        "0",
        "--sample-chars",
        "0",
        "--profile",
        "2-3",
        "--run-dir",
        str(run),
    ]
    assert main(["train", "--preset", "tiny", *args]) == 0
    out = capsys.readouterr().out
    (trace,) = (run / "profile").glob(
        "plugins/profile/*/*.trace.json.gz"
    )  # TensorBoard's profile plugin layout
    assert list(trace.parent.glob("*.xplane.pb")) and (trace.parent / "perfetto_trace.json.gz").is_file()
    report = json.loads((run / "report.json").read_text())
    profile = report["profile"]
    assert profile == json.loads((run / "profile" / "summary.json").read_text())
    assert profile["steps"] == 2 and profile["module"] == "jit_step" and profile["missing"] == []
    assert profile["wall_s"] > 0 and profile["compute_s"] > 0 and 0 < profile["exposed_fraction"] <= 1
    # fsdp on 8 devices: a reduce-scatter and an all-gather per leaf, with the bytes the ledger reports
    measured = {row["op"]: row["measured_traffic_bytes"] for row in report["communication"]}
    assert set(measured) == {"all-gather", "reduce-scatter"} <= set(profile["kinds"])
    for op, traffic in measured.items():
        k = profile["kinds"][op]
        assert k["time_s"] > 0 and k["traffic_bytes"] == pytest.approx(traffic) and k["achieved_gbps"] > 0
    per_leaf = [c for c in profile["collectives"] if c["kind"] == "reduce-scatter"]
    assert len(per_leaf) > 1 and all(c["time_s"] > 0 for c in per_leaf)
    assert "profile: 2 step(s) of jit_step" in out and "exposed communication" in out


def test_trainer_profile_traces_its_steps_beside_the_ledger_of_their_executable(tmp_path):
    import jax
    import jax.numpy as jnp
    import optax

    import meshkit

    def loss_fn(p, b):
        return jnp.mean((jnp.tanh(b @ p["w"]) - 1.0) ** 2)

    params = {"w": jax.random.normal(jax.random.key(0), (16, 32))}
    batch = jax.random.normal(jax.random.key(1), (32, 16))
    trainer = meshkit.Trainer(loss_fn, params, optax.sgd(0.1), plan="dp", mesh="data=8")
    trainer.step(batch)  # an untraced step still running as tracing starts is waited for, not half-traced
    profile = trainer.profile([batch, batch, batch], tmp_path / "p")
    assert profile.trace.parent.parent == tmp_path / "p" / "plugins" / "profile" and len(profile.metrics) == 3
    s, ledger = profile.summary, communication(trainer.last_compiled)
    assert trainer.steps_done == 4 and len(s.steps) == 3 and s.partial == 0 and s.missing == ()
    assert {c.name for c in s.collectives} == {r.name for r in ledger.records} and set(s.kinds()) == {
        "all-reduce"
    }
    with pytest.raises(meshkit.PlanError, match="at least one batch"):
        trainer.profile([], tmp_path / "q")
