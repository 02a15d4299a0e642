"""Deterministic mode: a GPT (dp, zero3) and a Llama (zero3) trained 5 steps have the same bits on 1, 2, 4 and 8 devices,
through the Trainer and through `meshkit train --deterministic`; plans it cannot make bitwise are
refused in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from meshkit import ParallelSpec, Trainer
from meshkit.cli import main
from meshkit.models import gpt, llama
from meshkit.plans._deterministic import tree_sum
from meshkit.spec import PlanError
from meshkit.train.outputs import load_run

CFG = gpt.GPTConfig(vocab_size=32, seq_len=8, layers=1, width=16, heads=2)


def batches(n=5, rows=16):
    rng = np.random.default_rng(0)
    return [(t[:, :-1], t[:, 1:]) for t in (rng.integers(0, 32, (rows, 9), dtype=np.int32) for _ in range(n))]


LLAMA = llama.LlamaConfig(vocab_size=32, seq_len=8, layers=1, width=16, heads=4, kv_heads=2)
MODELS = {"gpt": (gpt, CFG), "llama": (llama, LLAMA)}


def trained(plan, devices, model="gpt", **kw):
    module, cfg = MODELS[model]
    mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
    t = Trainer(module.make_loss(cfg), module.init(jax.random.key(0), cfg), optax.adamw(1e-2), plan=plan,
                mesh=mesh, deterministic=True, clip_norm=1.0, **kw)  # fmt: skip
    losses = [float(t.step(b)["loss"]) for b in batches()]
    return t, losses, [np.asarray(x) for x in jax.tree.leaves(jax.device_get(t.params))]


@pytest.mark.parametrize("model, plan", [("gpt", "dp"), ("gpt", "zero3"), ("llama", "zero3")])
def test_5_steps_bitwise_on_1_2_4_and_8_devices(model, plan):
    _, losses, want = trained(plan, 1, model)
    for n in (2, 4, 8):
        _, got_losses, got = trained(plan, n, model)
        assert got_losses == losses, n
        assert all(np.array_equal(a, b) for a, b in zip(want, got, strict=True)), f"{plan} on {n} devices"


def test_the_sum_is_one_binary_tree_whatever_the_blocks():
    """Adding 8 values as 8 blocks of one or 1 block of 8 (then the blocks' sums) is the same tree; a
    left-to-right sum is not: the case a psum's order would make."""
    x = np.array([1e8, 1.0, -1e8, 1.0, 3.0, 1e-3, -3.0, 7.0], np.float32)
    whole = np.asarray(tree_sum(x))
    for blocks in (1, 2, 4, 8):
        parts = np.stack([np.asarray(tree_sum(b)) for b in x.reshape(blocks, -1)])
        assert np.asarray(tree_sum(parts)).tobytes() == whole.tobytes()
    assert np.float32(sum(x)) != whole  # order matters for these values


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(plan="fsdp+tp", deterministic=True), "splits matmuls over the model axis"),
        (dict(plan="hsdp", deterministic=True), "replica axis"),
        (dict(plan="dp+cp", deterministic=True), "context axis"),
        (dict(plan="dp", deterministic=6), "power-of-two number of micro-shards"),
        (dict(plan="dp", deterministic=True, accumulate=2), "drop accumulate"),
    ],
)
def test_plans_it_cannot_fix_are_refused_in_one_line(options, message):
    with pytest.raises(PlanError, match=message) as e:
        ParallelSpec(**options)
    assert "\n" not in str(e.value)


def test_a_batch_that_does_not_cut_into_the_shards_is_refused():
    t = Trainer(gpt.make_loss(CFG), gpt.init(jax.random.key(0), CFG), optax.adam(1e-2), plan="dp",
                mesh=Mesh(np.array(jax.devices()[:2]), ("data",)), deterministic=True)  # fmt: skip
    with pytest.raises(PlanError, match="cuts the batch into 8 micro-shards: a batch of 12 examples"):
        t.check_examples(12)
    with pytest.raises(PlanError, match="losses without state"):
        Trainer(lambda p, s, b: (p["w"].sum(), s), {"w": np.ones(4, np.float32)}, optax.sgd(0.1),
                state={"n": np.zeros((), np.float32)}, plan="dp", deterministic=True)  # fmt: skip


def test_report_sets_the_measured_gather_beside_the_deterministic_model():
    t, _, _ = trained("zero3", 4)
    report = t.report(batches(1)[0])
    det = report.to_json()["deterministic"]
    assert (det["shards"], det["shards_per_device"]) == (8, 2)
    assert det["bytes_ratio"] > 1  # the gather of block sums costs more than the normal collectives
    assert report.ok, [r.to_json() for r in report.communication]
    assert "deterministic: 8 micro-shards (2 per device)" in str(report)


RUN = ["--preset", "tiny", "--deterministic", "--steps", "5", "--batch-size", "8", "--eval-every", "0",
       "--sample-chars", "0", "--checkpoint-every", "5"]  # fmt: skip


def test_meshkit_train_deterministic_same_bits_on_8_devices_and_on_2(tmp_path, capsys):
    """`meshkit train --deterministic` on 8 devices (this process) and on 2 (a process of its own)."""
    eight, two = tmp_path / "eight", tmp_path / "two"
    assert main(["train", *RUN, "--plan", "zero3", "--run-dir", str(eight)]) == 0
    out = capsys.readouterr().out
    assert "deterministic: 8 micro-shards (1 per device)" in out
    assert json.loads((eight / "report.json").read_text())["deterministic"]["shards"] == 8
    cmd = [str(Path(sys.executable).parent / "meshkit"), "train", *RUN, "--plan", "dp", "--devices", "2",
           "--run-dir", str(two)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,  # a cold compile on a busy machine
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    a, b = (jax.tree.leaves(load_run(r).params) for r in (eight, two))
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True))


def test_meshkit_train_refuses_a_plan_it_cannot_fix(tmp_path, capsys):
    code = main(
        ["train", *RUN, "--plan", "fsdp+tp", "--mesh", "data=4,model=2", "--run-dir", str(tmp_path / "r")]
    )
    assert code == 2
    err = capsys.readouterr()
    lines = [line for line in (err.out + err.err).splitlines() if "deterministic" in line]
    assert len(lines) == 1 and "model axis" in lines[0], err
    assert not (tmp_path / "r").exists()


def test_meshkit_verify_deterministic_has_the_bitwise_across_meshes_column(capsys):
    assert (
        main(["verify", "--plan", "zero3", "--model", "mlp", "--steps", "3", "--deterministic", "--json"])
        == 0
    )
    cert = json.loads(capsys.readouterr().out)
    assert cert["bitwise_across_meshes"] == {"data=1": True, "data=2": True, "data=4": True, "data=8": True}
    assert cert["checks"]["bitwise across meshes"] is True and cert["ok"] is True
    assert cert["report"]["deterministic"]["shards"] == 8
