"""The published pod runs meshkit compiles for their slices (benchmarks/anchors.py, issue 49): their
shapes against the figures their sources print, the 2023 MaxText block as a user's model through the
planner's compile check, and (sweep) one anchor compiled again for its v5e-256 equal to the record."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from meshkit.planner.cluster import Job
from meshkit.planner.compile import compile_layout
from meshkit.planner.layout import Layout, ModelShape

ROOT = Path(__file__).resolve().parent.parent


def _anchors():
    spec = importlib.util.spec_from_file_location("meshkit_anchors", ROOT / "benchmarks" / "anchors.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


A = _anchors()

# MaxText README @9bc243c9 (and configs/v5p/README.md @76bd53b0): TFLOP per chip per step as
# train.py's calculate_training_tflops counts them, and the parameters its log prints (billions).
PUBLISHED = {
    "maxtext-16b-v5e-256": (16.274, 1279.0),
    "maxtext-32b-v5e-256": (32.548, 1652.6),
    "maxtext-64b-v5e-256": (64.761, 1644.3),
    "maxtext-128b-v5e-256": (129.185, 1640.2),
    "maxtext-32b-v5p-128": (32.548, 3252.4),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_2023_shapes_give_the_published_parameters_and_flops(name):
    a = next(x for x in A.ANCHORS if x.name == name)
    s = a.shape
    hd = s.heads * s.head_dim
    params = s.vocab * s.width + s.layers * (4 * s.width * hd + 2 * s.width * s.ffn + s.width) + s.width
    attention = 12 * s.layers * hd * s.seq**2 * (0.5 if "v5p" in name else 1.0)  # v5p: halved for causality
    tflop = (6 * params * s.seq + attention) * a.per_chip_batch / 1e12
    billions, published = PUBLISHED[name]
    assert params / 1e9 == pytest.approx(billions, abs=1e-3)
    assert tflop == pytest.approx(published, abs=0.1)
    assert a.tflop_per_chip == published
    assert a.published_step_s == pytest.approx(
        published / (a.published_mfu * (459 if "v5p" in name else 197)), rel=2e-3
    )
    assert a.layout.devices == a.chips and a.global_batch == a.per_chip_batch * a.chips


def test_the_2023_block_compiles_as_a_users_model_sharded_as_its_logical_axes():
    shape = ModelShape(name="tiny", layers=2, width=64, heads=2, head_dim=16, ffn=96, vocab=128, seq=32,
                       tie_embeddings=True)  # fmt: skip
    model = A.maxtext_2023(shape)
    m = compile_layout(
        shape, Layout(dp=4, zero=3, remat="layer"), Job(global_batch=8, precision="bf16"), model=model
    )
    assert m.ok, m.error
    n = 128 * 64 + 2 * (4 * 64 * 32 + 2 * 64 * 96 + 64) + 64  # fp32 parameters, each split over data=4
    assert m.parts["params"] == 4 * n // 4
    assert m.comm_bytes.get("data", 0) > 0 and set(m.comm_bytes) == {"data"}


@pytest.mark.sweep
def test_the_32b_anchor_compiles_for_its_v5e_256_as_recorded():
    pytest.importorskip("libtpu")
    a = next(x for x in A.ANCHORS if x.name == "maxtext-32b-v5e-256")
    got = A.compile_anchor(a, a.layout)
    recorded = json.loads((ROOT / "benchmarks" / "anchors.json").read_text())[a.name]["own"]
    assert got["ok"] and got["platform"] == "tpu" and got["attention"] == ["splash"]
    assert got["peak_bytes"] == pytest.approx(recorded["peak_bytes"], rel=0.01)
    assert got["peak_bytes"] <= 15.75 * 2**30  # it fits its chips, as it ran
    for axis, moved in recorded["comm_bytes"].items():
        assert got["comm_bytes"][axis] == pytest.approx(moved, rel=0.01)
