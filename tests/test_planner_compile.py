"""The planner's compile check: layouts compiled ahead of time from abstract shapes on simulated devices.

In-process compiles use the 8 devices conftest starts (a layout on fewer takes the first ones); one
test goes through the subprocess path with another device count and must measure the same step.
"""

import functools
import re
from dataclasses import dataclass

import jax
import numpy as np
import pytest

from meshkit.models import gpt
from meshkit.planner.compile import Measured, compile_in_subprocess, compile_layout, compile_layouts
from meshkit.planner.layout import Layout, ModelShape

SHAPE = ModelShape(name="tiny", layers=4, width=64, heads=8, vocab=256, seq=32)


@dataclass(frozen=True)
class _Job:
    global_batch: int = 16
    precision: str = "fp32"
    sequence_parallel: bool = True  # the planner's default: tensor-parallel layouts compile with it


JOB = _Job()


@functools.cache
def _compiled(layout: Layout) -> Measured:
    """One in-process compile per layout for the whole module (fp32 jobs of batch 16 compile alike)."""
    return compile_layout(SHAPE, layout, JOB)


def _param_bytes() -> int:
    cfg = gpt.GPTConfig(vocab_size=256, seq_len=32, layers=4, width=64, heads=8, scan_layers=True)
    params = jax.eval_shape(lambda: gpt.init(jax.random.key(0), cfg))
    return sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(params))


def test_fsdp_parts_add_up_to_the_arguments():
    m = _compiled(Layout(dp=8, zero=3))
    assert m.ok and m.plan == "fsdp" and m.mesh == "data=8"
    total = _param_bytes()
    # every GPT leaf of this shape divides over 8: a shard each, Adam's two moments beside it
    assert m.parts["params"] == total // 8
    assert m.parts["optimizer"] - 2 * m.parts["params"] < 64  # + the step counts
    assert m.parts["batch"] == 2 * 16 * 32 * 4 // 8  # tokens and targets, int32, split over data
    extra = m.argument_bytes - (m.parts["params"] + m.parts["optimizer"] + m.parts["batch"])
    assert 0 <= extra <= 16  # the step's PRNG key
    assert m.peak_bytes == m.argument_bytes + m.temp_bytes and m.parts["temporaries"] == m.temp_bytes
    assert set(m.comm_bytes) == {"data"} and m.comm_bytes["data"] > 2 * total * 7 / 8  # gathers + scatters
    assert m.compile_s > 0
    assert Measured.from_json(m.to_json()) == m


_DEBUG_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_METADATA = re.compile(r', metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')


def _program(hlo: str) -> str:
    """Optimized HLO text without its debug information (source locations, op names). An executable
    read from the persistent compilation cache carries the metadata of whichever compile wrote it (the
    cache key leaves metadata out): another test's, when another test compiled the same program first.
    Compared with it, the run's order decided the assertion (failed once in a full run at -n 3)."""
    lines, skipping = [], False
    for line in hlo.splitlines():
        if line in _DEBUG_SECTIONS:
            skipping = True
        elif skipping and not line:
            skipping = False
        elif not skipping:
            lines.append(_METADATA.sub("", line))
    return "\n".join(lines)


# Tiers: sweeps (moved when make test measured 22 min): the measuring compile (MEASURE_ONLY) is what every core
# layout of test_predicted_peak_and_bytes_match_the_compiled_step measures, its memory against the model.
@pytest.mark.sweep
def test_the_measuring_compile_is_the_default_compile_at_lower_llvm_effort():
    """``MEASURE_ONLY`` must not change what is measured: the same optimized HLO, the same memory."""
    from meshkit.planner.compile import MEASURE_ONLY, layout_step

    lowered = layout_step(SHAPE, Layout(dp=2, tp=2, zero=3, remat="layer"), JOB)[0]
    fast, default = lowered.compile(compiler_options=MEASURE_ONLY), lowered.compile()
    program = _program(default.as_text())
    assert "ENTRY" in program and " all-gather(" in program  # the program itself is compared, not less
    assert _program(fast.as_text()) == program
    a, b = fast.memory_analysis(), default.memory_analysis()
    assert (a.temp_size_in_bytes, a.argument_size_in_bytes) == (
        b.temp_size_in_bytes,
        b.argument_size_in_bytes,
    )


def test_layouts_meshkit_cannot_run_come_back_as_one_line():
    no_plan = Layout(dp=2, tp=4, zero=1)
    few_layers = Layout(pp=8)  # 4 layers over 8 stages
    (a,) = compile_layouts(SHAPE, [no_plan], JOB, progress=False)  # no process is started for it
    b = compile_layout(SHAPE, few_layers, JOB)
    assert not a.ok and "meshkit has no plan" in a.error and "\n" not in a.error
    assert not b.ok and "do not divide over stage=8" in b.error and "\n" not in b.error
    odd = compile_layout(SHAPE, Layout(dp=8, microbatch_size=3), JOB)
    assert not odd.ok and "use a multiple of 24" in odd.error


