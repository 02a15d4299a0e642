"""How fast the communication ledger reads HLO text, and how fast the `meshkit comm` CLI answers.

1. Library: builds synthetic modules of growing size (each block: a while loop whose body holds a
   tuple all-reduce, an all-gather and a reduce-scatter with iota / mesh-axis groups, plus ordinary
   instructions), times `communication()` on each, and prints lines per second and the per-line
   time of each size relative to the smallest. Linear means the ratio stays near 1.00 as the text
   grows 16x.
2. CLI end to end on a large dump (default: 750 blocks = 2,250 collectives padded with ordinary
   instructions to about 4 MB, the size of a real Llama dump): `meshkit comm --hlo` (tables) and
   `--all` (one line per collective), wall and CPU seconds, each in a fresh process.
3. CLI start-up on a tiny file, beside `python -c pass` and `python -c "import jax"` (what every
   command paid before the imports became lazy). The target: well under 1 s.

Wall times depend on the machine's load; CPU seconds (user + system of the child) less so.

    .venv/bin/python benchmarks/bench_ledger.py [--blocks 250] [--big-blocks 750] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshkit.analysis import communication

HEADER = """HloModule bench, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""

BLOCK = """
%body{i} (st{i}: (s32[], f32[1024])) -> (s32[], f32[1024]) {{
  %st{i} = (s32[], f32[1024]{{0}}) parameter(0)
  %c{i} = s32[] get-tuple-element(%st{i}), index=0
  %v{i} = f32[1024]{{0}} get-tuple-element(%st{i}), index=1
  %m{i} = f32[1024]{{0}} multiply(%v{i}, %v{i}), metadata={{op_name="jit(step)/mul" source_file="model.py" source_line=12}}
  %ar{i} = (f32[1024]{{0}}, f32[1024]{{0}}) all-reduce(%v{i}, %m{i}), channel_id=1, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add
  %x{i} = f32[1024]{{0}} get-tuple-element(%ar{i}), index=0
  %sl{i} = f32[128]{{0}} slice(%x{i}), slice={{[0:128]}}
  %ag{i} = f32[1024]{{0}} all-gather(%sl{i}), channel_id=2, replica_groups=mesh['data'=4,'model'=2] {{'data','model'}}, dimensions={{0}}, use_global_device_ids=true
  %rs{i} = f32[128]{{0}} reduce-scatter(%ag{i}), channel_id=3, replica_groups=[1,8]<=[8], dimensions={{0}}, use_global_device_ids=true, to_apply=%add
  %e{i} = f32[1024]{{0}} broadcast(%rs{i}), dimensions={{}}
  ROOT %r{i} = (s32[], f32[1024]{{0}}) tuple(%c{i}, %e{i})
}}

%cond{i} (st{i}c: (s32[], f32[1024])) -> pred[] {{
  %st{i}c = (s32[], f32[1024]{{0}}) parameter(0)
  ROOT %t{i}c = pred[] constant(true)
}}
"""


FILLER = (
    '  %f{i}_{k} = f32[1024]{{0}} add(%m{i}, %m{i}), metadata={{op_name="jit(train_step)/jvp(transformer)/'
    'layers_{k}/attention/add" source_file="/home/user/project/model/transformer.py" source_line={k}}}\n'
)


def module(blocks: int, filler: int = 0) -> str:
    entry = [
        "ENTRY %main (p: (s32[], f32[1024])) -> (s32[], f32[1024]) {\n  %p = (s32[], f32[1024]{0}) parameter(0)"
    ]
    prev = "%p"
    for i in range(blocks):
        entry.append(
            f"  %w{i} = (s32[], f32[1024]{{0}}) while({prev}), condition=%cond{i}, body=%body{i}, "
            f'backend_config={{"known_trip_count":{{"n":"{i % 7 + 1}"}}}}'
        )
        prev = f"%w{i}"
    entry.append(f"  ROOT %out = (s32[], f32[1024]{{0}}) copy({prev})\n}}")
    body = (
        BLOCK.format(i=i).replace(
            "  ROOT %r", "".join(FILLER.format(i=i, k=k) for k in range(filler)) + "  ROOT %r"
        )
        for i in range(blocks)
    )
    return HEADER + "".join(body) + "\n".join(entry) + "\n"


