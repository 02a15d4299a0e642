"""Targets: a TPU slice's abstract devices from libtpu's compiler on this CPU machine (meshkit.targets), and
what the step traces for them: the platform's attention kernel, not the process's."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

from meshkit._errors import DeviceSetupError
from meshkit.models import llama
from meshkit.plans import assemble
from meshkit.spec import ParallelSpec
from meshkit.targets import target_devices, topology_name


@pytest.mark.parametrize(
    ("target", "topology"),
    [("v5e:2x2", "v5e:2x2"), ("v5e-256", "v5e:16x16"), ("v5litepod-16", "v5e:4x4"), ("V6E-256", "v6e:16x16"),
     ("v5p-128", "v5p:4x4x4"), ("v4-8", "v4:2x2x1")],
)  # fmt: skip
def test_cloud_tpu_names_read_as_their_topology(target, topology):
    assert topology_name(target) == topology


def test_a_target_gives_its_chips_and_a_bad_one_is_one_line():
    chips = target_devices("v5e-4")
    assert (
        len(chips) == 4 and {d.platform for d in chips} == {"tpu"} and chips[0].device_kind == "TPU v5 lite"
    )
    with pytest.raises(DeviceSetupError, match=r"^TPU target 'v5e-3': no v5e slice of 3 chips is known"):
        target_devices("v5e-3")
    with pytest.raises(
        DeviceSetupError, match=r"^libtpu knows no TPU topology 'v9z:2x2' \(.*\): give one such"
    ):
        target_devices("v9z:2x2")
    with pytest.raises(DeviceSetupError, match=r"^unknown TPU target 'h100-8'"):
        target_devices("h100-8")


def test_libtpu_says_nothing_in_a_process_on_a_machine_without_a_tpu():
    """With libtpu installed, JAX's start makes it look for a TPU: five lines on stderr in every process
    (a meshkit command, a launched rank) unless meshkit gives it what it asks for."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS" and not k.startswith("TPU_")}
    done = subprocess.run([str(Path(sys.executable).parent / "meshkit"), "devices", "--json"], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    bare = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert "TPU_ACCELERATOR_TYPE" in bare.stderr  # what meshkit keeps away: JAX alone prints it


def test_two_processes_compile_for_targets_at_once():
    """libtpu's lockfile keeps a chip to one process; with no chip each process that compiles for a target
    loads it (the second failed: "Internal error when accessing libtpu multi-process lockfile")."""
    env = {
        k: v for k, v in os.environ.items() if k != "ALLOW_MULTIPLE_LIBTPU_LOAD" and not k.startswith("TPU_")
    }
    code = "from meshkit.targets import target_devices; print(len(target_devices('v5e:2x2')), flush=True)"
    first = subprocess.Popen([sys.executable, "-c", code + "; input()"], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert first.stdout.readline().strip() == "4"  # it holds libtpu until its input closes
        second = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert second.returncode == 0 and second.stdout.strip() == "4", second.stderr[-1000:]
    finally:
        first.communicate("", timeout=60)


def test_the_step_for_a_tpu_target_attends_with_the_tpus_kernel():
    """The process's backend is the CPU; the step compiled for a v5e slice traces splash attention, the
    kernel that runs there (it traced XLA's einsum, as on the CPU: an 8B step then did not fit a chip)."""
    cfg = llama.LlamaConfig(vocab_size=256, seq_len=128, layers=1, width=64, heads=4, kv_heads=2, ffn=128,
                            compute_dtype="bfloat16", scan_layers=True)  # fmt: skip
    params = jax.eval_shape(lambda: llama.init(jax.random.key(0), cfg))
    tokens = jax.ShapeDtypeStruct((8, cfg.seq_len), jnp.int32)
    for devices, kernel in [(target_devices("v5e:2x2"), "splash"), (jax.devices()[:4], "einsum")]:
        step = assemble(llama.make_loss(cfg), params, optax.adamw(1e-3), ParallelSpec(plan="fsdp", mesh="data=4"),
                        devices=devices, logical_axes=llama.logical_axes(params), units=llama.units(cfg))  # fmt: skip
        step.lower(params, (tokens, tokens))
        assert step.attention.used == {kernel}
