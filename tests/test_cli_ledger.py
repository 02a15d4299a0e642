"""The `meshkit` command: devices, comm, memory, budget; JSON output and one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _limits import limit
from meshkit.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "hlo"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_devices_json(capsys):
    code, out, _ = run(capsys, "devices", "--simulate", "8", "--json")
    data = json.loads(out)
    assert code == 0 and data["device_count"] == 8 and len(data["devices"]) == 8


def test_comm_json_on_an_example(capsys):
    code, out, _ = run(capsys, "comm", "meshkit.examples:dp_mlp_adam", "--devices", "8", "--json")
    data = json.loads(out)
    assert code == 0
    assert [r["op"] for r in data["records"]] == ["all-reduce"]
    assert data["records"][0]["size_bytes"] == 23076 and data["by_axes"]["data"]["executions"] == 1


def test_comm_table_from_hlo_file(capsys):
    code, out, _ = run(capsys, "comm", "--hlo", str(FIXTURES / "loops.hlo"))
    assert code == 0
    assert "all-gather" in out and "?trip" in out and "warning:" in out


def test_memory_json(capsys):
    code, out, _ = run(capsys, "memory", "meshkit.examples:fsdp_mlp_grad", "--json")
    assert code == 0 and json.loads(out)["argument_bytes"] == 5956


def test_budget_json_and_table(capsys):
    code, out, _ = run(capsys, "budget", "--params", "7e9", "--devices", "64", "--json")
    rows = {r["stage"]: r for r in json.loads(out)["rows"]}
    assert code == 0 and rows["dp"]["total"] == pytest.approx(112e9)
    code, out, _ = run(
        capsys, "budget", "--params", "7e9", "--devices", "64", "--stages", "4", "--microbatches", "64"
    )
    assert code == 0 and "112.00 GB" in out and "0.045" in out


def test_target_file_path(tmp_path, capsys):
    f = tmp_path / "user_step.py"
    f.write_text(
        "import jax, jax.numpy as jnp\ndef make():\n    return jax.jit(lambda x: x * 2).lower(jnp.ones(4))\n"
    )
    code, out, _ = run(capsys, "comm", f"{f}:make", "--json")
    assert code == 0 and json.loads(out)["records"] == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["comm", "nope_module:x"], "cannot import module 'nope_module'"),
        (["comm", "meshkit.examples:nothing"], "has no attribute 'nothing'"),
        (["comm", "meshkit.examples"], "write module:function"),
        (["comm", "meshkit.examples:MLP_SIZES"], "must return (jitted_fn, args)"),
        (["comm", "--hlo", "/no/such/file.hlo"], "no HLO file"),
        (["comm"], "give exactly one of TARGET"),
        (["comm", "meshkit.examples:dp_mlp_adam", "--devices", "4"], "already started with 8"),
        (["budget", "--params", "7e9", "--devices", "8", "--convention", "x"], "unknown convention 'x'"),
        (
            ["budget", "--params", "7e9", "--devices", "8", "--stages", "4"],
            "give both --stages and --microbatches",
        ),
        (["memory", "--hlo", "x"], None),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    if message is not None:
        assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert "Traceback" not in err + out


def test_fresh_process_simulates_devices_and_bad_hlo_text(tmp_path):
    bad = tmp_path / "bad.hlo"
    bad.write_text("not hlo at all\n")
    exe = Path(sys.executable).parent / "meshkit"
    out = subprocess.run(
        [str(exe), "comm", "meshkit.examples:megatron_mlp", "--devices", "8", "--json"],
        capture_output=True, text=True, timeout=limit(3),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["records"][0]["axes"] == ["model"]
    out = subprocess.run(
        [str(exe), "comm", "--hlo", str(bad)], capture_output=True, text=True, timeout=limit(3)
    )
    assert out.returncode == 2 and out.stderr.startswith("error: no HLO instructions found")
    assert out.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--steps", "abc"], "Invalid value for '--steps'"),
        (["nosuch"], "No such command 'nosuch'"),
        (["budget", "--devices", "8"], "Missing option '--params'"),
    ],
)
def test_usage_errors_are_one_line_naming_the_help(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert "--help)" in err and "╭" not in err


def test_no_arguments_prints_help(capsys):
    code, out, _ = run(capsys)
    assert code == 0 and "Usage: meshkit" in out and "train" in out


def test_comm_with_hlo_imports_neither_jax_nor_numpy(tmp_path):
    code = (
        "import sys\nfrom meshkit.cli import main\n"
        f"assert main(['comm', '--hlo', {str(FIXTURES / 'loops.hlo')!r}]) == 0\n"
        "print(sorted(m for m in ('jax', 'jaxlib', 'numpy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=limit(1))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[]")


def _many_collectives(n: int) -> str:
    body = "\n".join(
        f"  ar{i} = f32[{i + 1}] all-reduce(p{i}), channel_id={i + 1}, replica_groups=[2,4]<=[8], "
        f"use_global_device_ids=true, to_apply=add\n  p{i + 1} = f32[{i + 2}] parameter({i + 1})"
        for i in range(n)
    )
    return (
        "HloModule many, num_partitions=8\n\nadd {\n  a = f32[] parameter(0)\n  b = f32[] parameter(1)\n"
        f"  ROOT s = f32[] add(a, b)\n}}\n\nENTRY main {{\n  p0 = f32[1] parameter(0)\n{body}\n"
        f"  ROOT r = f32[{n + 1}] copy(p{n})\n}}\n"
    )


def test_comm_tables_group_by_op_and_axes_and_all_lists_every_collective(tmp_path, capsys):
    f = tmp_path / "many.hlo"
    f.write_text(_many_collectives(2000))
    code, out, _ = run(capsys, "comm", "--hlo", str(f))
    assert code == 0 and "By op" in out and "By mesh axes" in out
    assert "2,000 collective instruction(s)" in out and "Largest 10 of 2,000 collectives" in out
    assert out.count("all-reduce") < 20  # grouped, not one line per collective
    code, out, _ = run(capsys, "comm", "--hlo", str(f), "--all")
    assert code == 0 and sum(line.startswith("all-reduce ") for line in out.splitlines()) == 2000
    assert "ar1999 " in out and "7.81 KiB" in out  # f32[2000]
    code, out, _ = run(capsys, "comm", "--hlo", str(f), "--json")
    assert code == 0 and len(json.loads(out)["records"]) == 2000


def test_comm_on_a_binary_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "x.hlo"
    f.write_bytes(b"\x80\x81\xff\x00" * 10)
    code, _, err = run(capsys, "comm", "--hlo", str(f))
    assert code == 2 and "is not text" in err and err.count("\n") == 1
