"""Soak: does a long run's memory stay flat? A 2,000-step tiny ``meshkit train`` run under each plan
family, with resident memory, threads and open files sampled every 100 steps.

Each plan runs in its own process (so one plan's caches do not count against the next), through
the same code as ``meshkit train``: ``meshkit.train.loop.prepare`` and ``train`` on the tiny preset
over 8 simulated CPU devices, with metrics written every step, an evaluation every 250 steps and a
checkpoint every 500 (orbax, 3 kept). A sample is taken after every 100th step: resident set size
(``VmRSS``), threads and open file descriptors of the process, from ``/proc/self``.

Reading the output: one line per plan with the RSS series in MiB, then the growth after warm-up:
(last sample - sample at step ``--warmup``) / sample at step ``--warmup``; the target is under 5%.
Warm-up (600 steps) includes the first checkpoint: orbax starts its thread pools at the first save.
``threads`` and ``fds`` list the distinct values seen after warm-up: one value each means constant.
Exit status 1 if any plan misses a target.

Run (several minutes on 2 cores; ``--steps 600`` for a quick look)::

    .venv/bin/python benchmarks/bench_soak.py [--plans dp,zero1,zero3,tp,fsdp+tp] [--steps 2000]
                                              [--every 100] [--warmup 600] [--json soak.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FAMILIES = ("dp", "zero1", "zero2", "zero3", "tp", "dp+tp", "fsdp+tp")


def _sample() -> dict[str, int]:
    status = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    return {
        "rss_kib": int(status["VmRSS"].split()[0]),
        "threads": int(status["Threads"]),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def child(plan: str, steps: int, every: int, run_dir: str) -> None:
    """Run one plan and print its samples as one JSON line."""
    import io

    from rich.console import Console

    from meshkit.devices import simulate_devices

    simulate_devices(8)
    from meshkit.train import config as C
    from meshkit.train import loop

    cfg = C.tiny().replace(plan=plan, steps=steps, eval_every=250, checkpoint_every=500, sample_chars=0,
                           warmup=10, run_dir=run_dir)  # fmt: skip
    job = loop.prepare(cfg)
    job.run_dir.mkdir(parents=True, exist_ok=True)
    samples = []
    one_step = loop._one_step

    def sampled(job_, lr):
        row = one_step(job_, lr)
        if job_.step % every == 0:
            samples.append({"step": job_.step, **_sample()})
        return row

    loop._one_step = sampled  # the benchmark's probe: the loop itself is unchanged
    assert loop.train(job, Console(file=io.StringIO()))
    print("SAMPLES " + json.dumps(samples), flush=True)


def _growth(samples: list[dict], warmup: int) -> tuple[float, set[int], set[int]]:
    after = [s for s in samples if s["step"] >= warmup]
    first, last = after[0]["rss_kib"], after[-1]["rss_kib"]
    return (last - first) / first, {s["threads"] for s in after}, {s["fds"] for s in after}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--plans", default="dp,zero1,zero3,tp,fsdp+tp", help=f"comma-separated, from {FAMILIES}"
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=600)
    parser.add_argument("--json", help="write the series here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.every, args.run_dir)
        return 0
    results, ok = {}, True
    print(f"soak: {args.steps} steps of the tiny GPT per plan, 8 simulated CPU devices, a sample every "
          f"{args.every} steps; growth measured from step {args.warmup}")  # fmt: skip
    for plan in args.plans.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", plan, "--steps", str(args.steps), "--every", str(args.every),
                 "--run-dir", str(Path(tmp) / "run")],
                capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
            )  # fmt: skip
        line = next((x for x in proc.stdout.splitlines() if x.startswith("SAMPLES ")), None)
        if proc.returncode or line is None:
            print(f"{plan}: FAILED (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
            ok = False
            continue
        samples = json.loads(line[len("SAMPLES ") :])
        growth, threads, fds = _growth(samples, args.warmup)
        good = growth < 0.05 and len(threads) == 1 and len(fds) == 1
        ok &= good
        results[plan] = {"samples": samples, "growth": growth, "threads": sorted(threads), "fds": sorted(fds)}
        series = " ".join(f"{s['rss_kib'] / 1024:.0f}" for s in samples)
        print(f"{plan:8s} RSS MiB by {args.every} steps: {series}")
        print(f"{'':8s} growth after step {args.warmup}: {growth * 100:+.2f}% (target < 5%)  threads {sorted(threads)}  "
              f"fds {sorted(fds)}  {'ok' if good else 'MISSED'}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
