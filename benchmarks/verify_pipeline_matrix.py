"""``meshkit verify`` over every plan x schedule x micro-batch count on 8 simulated CPU devices.

Each cell is what ``meshkit verify --plan P --model M --mesh MESH [--pipeline-schedule S
--microbatches m --virtual-stages v] [--accumulate a] [--remat R]`` certifies (the same library
call, ``meshkit.verify.verify``, in one process): 20 Adam steps against one device in float64
(<= 1e-10), the float32 first step within its derived bound (``meshkit.verify``'s docstring),
bitwise reproducible run to run, communication, memory and (pipelines) the bubble = model.

Beside each cell, the rule certificates used before (float32 plan vs one device after K steps
<= 2x one device's float32 distance from float64) as ``old``: the false failures it made.

Part ``pipeline``: every pipeline plan on 2, 4 and 8 stages, GPipe, 1F1B and interleaved (v = 2),
micro-batches p, 2p and 4p where the verify GPT's 16 sequences divide (the GPT has one layer per
virtual stage). Part ``plans``: the plans without stages on the MLP and the GPT, accumulating 1, 2
and 4 micro-batches where the batch divides.

Run (about 2 hours on 2 busy cores)::

    .venv/bin/python benchmarks/verify_pipeline_matrix.py [--part pipeline|plans|all] [--only dp+pp]
        [--schedules 1f1b] [--remat layer] [--steps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

jax.config.update("jax_num_cpu_devices", 8)

PIPELINE_MESHES = [
    ("pp", "stage=8"),
    ("dp+pp", "stage=2,data=4"),
    ("dp+pp", "stage=4,data=2"),
    ("fsdp+pp", "stage=2,data=4"),
    ("fsdp+pp", "stage=4,data=2"),
    ("tp+pp", "stage=2,model=4"),
    ("tp+pp", "stage=4,model=2"),
    ("dp+tp+pp", "stage=2,data=2,model=2"),
    ("fsdp+tp+pp", "stage=2,data=2,model=2"),
]
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
PLAN_MESHES = [
    ("dp", "data=8"),
    ("zero1", "data=8"),
    ("zero2", "data=8"),
    ("zero3", "data=8"),
    ("tp", "model=8"),
    ("dp+tp", "data=4,model=2"),
    ("fsdp+tp", "data=4,model=2"),
]
EXAMPLES = {"mlp": 64, "gpt": 16}
"""Examples in the verify batch of each model (``meshkit.verify.workload``)."""


def _sizes(mesh: str) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=") for part in mesh.split(","))}


def cells(part: str, only: str | None, schedules: list[str]) -> list[dict]:
    out = []
    if part in ("pipeline", "all"):
        for plan, mesh in PIPELINE_MESHES:
            sizes = _sizes(mesh)
            p, data = sizes["stage"], sizes.get("data", 1)
            for schedule, v in SCHEDULES:
                for m in (p, 2 * p, 4 * p):
                    if schedule in schedules and EXAMPLES["gpt"] % (data * m) == 0:
                        out.append(dict(plan=plan, model="gpt", mesh=mesh, pipeline_schedule=schedule,
                                        virtual_stages=v, microbatches=m))  # fmt: skip
    if part in ("plans", "all"):
        for model in ("mlp", "gpt"):
            for plan, mesh in PLAN_MESHES:
                for a in (1, 2, 4):
                    if EXAMPLES[model] % (_sizes(mesh).get("data", 1) * a) == 0:
                        out.append(dict(plan=plan, model=model, mesh=mesh, accumulate=a))
    return [c for c in out if only is None or c["plan"] == only]


def main() -> int:
    from meshkit._errors import MeshkitError
    from meshkit.verify import verify

    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="all", choices=("pipeline", "plans", "all"))
    ap.add_argument("--remat", default="none")
    ap.add_argument("--only", default=None, help="one plan")
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None, help="write the rows here (after every cell)")
    args = ap.parse_args()
    print(f"{'plan':11} {'model':5} {'mesh':23} {'schedule':11} {'m/acc':>5} {'f64':>8} {'f32 step1':>9} "
          f"{'bound':>8} {'K f32':>8} {'spread':>8} {'old':>5} {'ok':>5} {'s':>4}", flush=True)  # fmt: skip
    rows, ok = [], True
    for cell in cells(args.part, args.only, args.schedules.split(",")):
        t0 = time.perf_counter()
        try:
            c = verify(**cell, steps=args.steps, remat=args.remat)
        except MeshkitError as e:  # a combination the plan refuses, with its reason: not a certificate
            print(f"{cell['plan']:11} {cell['model']:5} {cell['mesh']:23} refused: {e}", flush=True)
            continue
        old = c.vs_single_device <= max(1e-5, 2 * c.float32_noise)
        pipe = c.report.pipeline
        row = dict(cell, remat=args.remat, float64=c.exact_vs_single_device, first_step=c.first_step,
                   bound=c.first_step_bound, noise=c.first_step_noise, vs_single_device=c.vs_single_device,
                   float32_noise=c.float32_noise, float32_spread=c.float32_spread, old_rule_ok=old,
                   bubble=None if pipe is None else pipe.bubble_measured, ok=c.ok, checks=c.checks,
                   seconds=time.perf_counter() - t0)  # fmt: skip
        rows.append(row)
        ok &= c.ok
        sched = cell.get("pipeline_schedule", "-")
        m = cell.get("microbatches", cell.get("accumulate"))
        print(f"{c.plan:11} {c.model:5} {cell['mesh']:23} {sched:11} {m:>5} {c.exact_vs_single_device:>8.1e} "
              f"{c.first_step:>9.2e} {c.first_step_bound:>8.1e} {c.vs_single_device:>8.1e} "
              f"{c.float32_spread:>8.1e} {old!s:>5} {c.ok!s:>5} {row['seconds']:>4.0f}"
              + ("" if c.ok else f"  FAILED: {[k for k, v in c.checks.items() if not v]}"), flush=True)  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    old_false = sum(not r["old_rule_ok"] for r in rows)
    print(f"\n{len(rows)} cells; the old rule failed {old_false} of them")
    print("all cells pass" if ok else "FAILED: see the rows marked above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
