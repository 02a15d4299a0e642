"""Pipeline schedules on 8 simulated CPU devices: bubble, permute bytes, activation memory, step time.

Three parts, printed in one run:

1. **Bubble and permutes** (p in {2, 4, 8}, m in {p, 2p, 4p}; GPipe, 1F1B, interleaved with v = 2):
   the pipeline's gradient step is compiled and run once; the bubble is counted from the record the
   step returns (idle ticks / ticks) and set beside ``(p-1)/(v m+p-1)``; the collective-permute
   traffic is read from the compiled HLO (``meshkit.analysis.communication``) and set beside the
   model (2 permutes of one micro-batch's activation per tick, plus the interleaved relayout).
2. **Activation memory** (p = 4, m = 4, 8, 16 with a fixed micro-batch, so the global batch grows
   with m): the compiled step's temporaries (``memory_analysis``) under GPipe and 1F1B, and their
   growth from m = p beside the model's growth of the stash (slots x one micro-batch's activation):
   GPipe keeps m stage inputs, 1F1B at most p.
3. **Step time**: ``Trainer.step`` of the same GPT and global batch under dp (data=8, one
   micro-batch), dp with the same micro-batches accumulated, a single-stage pipeline (stage=1,
   data=8) and dp+pp on stage=4,data=2 under each schedule; medians of wall-clock and process CPU
   time per step, as ratios to dp. On 2 shared cores these are noisy (the load of other tenants
   stretches wall-clock time); the CPU ratio is the steadier one.

4. **Activation checkpointing** (p = 4, 2 layers per stage, m = 8): the temporaries under GPipe
   and 1F1B with ``remat`` none, layer and dots, beside the model (stash + one backward tick's
   residuals, ``Pipeline.working_bytes``); what remat saves, measured beside predicted.

Run (several minutes on 2 cores)::

    .venv/bin/python benchmarks/bench_pipeline.py [--parts 1,2,3,4] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from meshkit import Trainer  # noqa: E402
from meshkit.analysis import communication, memory  # noqa: E402
from meshkit.mesh import make_mesh  # noqa: E402
from meshkit.models import gpt  # noqa: E402
from meshkit.plans import (  # noqa: E402
    Pipeline,
    compare_communication,
    place,
)
from meshkit.spec import ParallelSpec, get_plan  # noqa: E402


def _tokens(n: int, t: int, vocab: int, seed: int = 0):
    tok = np.random.default_rng(seed).integers(0, vocab, size=(n, t + 1)).astype(np.int32)
    return tok[:, :-1], tok[:, 1:]


def _pipeline(cfg, mesh_text, schedule, m, v, remat="none"):
    params = gpt.init(jax.random.key(0), cfg)
    mesh = make_mesh(mesh_text, axis_types="auto")
    layout = place(params, get_plan("dp+pp"), mesh)
    spec = ParallelSpec(
        plan="dp+pp", microbatches=m, pipeline_schedule=schedule, virtual_stages=v, remat=remat
    )
    pipe = Pipeline.make(gpt.stages(cfg), params, layout, spec, extras={})
    return params, pipe


def bubble_and_permutes() -> bool:
    print("1. bubble (idle ticks / ticks, from the executed record) and collective-permute bytes per step")
    print(f"{'schedule':12} {'p':>2} {'m':>3} {'v':>2} {'ticks':>5} {'measured':>9} {'model':>9} "
          f"{'permute meas.':>14} {'model':>10} {'ratio':>6}")  # fmt: skip
    ok = True
    for p in (2, 4, 8):
        for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
            for m in (p, 2 * p, 4 * p):
                cfg = gpt.GPTConfig(
                    vocab_size=32, seq_len=8, layers=p * v, width=16, heads=2, scan_layers=True
                )
                data = 8 // p
                params, pipe = _pipeline(cfg, f"stage={p},data={data}", name, m, v)
                batch = _tokens(data * m, cfg.seq_len, cfg.vocab_size)
                f = jax.jit(pipe.gradients())
                compiled = f.lower(params, None, batch, jax.random.key(0)).compile()
                record = np.asarray(compiled(params, None, batch, jax.random.key(0))[1]["schedule"])
                measured = float(np.mean(record[..., 0] == 0))
                model = (p - 1) / (v * m + p - 1)
                rows = compare_communication(
                    communication(compiled, mesh=pipe.placement.mesh), pipe.expected(params, batch)
                )
                row = next(r for r in rows if r.op == "collective-permute")
                good = measured == model and row.ratio == 1.0
                ok &= good
                print(f"{name:12} {p:>2} {m:>3} {v:>2} {record.shape[0]:>5} {measured:>9.5f} {model:>9.5f} "
                      f"{row.measured_traffic_bytes:>14,.0f} {row.model_traffic_bytes:>10,.0f} {row.ratio:>6.3f}"
                      + ("" if good else "  MISMATCH"), flush=True)  # fmt: skip
    return ok


def _temps(cfg, name: str, m: int, rows: int, remat: str = "none"):
    """The compiled gradient step's temporaries on stage=4,data=2, micro-batches of ``rows`` rows."""
    params, pipe = _pipeline(cfg, "stage=4,data=2", name, m, 1, remat)
    batch = _tokens(2 * rows * m, cfg.seq_len, cfg.vocab_size)
    compiled = jax.jit(pipe.gradients()).lower(params, None, batch, jax.random.key(0)).compile()
    return memory(compiled).temp_bytes, pipe, params, batch


