"""Soak: does a long run's memory stay flat? A 2,000-step tiny ``meshkit train`` run under each plan
family, with resident memory, threads and open files sampled every 100 steps.

Each plan runs in its own process (so one plan's caches do not count against the next), through
the same code as ``meshkit train``: ``meshkit.train.loop.prepare`` and ``train`` on the tiny preset
(with 8 heads, so that tp's model axis of 8 holds whole heads) over 8 simulated CPU devices, with
metrics written every step, an evaluation every 250 steps and a checkpoint every 500 (orbax, 3
kept). A sample is taken after every 100th step: resident set size (``VmRSS``), threads (by name,
from ``/proc/self/task/*/comm``, and the Python-level ones) and open file descriptors.

Reading the output: one line per plan with the RSS series in MiB, then the growth after warm-up:
(last sample - sample at step ``--warmup``) / sample at step ``--warmup``; the target is under 5%.
Warm-up (600 steps) includes the first checkpoint, where orbax and tensorstore start their threads.

Threads are judged in three parts. Python threads (``threading.enumerate()``: what meshkit, orbax's
Python side or a metrics writer start) must be constant after warm-up: a thread started per step,
evaluation or checkpoint and never joined would show there. tensorstore (orbax's array writer)
runs a shared pool that starts a worker (``ts_pool_worker``) whenever work waits and none is idle,
and ends a worker, or its overseer, idle for 20 s (``tensorstore/internal/thread/pool_impl.cc``):
its size after a checkpoint depends on timing, not on the step (0 to 9 workers here; 40 saves in
a row reached 9; orbax caps its file I/O at 128 concurrent operations), so it is reported, not
required constant. The other native threads (XLA's pools, LLVM's workers) must be constant, give
or take that pool's overseer, which shows as ``python`` because Linux refuses its 16-character
name ``ts_pool_overseer``: two adjacent counts at most. ``fds`` lists the distinct counts after
warm-up: one value means constant. Exit status 1 if any plan misses a target.

Run (several minutes on 2 cores; ``--steps 600`` for a quick look)::

    .venv/bin/python benchmarks/bench_soak.py [--plans dp,zero1,zero3,tp,fsdp+tp] [--steps 2000]
                                              [--every 100] [--warmup 600] [--json soak.json]
    .venv/bin/python benchmarks/bench_soak.py --report soak.json   # print a saved run again
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

POOL = "ts_pool_worker"
"""tensorstore's shared pool: threads started on demand while a checkpoint is written, ended after 20 s idle."""
FAMILIES = ("dp", "zero1", "zero2", "zero3", "tp", "dp+tp", "fsdp+tp")


def _sample() -> dict[str, int]:
    status = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    return {
        "rss_kib": int(status["VmRSS"].split()[0]),
        "threads": int(status["Threads"]),
        "fds": len(os.listdir("/proc/self/fd")),
        "names": _thread_names(),
        "python_threads": sorted(t.name for t in threading.enumerate()),
    }


def _thread_names() -> dict[str, int]:
    """Threads by name (``/proc/self/task/*/comm``), to say which pool a changing count comes from."""
    names: dict[str, int] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended while listed
            continue
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items()))


def child(plan: str, steps: int, every: int, run_dir: str, checkpoint_every: int) -> None:
    """Run one plan and print its samples as one JSON line."""
    import io

    from rich.console import Console

    from meshkit.devices import simulate_devices

    simulate_devices(8)
    from meshkit.train import config as C
    from meshkit.train import loop
    from meshkit.train.job import prepare

    cfg = C.tiny().replace(plan=plan, steps=steps, eval_every=250, checkpoint_every=checkpoint_every, sample_chars=0,
                           warmup=10, heads=8, run_dir=run_dir)  # fmt: skip
    job = prepare(cfg)
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


def _growth(samples: list[dict], warmup: int) -> float:
    after = [s for s in samples if s["step"] >= warmup]
    first, last = after[0]["rss_kib"], after[-1]["rss_kib"]
    return (last - first) / first


def _threads(samples: list[dict], warmup: int) -> dict:
    """Python threads (must be constant), native threads beside tensorstore's pool (constant but for
    the pool's overseer: two adjacent counts at most), and the pool's workers (reported) after warm-up."""
    after = [s for s in samples if s["step"] >= warmup]
    pool = [s["names"].get(POOL, 0) for s in after]
    native = [s["threads"] - len(s["python_threads"]) - p for s, p in zip(after, pool, strict=True)]
    return {
        "python": sorted({tuple(s["python_threads"]) for s in after}),
        "native": sorted(set(native)),
        "pool": sorted(set(pool)),
        "native_ok": max(native) - min(native) <= 1,
    }


def _verdict(plan: str, samples: list[dict], every: int, warmup: int) -> tuple[bool, dict]:
    """Print one plan's series and figures; (targets met, the figures)."""
    growth, threads = _growth(samples, warmup), _threads(samples, warmup)
    fds = sorted({s["fds"] for s in samples if s["step"] >= warmup})
    good = growth < 0.05 and len(threads["python"]) == 1 and threads["native_ok"] and len(fds) == 1
    series = " ".join(f"{s['rss_kib'] / 1024:.0f}" for s in samples)
    python = " | ".join(",".join(names) for names in threads["python"])
    print(f"{plan:8s} RSS MiB by {every} steps: {series}")
    print(f"{'':8s} growth after step {warmup}: {growth * 100:+.2f}% (target < 5%)  fds {fds}  python threads "
          f"[{python}]  native {threads['native']} + tensorstore pool {threads['pool']}  {'ok' if good else 'MISSED'}")  # fmt: skip
    return good, {"growth": growth, "threads": threads, "fds": fds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--plans", default="dp,zero1,zero3,tp,fsdp+tp", help=f"comma-separated, from {FAMILIES}"
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=600)
    parser.add_argument(
        "--checkpoint-every", type=int, default=500, help="(a run's length: none before the end)"
    )
    parser.add_argument("--json", help="write the series here")
    parser.add_argument("--report", help="print the figures of a run saved with --json, and exit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.every, args.run_dir, args.checkpoint_every)
        return 0
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        verdicts = [_verdict(plan, r["samples"], args.every, args.warmup)[0] for plan, r in saved.items()]
        return 0 if all(verdicts) else 1
    results, ok = {}, True
    print(f"soak: {args.steps} steps of the tiny GPT per plan, 8 simulated CPU devices, a sample every "
          f"{args.every} steps; growth measured from step {args.warmup}")  # fmt: skip
    for plan in args.plans.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", plan, "--steps", str(args.steps), "--every", str(args.every),
                 "--checkpoint-every", str(args.checkpoint_every),
                 "--run-dir", str(Path(tmp) / "run")],
                capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
            )  # fmt: skip
        line = next((x for x in proc.stdout.splitlines() if x.startswith("SAMPLES ")), None)
        if proc.returncode or line is None:
            print(f"{plan}: FAILED (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
            ok = False
            continue
        samples = json.loads(line[len("SAMPLES ") :])
        good, figures = _verdict(plan, samples, args.every, args.warmup)
        ok &= good
        results[plan] = {"samples": samples, **figures}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
