"""``benchmarks/device_check.py`` (the accelerator check: meshkit's step beside a hand-written one, MFU,
memory beside the peak model, fused vs einsum attention, exposed communication) at its tiny size on the
8 CPU devices, so that the command the accelerator runs cannot rot: its JSON holds every figure, the
step times are positive, and the steps compute the same losses."""

import importlib.util
import json
from pathlib import Path

import pytest

CHECK = Path(__file__).resolve().parent.parent / "benchmarks" / "device_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("device_check", CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_check_runs_at_tiny_size_and_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "check.json"
    _module().main(["--size", "tiny", "--steps", "2", "--warmup", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    table = capsys.readouterr().out
    for row in ("meshkit_fused", "hand_fused", "meshkit_einsum", "meshkit / hand step time", "peak memory"):
        assert row in table
    assert report["platform"] == "cpu" and report["precision"] == "fp32" and report["devices"] == 8
    assert report["size"] == "tiny" and report["plan"] == "fsdp" and report["mesh"] == {"data": 8}
    runs = report["runs"]
    for name in ("meshkit_fused", "hand_fused", "meshkit_einsum"):
        assert runs[name]["tokens_per_s"] > 0 and runs[name]["step_s"] > 0 and runs[name]["compile_s"] > 0
    assert runs["meshkit_fused"]["kernels"] == ["xla"] and runs["meshkit_einsum"]["kernels"] == ["einsum"]
    assert report["meshkit_over_hand_step_time"] > 0 and report["einsum_over_fused_step_time"] > 0
    assert report["loss_meshkit_vs_hand"] <= 1e-5 and report["loss_fused_vs_einsum"] <= 1e-5
    assert runs["meshkit_fused"]["first_loss"] == pytest.approx(5.55, abs=0.1)  # log(256): random tokens
    memory = report["memory"]
    assert memory["compiled_bytes"] > 0 and memory["predicted_bytes"] > 0
    assert 0.5 < memory["compiled_over_predicted"] < 2
    assert report["mfu"] is None and report["peak_flops_per_device"] is None  # a CPU: no peak in the table
    assert (
        report["exposed_communication_fraction"] is None or 0 <= report["exposed_communication_fraction"] <= 1
    )
    assert report["choices"] and all(c["fits"] for c in report["choices"])  # no memory limit on a CPU


@pytest.mark.sweep
def test_the_int8_benchmark_runs_at_tiny_size_both_ways(tmp_path, monkeypatch):
    """``bench_quantize.py`` (``device_check.py --quantize`` on the chip): bf16 and int8 side by side, their
    ratio, and a few steps on text of each, so that the prepared command cannot rot."""
    monkeypatch.syspath_prepend(str(CHECK.parent))  # as run from benchmarks/: it imports bench_loss_chunk
    import bench_quantize

    speed = bench_quantize.main(["--size", "tiny", "--seq", "128", "--batch", "2", "--remat", "dots",
                                 "--steps", "1", "--out", str(tmp_path / "speed.json")])  # fmt: skip
    assert [r["quantize"] for r in speed["rows"]] == ["none", "int8"]
    assert all(r["tokens_per_s"] > 0 for r in speed["rows"]) and speed["int8_over_bf16_tokens_per_s"] > 0
    a, b = (r["first_loss"] for r in speed["rows"])
    assert abs(a - b) < 0.05 * a  # the same model and batch, int8 rounding apart
    text = bench_quantize.main(["--size", "tiny", "--seq", "64", "--batch", "2", "--remat", "none",
                                "--converge", "3", "--out", str(tmp_path / "text.json")])  # fmt: skip
    assert all(r["finite"] and r["steps"] == 3 for r in text["rows"]) and abs(text["gap_held_out"]) < 0.05
    assert json.loads((tmp_path / "text.json").read_text())["rows"][1]["quantize"] == "int8"


@pytest.mark.sweep
def test_the_variants_benchmark_runs_every_row_from_the_same_first_loss(tmp_path, monkeypatch):
    """``bench_variants.py`` (``device_check.py --variants`` on the chip): bf16, int8, Muon and the head in
    pieces side by side. Every row's first loss is taken before any update, from the same parameters and
    batch: Muon's is bf16's exactly, the head in pieces' to float rounding, int8's to its rounding."""
    monkeypatch.syspath_prepend(str(CHECK.parent))
    import bench_variants

    out = bench_variants.main(["--size", "tiny", "--seq", "64", "--batch", "2", "--remat", "none", "--steps", "1",
                               "--out", str(tmp_path / "variants.json")])  # fmt: skip
    rows = {r["variant"]: r for r in out["rows"]}
    assert list(rows) == list(bench_variants.VARIANTS)
    assert all(r["tokens_per_s"] > 0 and r["peak_gib"] > 0 for r in rows.values()), rows
    base = rows["bf16"]["first_loss"]
    assert rows["muon"]["first_loss"] == base and rows["bf16"]["vs_bf16"] == 1.0
    assert rows["chunk"]["first_loss"] == pytest.approx(base, rel=1e-5)
    assert rows["int8"]["first_loss"] == pytest.approx(base, rel=0.05)
    assert json.loads((tmp_path / "variants.json").read_text())["rows"][0]["variant"] == "bf16"
