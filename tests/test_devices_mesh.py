"""Simulated devices, device description and mesh specs."""

import subprocess
import sys

import jax
import pytest
from jax.sharding import AxisType

import meshkit
from _limits import limit
from meshkit import DeviceSetupError, MeshSpecError


def test_simulate_after_start_is_a_noop_for_the_same_count_and_an_error_otherwise():
    assert jax.device_count() == 8  # starts the backend
    meshkit.simulate_devices(8)
    with pytest.raises(
        DeviceSetupError, match=r"already started with 8 cpu device\(s\).*simulate_devices\(4\)"
    ) as e:
        meshkit.simulate_devices(4)
    assert "\n" not in str(e.value)
    with pytest.raises(DeviceSetupError, match="positive whole number"):
        meshkit.simulate_devices(0)


def test_simulate_in_a_fresh_process():
    code = "import meshkit, jax; meshkit.simulate_devices(3); print(jax.device_count())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=limit(1), check=True
    )
    assert out.stdout.split() == ["3"]


def test_describe_devices():
    r = meshkit.describe_devices()
    assert (r.platform, r.process_index, r.process_count, r.device_count, r.local_device_count) == (
        "cpu",
        0,
        1,
        8,
        8,
    )
    assert [d.id for d in r.devices] == list(range(8))
    assert all(d.local and d.process_index == 0 and d.kind for d in r.devices)
    assert r.to_json()["devices"][3]["id"] == 3


def test_make_mesh_explicit_auto_and_inferred():
    m = meshkit.make_mesh("data=4,model=2")
    assert dict(m.shape) == {"data": 4, "model": 2}
    assert m.axis_types == (AxisType.Explicit, AxisType.Explicit)
    a = meshkit.make_mesh(" data = -1 , model=2 ", axis_types="auto")
    assert dict(a.shape) == {"data": 4, "model": 2} and a.axis_types == (AxisType.Auto,) * 2
    assert dict(meshkit.make_mesh({"x": 2, "y": -1, "z": 2}).shape) == {"x": 2, "y": 2, "z": 2}
    assert dict(meshkit.make_mesh("i=4", devices=jax.devices()[:4]).shape) == {"i": 4}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("data=3,model=2", "mesh data=3 x model=2 = 6 devices, but 8 are available"),
        ("data=-1,model=3", "the other axes multiply to 3, which does not divide the 8 devices"),
        ("data=4,data=2", "axis name 'data' appears twice"),
        ("=8", "empty axis name"),
        ("data", "bad mesh axis 'data'.*name=size"),
        ("data=four", "bad size 'four' for mesh axis 'data'"),
        ("data=0,model=8", "bad size 0 for mesh axis 'data'"),
        ("data=-1,model=-1", "more than one axis is -1"),
        ("", "empty mesh spec"),
        ("1x=8", "bad axis name '1x'"),
        ("data=4,,model=2", "bad mesh axis ''"),
    ],
)
def test_bad_mesh_specs_name_every_factor(spec, message):
    with pytest.raises(MeshSpecError, match=message) as e:
        meshkit.make_mesh(spec)
    assert "\n" not in str(e.value)


def test_bad_axis_types():
    with pytest.raises(MeshSpecError, match="use 'explicit' or 'auto'"):
        meshkit.make_mesh("data=8", axis_types="manual")