def activation_memory() -> bool:
    print("\n2. activation memory: compiled temporaries (memory_analysis) vs the stash model; p=4, micro-batch "
          "4 rows x 64 tokens x width 64 (one activation = 64 KiB)")  # fmt: skip
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=64, layers=4, width=64, heads=4, scan_layers=True)
    rows, ok = 4, True
    print(f"{'schedule':9} {'m':>3} {'slots':>5} {'temps':>12} {'stash model':>12} {'temps growth':>13} "
          f"{'model growth':>13} {'ratio':>6} {'temps / temps(m=p)':>19}")  # fmt: skip
    for name in ("gpipe", "1f1b"):
        base = None
        for m in (4, 8, 16):
            temps, pipe, _, _ = _temps(cfg, name, m, rows)
            s = pipe.schedule
            act = rows * cfg.seq_len * cfg.width * 4
            stash = (s.x_slots + s.g_slots + 2) * act
            base = base or (temps, stash)
            grow, model_grow = temps - base[0], stash - base[1]
            ratio = grow / model_grow if model_grow else None
            flat = temps / base[0]
            if name == "1f1b":
                ok &= abs(flat - 1) <= 0.10
            elif ratio is not None:
                ok &= 0.9 <= ratio <= 1.1
            print(f"{name:9} {m:>3} {s.x_slots:>5} {temps:>12,} {stash:>12,} {grow:>13,} {model_grow:>13,} "
                  f"{'-' if ratio is None else f'{ratio:.4f}':>6} {flat:>19.4f}", flush=True)  # fmt: skip
    return ok


def remat_memory() -> bool:
    print("\n4. activation checkpointing: compiled temporaries (memory_analysis) without and with remat; p=4, "
          "8 layers (2 per stage), micro-batch 4 rows x 64 tokens x width 64")  # fmt: skip
    print("   model: stash (slots x one activation) + one backward tick's residuals through its chunk "
          "(Pipeline.working_bytes); 'saved' = temps(none) - temps(remat), beside the model's")  # fmt: skip
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=64, layers=8, width=64, heads=4, scan_layers=True)
    rows, ok = 4, True
    print(f"{'schedule':9} {'m':>3} {'remat':6} {'temps':>12} {'stash':>10} {'working':>12} {'model':>12} "
          f"{'temps/model':>11} {'saved':>12} {'model saved':>12} {'ratio':>6}")  # fmt: skip
    for name in ("gpipe", "1f1b"):
        m = 8
        base = None
        for remat in ("none", "layer", "dots"):
            temps, pipe, params, batch = _temps(cfg, name, m, rows, remat)
            s = pipe.schedule
            stash = (s.x_slots + s.g_slots + 2) * rows * cfg.seq_len * cfg.width * 4
            working = pipe.working_bytes(params, batch)
            base = base or (temps, working)
            saved, model_saved = base[0] - temps, base[1] - working
            ratio = saved / model_saved if model_saved else None
            if ratio is not None:
                ok &= saved > 0 and 0.9 <= ratio <= 1.1
            print(f"{name:9} {m:>3} {remat:6} {temps:>12,} {stash:>10,} {working:>12,.0f} {stash + working:>12,.0f} "
                  f"{temps / (stash + working):>11.3f} {saved:>12,} {model_saved:>12,.0f} "
                  f"{'-' if ratio is None else f'{ratio:.4f}':>6}", flush=True)  # fmt: skip
    return ok