def test_a_compile_past_its_timeout_is_reported_not_awaited():
    m = compile_in_subprocess(SHAPE, Layout(dp=4), JOB, timeout_s=0.5)
    assert not m.ok and "timed out after" in m.error


# Tiers: sweeps (moved when make test measured 22 min): a layout compiled in a child process is core in
# test_target_compile.py's test_a_plan_the_partitioner_splits_attends_with_xla_on_a_slice_from_a_one_device_process
# (compile_in_subprocess, its Measured read back) and, through meshkit plan --compile, in its
# test_meshkit_plan_compiles_the_top_layout_for_a_target; the same layout in process in fsdp+tp's layouts.
@pytest.mark.sweep
def test_a_subprocess_with_its_own_device_count_measures_the_same_step():
    layout = Layout(dp=2, tp=2, zero=3)  # 4 devices: the child simulates 4, this process uses 4 of its 8
    (child,) = compile_layouts(SHAPE, [layout], JOB, progress=False)
    here = _compiled(layout)
    assert child.ok and here.ok, (child.error, here.error)
    assert child.plan == "fsdp+tp" and child.mesh == "data=2,model=2"
    assert (child.argument_bytes, child.temp_bytes, child.parts) == (
        here.argument_bytes,
        here.temp_bytes,
        here.parts,
    )
    assert child.comm_bytes == pytest.approx(here.comm_bytes) and set(child.comm_bytes) == {"data", "model"}


# -- the planner's prediction beside the compiled step, for every plan meshkit executes ---------------

CHECKED = [  # every meshkit plan once (tp alone and pp alone through dp+tp and dp+pp), and each schedule;
    # batch 16 over data=8 is 2 micro-batches: dp and zero1 carry a whole gradient accumulator
    Layout(dp=8),
    Layout(dp=8, zero=1),
    Layout(dp=8, zero=2),
    Layout(dp=8, zero=3),
    Layout(dp=2, tp=4),
    Layout(dp=2, tp=2, zero=3),
    Layout(dp=2, pp=4),
    Layout(dp=2, pp=4, zero=3),
    Layout(tp=2, pp=4, schedule="gpipe"),
    Layout(dp=2, tp=2, pp=2),
    Layout(dp=2, tp=2, pp=2, zero=3),
    Layout(dp=4, pp=2, schedule="interleaved", virtual_stages=2),
    # under remat, one layout per way the backward's working set is built: no ZeRO-3 with a whole
    # accumulator (dp+tp: the head's gradient added into it as it comes) and with a sharded one
    # (zero2: the top leaves' gradient kept whole); ZeRO-3, each layer leaf gathered by itself, under
    # both policies, without and with tp (fsdp+tp: its float32 bucket of the top gradients after
    # the layers' loop); pipelines
    # with a chunk of one layer (dots compiles to the step without remat) and with a loop over a
    # chunk (and the tensor-parallel all-reduce the recomputed block redoes)
    Layout(dp=2, tp=4, remat="layer"),
    Layout(dp=2, tp=4, remat="dots"),
    Layout(dp=8, zero=2, remat="layer"),
    Layout(dp=8, zero=3, remat="layer"),
    Layout(dp=8, zero=3, remat="dots"),
    Layout(dp=2, tp=2, zero=3, remat="layer"),
    Layout(dp=2, tp=2, zero=3, remat="dots"),
    Layout(dp=2, pp=4, remat="dots"),
    Layout(dp=2, tp=2, pp=2, remat="layer"),
    Layout(dp=2, tp=2, pp=2, zero=3, remat="dots"),
]


