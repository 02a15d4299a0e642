"""How fast the communication ledger reads HLO text, and whether it stays linear in the text size.

Builds synthetic modules of growing size (each block: a while loop whose body holds a tuple
all-reduce, an all-gather and a reduce-scatter with iota / mesh-axis groups, plus ordinary
instructions), times `communication()` on each, and prints lines per second and the per-line
time of each size relative to the smallest, measured in one run. Linear means the ratio stays
near 1.00 as the text grows 16x.

    .venv/bin/python benchmarks/bench_ledger.py [--blocks 500]
"""

from __future__ import annotations

import argparse
import time

from meshkit.analysis import communication

HEADER = """HloModule bench, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""

BLOCK = """
%body{i} (s{i}: (s32[], f32[1024])) -> (s32[], f32[1024]) {{
  %s{i} = (s32[], f32[1024]{{0}}) parameter(0)
  %c{i} = s32[] get-tuple-element(%s{i}), index=0
  %v{i} = f32[1024]{{0}} get-tuple-element(%s{i}), index=1
  %m{i} = f32[1024]{{0}} multiply(%v{i}, %v{i}), metadata={{op_name="jit(step)/mul" source_file="model.py" source_line=12}}
  %ar{i} = (f32[1024]{{0}}, f32[1024]{{0}}) all-reduce(%v{i}, %m{i}), channel_id=1, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add
  %x{i} = f32[1024]{{0}} get-tuple-element(%ar{i}), index=0
  %sl{i} = f32[128]{{0}} slice(%x{i}), slice={{[0:128]}}
  %ag{i} = f32[1024]{{0}} all-gather(%sl{i}), channel_id=2, replica_groups=mesh['data'=4,'model'=2] {{'data','model'}}, dimensions={{0}}, use_global_device_ids=true
  %rs{i} = f32[128]{{0}} reduce-scatter(%ag{i}), channel_id=3, replica_groups=[1,8]<=[8], dimensions={{0}}, use_global_device_ids=true, to_apply=%add
  %e{i} = f32[1024]{{0}} broadcast(%rs{i}), dimensions={{}}
  ROOT %r{i} = (s32[], f32[1024]{{0}}) tuple(%c{i}, %e{i})
}}

%cond{i} (s{i}c: (s32[], f32[1024])) -> pred[] {{
  %s{i}c = (s32[], f32[1024]{{0}}) parameter(0)
  ROOT %t{i}c = pred[] constant(true)
}}
"""


def module(blocks: int) -> str:
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
    return HEADER + "".join(BLOCK.format(i=i) for i in range(blocks)) + "\n".join(entry) + "\n"


def timed(text: str, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        led = communication(text)
        best = min(best, time.perf_counter() - t0)
    assert led.count() > 0
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--blocks", type=int, default=250, help="blocks in the smallest module (x1, x4, x16 are run)"
    )
    args = ap.parse_args()
    rows = []
    for scale in (1, 4, 16):
        text = module(args.blocks * scale)
        lines = text.count("\n")
        seconds = timed(text)
        rows.append((scale, lines, seconds))
    base = rows[0][2] / rows[0][1]
    print(f"{'size':>5} {'lines':>9} {'seconds':>9} {'lines/s':>11} {'time/line vs x1':>16}")
    for scale, lines, seconds in rows:
        print(
            f"{'x' + str(scale):>5} {lines:>9,} {seconds:>9.3f} {lines / seconds:>11,.0f} {seconds / lines / base:>16.2f}"
        )
    worst = max(s / n / base for _, n, s in rows)
    print(
        f"linearity: worst time per line is {worst:.2f}x the smallest module's ({'ok' if worst < 1.5 else 'NOT LINEAR'})"
    )


if __name__ == "__main__":
    main()