def timed(text: str, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        led = communication(text)
        best = min(best, time.perf_counter() - t0)
    assert led.count() > 0
    return best


def cli(args: list[str], repeats: int) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds of a fresh process running ``args``."""
    walls, cpus = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        out = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "COLUMNS": "132"})
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if out.returncode != 0:
            raise SystemExit(f"{' '.join(args)} failed: {out.stderr.strip()}")
    return statistics.median(walls), statistics.median(cpus)


def library(blocks: int) -> None:
    rows = []
    for scale in (1, 4, 16):
        text = module(blocks * scale)
        lines = text.count("\n")
        seconds = timed(text)
        rows.append((scale, lines, seconds))
    base = rows[0][2] / rows[0][1]
    print("library: communication() on HLO text")
    print(f"{'size':>5} {'lines':>9} {'seconds':>9} {'lines/s':>11} {'time/line vs x1':>16}")
    for scale, lines, seconds in rows:
        print(
            f"{'x' + str(scale):>5} {lines:>9,} {seconds:>9.3f} {lines / seconds:>11,.0f} {seconds / lines / base:>16.2f}"
        )
    worst = max(s / n / base for _, n, s in rows)
    print(
        f"linearity: worst time per line is {worst:.2f}x the smallest module's ({'ok' if worst < 1.5 else 'NOT LINEAR'})"
    )


def end_to_end(big_blocks: int, repeats: int) -> None:
    meshkit = str(Path(sys.executable).parent / "meshkit")
    with tempfile.TemporaryDirectory() as tmp:
        big, tiny = Path(tmp) / "big.hlo", Path(tmp) / "tiny.hlo"
        big.write_text(module(big_blocks, filler=20))
        tiny.write_text(module(1))
        size_mb = big.stat().st_size / 1e6
        lib = timed(big.read_text(), repeats=1)
        print(
            f"\nCLI end to end: {size_mb:.1f} MB dump, {3 * big_blocks:,} collective instructions (median of {repeats})"
        )
        print(f"{'command':<44} {'wall s':>8} {'CPU s':>8}")
        print(f"{'communication() in process (library only)':<44} {lib:>8.2f} {'':>8}")
        for label, extra in (
            ("meshkit comm --hlo BIG (tables)", []),
            ("meshkit comm --hlo BIG --all", ["--all"]),
        ):
            wall, cpu = cli([meshkit, "comm", "--hlo", str(big), *extra], repeats)
            print(f"{label:<44} {wall:>8.2f} {cpu:>8.2f}")
        print(f"\nCLI start-up on a tiny file (median of {repeats})")
        print(f"{'command':<44} {'wall s':>8} {'CPU s':>8}")
        start = None
        for label, args in (
            ("python -c pass", [sys.executable, "-c", "pass"]),
            ('python -c "import jax" (paid before)', [sys.executable, "-c", "import jax"]),
            ("meshkit comm --hlo TINY", [meshkit, "comm", "--hlo", str(tiny)]),
        ):
            wall, cpu = cli(args, repeats)
            start = (wall, cpu)
            print(f"{label:<44} {wall:>8.2f} {cpu:>8.2f}")
        verdict = "ok" if start[1] < 1.0 else "OVER 1 s of CPU"
        print(f"start-up target (< 1 s): {verdict}; wall time grows with the machine's load")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--blocks", type=int, default=250, help="blocks in the smallest module (x1, x4, x16 are run)"
    )
    ap.add_argument("--big-blocks", type=int, default=750, help="blocks of the large dump the CLI reads")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each CLI command (median printed)")
    args = ap.parse_args()
    library(args.blocks)
    end_to_end(args.big_blocks, args.repeats)


if __name__ == "__main__":
    main()