# Tiers: every plan, schedule and remat policy keeps a core layout (a pipeline's zero3 in fsdp+pp, its
# tp in tp+pp, its remat in dp+pp remat=dots, fsdp+tp's in fsdp+tp remat=layer, the whole accumulator's
# in dp+tp remat=layer, ZeRO-3's dots in fsdp remat=dots); these eleven sweep: dp+pp 1F1B without remat
# (dp+pp core in dp+pp remat=dots and interleavedx2, 1F1B in both 1f1b layouts, a pipeline without
# remat in fsdp+pp, tp+pp and interleavedx2) and zero2 without remat (zero2 core in zero2 remat=layer,
# no remat in zero1) among them; dp and dp+tp without remat moved when make test measured 22 min (dp's
# replicated parameters and whole accumulator without remat core in zero1's layout, which shards only the
# optimizer state, and in dp+tp remat=layer; dp+tp core in dp+tp remat=layer, tp without remat in tp+pp).
SWEEP = {"fsdp+tp+pp:dp=2,tp=2,pp=2_zero3_mb=1_1f1b_remat=dots", "fsdp+tp+pp:dp=2,tp=2,pp=2_zero3_mb=1_1f1b",
         "dp+tp+pp:dp=2,tp=2,pp=2_mb=1_1f1b", "dp+tp+pp:dp=2,tp=2,pp=2_mb=1_1f1b_remat=layer",
         "fsdp+tp:dp=2,tp=2,pp=1_zero3_mb=1_remat=dots", "dp+tp:dp=2,tp=4,pp=1_mb=1_remat=dots",
         "fsdp:dp=8,tp=1,pp=1_zero3_mb=1_remat=layer", "dp+pp:dp=2,tp=1,pp=4_mb=1_1f1b",
         "zero2:dp=8,tp=1,pp=1_zero2_mb=1", "dp:dp=8,tp=1,pp=1_mb=1", "dp+tp:dp=2,tp=4,pp=1_mb=1"}  # fmt: skip


def _checked(layout: Layout):
    name = f"{layout.meshkit_plan()}:{layout.label().replace(' ', '_')}"
    return pytest.param(layout, id=name, marks=pytest.mark.sweep if name in SWEEP else ())


@pytest.mark.parametrize("layout", [_checked(lay) for lay in CHECKED])
def test_predicted_peak_and_bytes_match_the_compiled_step(layout):
    from meshkit.planner.cluster import Cluster, Job
    from meshkit.planner.hardware import hardware
    from meshkit.planner.predict import predict

    job = Job(
        global_batch=JOB.global_batch, precision=JOB.precision, runtime="meshkit", flash_attention=False
    )
    measured = _compiled(layout)
    assert measured.ok, measured.error
    pred = predict(SHAPE, layout, Cluster(hardware=hardware("h100"), devices=layout.devices), job)
    assert pred.valid, pred.why
    ratios = {"peak": pred.peak_bytes / measured.peak_bytes}
    axes = {"data", "model", "stage"}
    for axis in axes:
        got, want = measured.comm_bytes.get(axis, 0.0), pred.comm_bytes.get(axis, 0.0)
        if got or want:
            ratios[axis] = want / got if got else float("inf")
    other = sum(v for k, v in measured.comm_bytes.items() if k not in axes)  # scalars: loss, gradient norm
    assert other < 0.01 * measured.total_comm_bytes
    off = {k: round(r, 3) for k, r in ratios.items() if not 0.9 <= r <= 1.1}
    assert not off, f"predicted/compiled outside 0.90-1.10: {off} (all: {ratios})"


@pytest.mark.parametrize("layout", [Layout(dp=2, tp=2, zero=3), Layout(dp=2, tp=4)], ids=["fsdp+tp", "dp+tp"])
def test_state_at_rest_splits_the_vocabulary_as_training_does(layout):
    """Issue 35: the compile check builds the step ``meshkit train`` builds, the vocabulary split over
    the model axis (``tp_rules.vocab_rules``), and the planner prices the embedding and unembedding
    split the same way: its parameters and optimizer state per device are the compiled ones."""
    from meshkit.planner.cluster import Cluster, Job
    from meshkit.planner.hardware import hardware
    from meshkit.planner.predict import predict

    measured = _compiled(layout)
    assert measured.ok, measured.error
    job = Job(
        global_batch=JOB.global_batch, precision=JOB.precision, runtime="meshkit", flash_attention=False
    )
    pred = predict(SHAPE, layout, Cluster(hardware=hardware("h100"), devices=layout.devices), job)
    assert pred.memory["parameters"] == pytest.approx(measured.parts["params"], rel=1e-6)
    assert pred.memory["optimizer"] == pytest.approx(measured.parts["optimizer"], abs=64)  # + step counts
    # what training places (``train.job``: the vocabulary's rules), by the ledger's own formula
    import optax

    from meshkit.mesh import make_mesh
    from meshkit.plans import memory_formula, place
    from meshkit.plans.tp_rules import vocab_rules
    from meshkit.spec import get_plan

    cfg = gpt.GPTConfig(vocab_size=256, seq_len=32, layers=4, width=64, heads=8, scan_layers=True)
    params = jax.eval_shape(lambda: gpt.init(jax.random.key(0), cfg))
    plan = get_plan(layout.meshkit_plan())
    mesh = make_mesh(layout.mesh_spec(), devices=jax.devices()[: layout.devices])
    placement = place(params, plan, mesh, rules=vocab_rules(plan), logical_axes=gpt.logical_axes(params))
    assert measured.parts["params"] == memory_formula(placement, optax.adamw(1e-3), params)["params"]
