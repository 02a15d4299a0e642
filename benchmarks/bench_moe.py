"""A mixture-of-experts layer under expert parallelism beside a dense MLP of the same active FLOPs.

On 8 simulated CPU devices, one training step (Adam) of a one-block GPT in two forms, on the same
batch:

- ``moe ep``: the block's MLP is ``--experts`` experts of hidden width ``ratio x width``, each token
  routed to ``k`` of them (capacity factor ``--capacity-factor``), plan ``ep`` on ``expert=8``:
  rows dispatched and combined by ``all_to_all``;
- ``dense dp``: one MLP of hidden width ``k x ratio x width`` (the same matmul FLOPs per token as the
  k experts a token visits), plan ``dp`` on ``data=8``.

Printed per form: the median step time over rounds, the bytes each device moves per step (read from
the compiled program, with the model's ratio), the measured peak per device (``memory_analysis``:
arguments + temporaries), the parameter count, and the MoE's dropped share; then the ratios moe/dense.
The MoE computes ``capacity_factor`` x the active FLOPs in its experts (empty slots are computed
too) plus its router and the one-hot dispatch/combine einsums.

Run::

    .venv/bin/python benchmarks/bench_moe.py [--width 128] [--seq 128] [--batch 16] [--experts 8] [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import optax

from meshkit.models import gpt
from meshkit.spec import ParallelSpec
from meshkit.train import Trainer


def _measure(cfg: gpt.GPTConfig, plan: str, mesh: str, batch, rounds: int) -> dict:
    params = gpt.init(jax.random.key(0), cfg)
    moe = bool(cfg.experts)
    t = Trainer(gpt.make_loss(cfg, with_aux=moe), params, optax.adam(1e-3), spec=ParallelSpec(plan=plan, mesh=mesh),
                has_aux=moe, logical_axes=gpt.logical_axes(params), tokens_per_example=cfg.seq_len)  # fmt: skip
    report = t.report(batch)
    metrics = t.step(batch)  # compile and warm up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(t.step(batch))
        times.append(time.perf_counter() - start)
    return {
        "time": float(np.median(times)),
        "bytes": sum(c.measured_traffic_bytes for c in report.communication),
        "model_ratio": min((c.ratio for c in report.communication if c.ratio is not None), default=1.0),
        "ledger_ok": report.ok,
        "peak": report.peak["measured_bytes"],
        "params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
        "dropped": float(metrics.get("dropped_fraction", 0.0)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--ratio", type=int, default=4, help="an expert's hidden width / width")
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--rounds", type=int, default=10)
    a = ap.parse_args()
    base = dict(vocab_size=256, seq_len=a.seq, layers=1, width=a.width, heads=4)
    moe = gpt.GPTConfig(**base, mlp_ratio=a.ratio, experts=a.experts, experts_per_token=a.k,
                        capacity_factor=a.capacity_factor)  # fmt: skip
    dense = gpt.GPTConfig(**base, mlp_ratio=a.k * a.ratio)
    tokens = np.random.default_rng(0).integers(0, 256, size=(a.batch, a.seq + 1)).astype(np.int32)
    batch = (tokens[:, :-1], tokens[:, 1:])
    rows = {"moe ep (expert=8)": _measure(moe, "ep", "expert=8", batch, a.rounds),
            "dense dp (data=8)": _measure(dense, "dp", "data=8", batch, a.rounds)}  # fmt: skip
    print(f"one GPT block, width {a.width}, seq {a.seq}, batch {a.batch}; MoE {a.experts} experts x "
          f"{a.ratio * a.width} hidden, top-{a.k}, capacity factor {a.capacity_factor}; dense {a.k * a.ratio * a.width} hidden")  # fmt: skip
    print(
        f"{'':20} {'step ms':>9} {'bytes/device':>13} {'ledger':>7} {'peak KiB':>9} {'params':>9} {'dropped':>8}"
    )
    for name, r in rows.items():
        print(f"{name:20} {r['time'] * 1e3:9.2f} {r['bytes']:13,.0f} {'ok' if r['ledger_ok'] else 'FAIL':>7} "
              f"{r['peak'] / 1024:9.1f} {r['params']:9,} {r['dropped']:8.2%}")  # fmt: skip
    m, d = rows.values()
    print(
        f"moe / dense: time x{m['time'] / d['time']:.2f}, bytes x{m['bytes'] / d['bytes']:.2f}, "
        f"peak x{m['peak'] / d['peak']:.2f}, params x{m['params'] / d['params']:.2f}"
    )


if __name__ == "__main__":
    main()
