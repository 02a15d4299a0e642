"""The planner at scale: a ~1.3 B GPT on 64 devices (8 hosts x 8), the top layouts meshkit runs
compiled ahead of time on 64 simulated CPU devices beside the planner's prediction of meshkit's step.

Model: 24 layers, width 2048, 16 heads, vocab 32000, seq 1024 (1.28 B parameters); job: global batch
64 sequences, bf16 compute (fp32 parameters and AdamW moments, as meshkit trains); cluster: 64 h100
(8 per host). The planner's search (meshkit's runtime) ranks every layout; the first ``--top`` that
meshkit executes (``Layout.meshkit_plan()``, pipelines with whole layers per stage) are compiled,
each in its own process (``meshkit.planner.compile.compile_layouts``), then the ``--layout``s given
(default: ``EXTRA``, one layout per memory regime: ZeRO-3 without remat, dp+tp with 8 accumulated
micro-batches, ZeRO-3 under layer remat with and without tp, dp+tp under layer remat, fsdp+tp and
fsdp+tp+pp under dots).

Printed per layout: compile seconds, per-device peak (arguments + temporaries) compiled and predicted
(``Job(runtime="meshkit", flash_attention=False)``) and compiled / predicted, and bytes each device sends per
step per mesh axis, compiled (meshkit's ledger) and predicted, with ratios; then the wall time of
the whole run. XLA's CPU compiler moves bf16 collectives as fp32: activation traffic (model, stage)
compiled on CPU is twice what bf16 moves on a GPU, so ``--precision fp32`` compares like with like.

Run (10-45 s per layout on 2 shared cores)::

    .venv/bin/python benchmarks/bench_plan_compile.py [--top 3] [--precision bf16|fp32]
        [--layout dp=16,tp=4,zero=3,remat=layer,mb=1 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

from meshkit.planner.auto import runnable
from meshkit.planner.cluster import Cluster, Job
from meshkit.planner.compile import compile_layouts
from meshkit.planner.hardware import hardware
from meshkit.planner.layout import Layout, ModelShape
from meshkit.planner.predict import predict
from meshkit.planner.search import search

SHAPE = ModelShape(name="gpt-1.3b", layers=24, width=2048, heads=16, vocab=32000, seq=1024)
AXES = ("data", "model", "stage")
EXTRA = ("dp=64,zero=3", "dp=8,tp=8", "dp=16,tp=4,zero=3,remat=layer", "dp=64,zero=3,remat=layer",
         "dp=8,tp=8,remat=layer", "dp=16,tp=4,zero=3,remat=dots", "dp=4,tp=4,pp=4,zero=3,remat=dots")  # fmt: skip


def parse(text: str) -> Layout:
    """``dp=16,tp=4,zero=3,remat=layer,mb=2`` (degrees, then zero, remat, mb, schedule, v)."""
    degrees, options = [], {}
    names = {
        "zero": "zero",
        "remat": "remat",
        "mb": "microbatch_size",
        "schedule": "schedule",
        "v": "virtual_stages",
    }
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() in names:
            name = names[key.strip()]
            options[name] = value.strip() if name in ("remat", "schedule") else int(value)
        else:
            degrees.append(part)
    return Layout.parse(",".join(degrees), **options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument(
        "--layout", action="append", default=None, help="also compile this layout (dp=8,tp=8,zero=3)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    start = time.perf_counter()
    cluster = Cluster(hardware=hardware("h100"), devices=64, devices_per_host=8)
    job = Job(
        global_batch=args.global_batch, precision=args.precision, runtime="meshkit", flash_attention=False
    )
    ranked = [p.layout for p in search(SHAPE, cluster, job).ranked if runnable(p.layout, SHAPE)]
    extra = [parse(text) for text in (EXTRA if args.layout is None else args.layout)]
    layouts = ranked[: args.top] + [lay for lay in extra if lay not in ranked[: args.top]]
    searched = time.perf_counter() - start
    measured = compile_layouts(SHAPE, layouts, job)
    rows = []
    print(
        f"{SHAPE.name} on 64 h100 (8 per host), batch {args.global_batch}, {args.precision}; search {searched:.1f} s"
    )
    print(
        f"{'layout':34s} {'plan':10s} {'compile s':>9s} {'peak GB comp/pred':>18s} {'ratio':>6s}  bytes per axis GB comp/pred (comp/pred)"
    )
    for m in measured:
        p = predict(SHAPE, m.layout, cluster, job)
        if not m.ok:
            print(f"{m.layout.label():34s} not compiled: {m.error}")
            continue
        comm = {
            a: (m.comm_bytes.get(a, 0.0), p.comm_bytes.get(a, 0.0))
            for a in AXES
            if m.comm_bytes.get(a) or p.comm_bytes.get(a)
        }
        text = "  ".join(
            f"{a} {g / 1e9:.2f}/{w / 1e9:.2f} ({g / w if w else float('inf'):.3f})"
            for a, (g, w) in comm.items()
        )
        ratio = m.peak_bytes / p.peak_bytes
        print(
            f"{m.layout.label():34s} {m.plan:10s} {m.compile_s:9.1f} {m.peak_bytes / 1e9:8.2f}/{p.peak_bytes / 1e9:<9.2f} {ratio:6.3f}  {text}"
        )
        rows.append({"layout": m.layout.to_json(), "label": m.layout.label(), "plan": m.plan, "compile_s": m.compile_s,
                     "peak_compiled": m.peak_bytes, "peak_predicted": p.peak_bytes, "peak_ratio": ratio,
                     "comm_compiled": m.comm_bytes, "comm_predicted": p.comm_bytes, "parts": m.parts,
                     "memory_predicted": p.memory})  # fmt: skip
    total = time.perf_counter() - start
    print(f"total {total:.1f} s for {len(layouts)} layout(s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"shape": SHAPE.name, "precision": args.precision, "total_s": total, "rows": rows},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
