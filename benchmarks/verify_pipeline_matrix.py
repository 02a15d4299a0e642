"""``meshkit verify`` over every pipeline plan x schedule on 8 simulated CPU devices, as one matrix.

Each cell is what ``meshkit verify --plan P --model gpt --mesh M --schedule S [--virtual-stages 2]
[--remat R]`` certifies (the same library call, ``meshkit.verify.verify``, in one process): 20 Adam
steps of the verify GPT (width 32, 8 heads, one layer per virtual stage) against one device in
float32 (bounded by 2x float32's own noise floor) and float64 (<= 1e-12), bitwise reproducible run
to run, communication = model, and the executed schedule's bubble = model. Micro-batches: one per
stage (the default; interleaved v = 2 groups them by stage).

Run (about 15 minutes on 2 cores)::

    .venv/bin/python benchmarks/verify_pipeline_matrix.py [--remat layer] [--only dp+pp] [--schedules 1f1b]
        [--json out.json]
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

MATRIX = [
    ("pp", "stage=8"),
    ("dp+pp", "stage=4,data=2"),
    ("fsdp+pp", "stage=4,data=2"),
    ("tp+pp", "stage=4,model=2"),
    ("dp+tp+pp", "stage=2,data=2,model=2"),
    ("fsdp+tp+pp", "stage=2,data=2,model=2"),
]
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))


def main() -> int:
    from meshkit.verify import verify

    ap = argparse.ArgumentParser()
    ap.add_argument("--remat", default="none")
    ap.add_argument("--only", default=None, help="one plan")
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    print(f"{'plan':11} {'mesh':23} {'schedule':12} {'remat':6} {'f32 rel.':>9} {'bound':>9} {'f64 rel.':>9} "
          f"{'bitwise rerun':>13} {'comm':>5} {'bubble':>7} {'ok':>5} {'s':>5}", flush=True)  # fmt: skip
    rows, ok = [], True
    for plan, mesh in MATRIX:
        if args.only and plan != args.only:
            continue
        for schedule, v in SCHEDULES:
            if schedule not in args.schedules.split(","):
                continue
            t0 = time.perf_counter()
            c = verify(
                plan,
                "gpt",
                mesh=mesh,
                steps=args.steps,
                pipeline_schedule=schedule,
                virtual_stages=v,
                remat=args.remat,
            )
            from meshkit.verify import NOISE_FACTOR, TOL_SINGLE

            bound = max(TOL_SINGLE, NOISE_FACTOR * c.float32_noise)
            comm = all(r.ok for r in c.report.communication)
            pipe = c.report.pipeline
            row = dict(plan=plan, mesh=mesh, schedule=schedule, virtual_stages=v, remat=args.remat,
                       vs_single_device=c.vs_single_device, bound=bound, float64=c.exact_vs_single_device,
                       reproducible=c.reproducible, communication_ok=comm, bubble=pipe.bubble_measured,
                       bubble_model=pipe.bubble_model, ok=c.ok, checks=c.checks,
                       seconds=time.perf_counter() - t0)  # fmt: skip
            rows.append(row)
            ok &= c.ok
            print(f"{plan:11} {mesh:23} {schedule:12} {args.remat:6} {c.vs_single_device:>9.2e} {bound:>9.2e} "
                  f"{c.exact_vs_single_device:>9.2e} {c.reproducible!s:>13} {comm!s:>5} "
                  f"{pipe.bubble_measured:>7.4f} {c.ok!s:>5} {row['seconds']:>5.0f}"
                  + ("" if c.ok else f"  FAILED: {[k for k, v in c.checks.items() if not v]}"), flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\nall cells pass" if ok else "\nFAILED: see the rows marked above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
