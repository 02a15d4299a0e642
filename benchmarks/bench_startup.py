"""The persistent compilation cache: the first start of a ``meshkit train`` against the second start
of the same run (another run directory, the same options), with the cache in a fresh directory, and
the same run with ``--compile-cache off`` beside them.

Each start is a new process; timed are the wall-clock seconds to its first metrics row (JAX's start,
data, model, the step's compile and one step) and to its end (``--steps`` steps, evaluation, the
report's compiles, plots).

    .venv/bin/python benchmarks/bench_startup.py [--steps 4] [-- more meshkit train options]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MESHKIT = str(Path(sys.executable).parent / "meshkit")


def start(run_dir: Path, cache: str, args: argparse.Namespace) -> tuple[float, float]:
    """(seconds to the first metrics row, seconds to the end) of one ``meshkit train``."""
    cmd = [MESHKIT, "train", "--preset", args.preset, "--steps", str(args.steps), "--warmup", "1",
           "--eval-every", "0", "--sample-chars", "0", "--run-dir", str(run_dir), "--compile-cache", cache,
           *args.extra]  # fmt: skip
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT"))
    }
    metrics, first = run_dir / "metrics.jsonl", None
    began = time.perf_counter()
    with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        while proc.poll() is None:
            if first is None and metrics.is_file() and metrics.stat().st_size:
                first = time.perf_counter() - began
            time.sleep(0.01)
        err = proc.stderr.read()
    end = time.perf_counter() - began
    if proc.returncode:
        raise SystemExit(f"meshkit train failed ({proc.returncode}): {err[-2000:]}")
    return (first if first is not None else end), end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("extra", nargs="*", help="more meshkit train options (after --)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cache = root / "cache"
        rows = {
            "first start (cache empty)": start(root / "run1", str(cache), args),
            "second start (cache filled)": start(root / "run2", str(cache), args),
            "--compile-cache off": start(root / "run3", "off", args),
        }
        entries = [p for p in cache.iterdir() if p.name.endswith("-cache")]
        size = sum(p.stat().st_size for p in entries)
    print(f"meshkit train --preset {args.preset} --steps {args.steps} {' '.join(args.extra)}".rstrip())
    print(f"cache: {len(entries)} entries, {size / 2**20:.1f} MiB after the first start")
    print("| start | to the first step (s) | to the end (s) |\n|---|---|---|")
    for name, (first, end) in rows.items():
        print(f"| {name} | {first:.1f} | {end:.1f} |")
    (f1, e1), (f2, e2) = rows["first start (cache empty)"], rows["second start (cache filled)"]
    print(
        f"second start against the first: {f2 / f1:.2f}x the time to the first step, {e2 / e1:.2f}x to the end"
    )


if __name__ == "__main__":
    main()