def _one(trainer, batch) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    trainer.step(batch)
    jax.block_until_ready(trainer.params)
    return time.perf_counter() - w0, time.process_time() - c0


def step_time(steps: int) -> None:
    print("\n3. step time, GPT width 64, 8 layers, seq 64, global batch 32, 8 devices (medians of steps taken "
          "in turn, one of each run per round, so load drift hits every run alike; ratio to dp)")  # fmt: skip
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=64, layers=8, width=64, heads=4, scan_layers=True)
    params = gpt.init(jax.random.key(0), cfg)
    batch = _tokens(32, cfg.seq_len, cfg.vocab_size)
    runs = [("dp, data=8", dict(plan="dp", mesh="data=8"), gpt.make_loss(cfg)),
            ("dp+pp stage=1 (m=1, the default)", dict(plan="dp+pp", mesh="stage=1,data=8"), None),
            ("dp, data=8, accumulate=4", dict(plan="dp", mesh="data=8", accumulate=4), gpt.make_loss(cfg)),
            ("dp+pp stage=1 (1f1b, m=4)", dict(plan="dp+pp", mesh="stage=1,data=8", microbatches=4), None),
            ("dp+pp stage=4 gpipe m=8", dict(plan="dp+pp", mesh="stage=4,data=2", microbatches=8, pipeline_schedule="gpipe"), None),
            ("dp+pp stage=4 1f1b m=8", dict(plan="dp+pp", mesh="stage=4,data=2", microbatches=8, pipeline_schedule="1f1b"), None),
            ("dp+pp stage=4 interleaved v=2 m=8", dict(plan="dp+pp", mesh="stage=4,data=2", microbatches=8,
                                                       pipeline_schedule="interleaved", virtual_stages=2), None)]  # fmt: skip
    trainers = []
    for _label, kwargs, loss in runs:
        t = Trainer(loss or gpt.stages(cfg), params, optax.adam(1e-3), **kwargs)
        _one(t, batch)  # compile and warm up
        trainers.append(t)
    times = [[] for _ in runs]
    for _ in range(steps):
        for i, t in enumerate(trainers):
            times[i].append(_one(t, batch))
    med = [tuple(float(np.median([x[k] for x in ts])) for k in (0, 1)) for ts in times]
    print(f"{'run':36} {'wall ms':>9} {'cpu ms':>9} {'wall/dp':>8} {'cpu/dp':>7} {'bubble':>7}")
    for (label, _, _), t, (wall, cpu) in zip(runs, trainers, med, strict=True):
        bubble = (
            "-" if t.pipeline is None else f"{float(np.mean(np.asarray(t.last_schedule)[..., 0] == 0)):.3f}"
        )
        print(f"{label:36} {wall * 1e3:>9.1f} {cpu * 1e3:>9.1f} {wall / med[0][0]:>8.2f} {cpu / med[0][1]:>7.2f} "
              f"{bubble:>7}", flush=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="1,2,3,4")
    ap.add_argument("--steps", type=int, default=9)
    args = ap.parse_args()
    parts = {int(x) for x in args.parts.split(",")}
    ok = True
    if 1 in parts:
        ok &= bubble_and_permutes()
    if 2 in parts:
        ok &= activation_memory()
    if 4 in parts:
        ok &= remat_memory()
    if 3 in parts:
        step_time(args.steps)
    print("\nall checks ok" if ok else "\nMISMATCH: see the rows marked above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
