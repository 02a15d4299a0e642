"""Deterministic mode's price: time and bytes per step beside the normal step, in one run.

On 8 simulated CPU devices (``data=8``, or ``--devices``; a pipeline plan ``stage=2`` x the rest), a GPT
trained by ``meshkit.Trainer`` under each plan, normal and ``deterministic=True`` (8 micro-shards summed in
one fixed tree, compiled without XLA's algebraic simplifier and fused multiply-adds;
``meshkit.plans._deterministic``; a pipeline's normal step runs its default micro-batches, 2, where the
deterministic one runs 8 / data). Printed per plan and mode: the
median step time over ``--rounds`` steps (after two warm-up steps), the bytes into each device per
step measured from the compiled program (every collective's ring traffic, ``meshkit.analysis``), the
compiled temporaries per device, and the deterministic step's ratios to the normal one.

Run::

    .venv/bin/python benchmarks/bench_deterministic.py [--plans dp,zero3,dp+pp] [--layers 2] [--width 128]
        [--batch 32] [--rounds 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import optax

import meshkit
from meshkit import Trainer
from meshkit.analysis import communication, memory
from meshkit.fmt import fmt_bytes
from meshkit.models import gpt


def measure(plan: str, deterministic: bool, cfg: gpt.GPTConfig, batch, rounds: int, devices: int) -> dict:
    if meshkit.PLANS[plan].pipeline:  # two stages, the rest on data
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]).reshape(2, -1), ("stage", "data"))
        cfg = dataclasses.replace(cfg, scan_layers=True)  # a pipeline's stages are the scanned form
        loss = gpt.stages(cfg)
    else:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))
        loss = gpt.make_loss(cfg)
    t = Trainer(loss, gpt.init(jax.random.key(0), cfg), optax.adamw(1e-3), plan=plan, mesh=mesh,
                deterministic=deterministic or None, clip_norm=1.0)  # fmt: skip
    for _ in range(2):
        jax.block_until_ready(t.step(batch))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(t.step(batch))
        times.append(time.perf_counter() - start)
    compiled = t.compiled(batch)
    ledger = communication(compiled, mesh=t.mesh)
    traffic = ledger.traffic_bytes  # every collective, executions counted
    return {"time": statistics.median(times), "bytes": traffic, "temp": memory(compiled).temp_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", default="dp,zero3,dp+pp")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--devices", type=int, default=8)
    args = ap.parse_args()
    meshkit.prepare_deterministic()  # before the backend starts: the normal steps compile without FMAs too
    cfg = gpt.GPTConfig(
        vocab_size=256, seq_len=args.seq, layers=args.layers, width=args.width, heads=4, scan_layers=True
    )  # (a pipeline's stages are the scanned form)
    tokens = np.random.default_rng(0).integers(0, 256, (args.batch, args.seq + 1), dtype=np.int32)
    batch = (tokens[:, :-1], tokens[:, 1:])
    print(f"GPT layers={args.layers} width={args.width} seq={args.seq}, batch {args.batch}, data={args.devices}, "
          f"{jax.device_count()} {jax.default_backend()} devices; median of {args.rounds} steps")  # fmt: skip
    header = (
        f"{'plan':8} {'mode':14} {'step':>10} {'bytes/device':>13} {'temporaries':>12}   ratios (det/normal)"
    )
    print(header)
    for plan in args.plans.split(","):
        normal = measure(plan, False, cfg, batch, args.rounds, args.devices)
        det = measure(plan, True, cfg, batch, args.rounds, args.devices)
        for mode, m in (("normal", normal), ("deterministic", det)):
            ratios = ""
            if m is det:
                ratios = (f"time {det['time'] / normal['time']:.2f}x, bytes {det['bytes'] / normal['bytes']:.2f}x, "
                          f"temporaries {det['temp'] / normal['temp']:.2f}x")  # fmt: skip
            print(f"{plan:8} {mode:14} {m['time'] * 1e3:8.1f}ms {fmt_bytes(m['bytes']):>13} "
                  f"{fmt_bytes(m['temp']):>12}   {ratios}")  # fmt: skip


if __name__ == "__main__":
    main()
