"""LoRA beside full fine-tuning of the same Llama, side by side in one run.

Both are ``Trainer`` steps of one plan on the same batch: full fine-tuning trains every leaf; LoRA
(``meshkit.models.lora``, the attention projections at rank ``--rank``) freezes the base
(``trainable=lora.trainable``). Printed per run: trainable parameters, optimizer-state bytes (per
device, as placed), the compiled step's peak (``memory_analysis()``: arguments + temporaries, and the
compiler's own peak where it states one), and the step time (median of ``--steps`` steps, the two
runs' steps interleaved so that both see the same machine), then LoRA / full as ratios.

Run::

    .venv/bin/python benchmarks/bench_lora.py [--width 256] [--layers 4] [--rank 8] [--plan dp] [--mesh data=1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
import optax

import meshkit
from meshkit.analysis.memory import memory
from meshkit.models import llama, lora
from meshkit.plans import device_bytes
from meshkit.train import Trainer


def _trainers(args: argparse.Namespace) -> dict[str, Trainer]:
    cfg = llama.LlamaConfig(vocab_size=1024, seq_len=args.seq, layers=args.layers, width=args.width,
                            heads=8, kv_heads=4, ffn=3 * args.width, scan_layers=True)  # fmt: skip
    base = llama.init(jax.random.key(0), cfg)
    cfg_lora = lora.LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    adapted = lora.add(jax.random.key(1), base, cfg_lora)
    common = {"plan": args.plan, "mesh": args.mesh, "units": llama.units(cfg), "remat": args.remat}
    return {
        "full": Trainer(llama.make_loss(cfg), base, optax.adamw(1e-4), logical_axes=llama.logical_axes(base),
                        **common),
        "lora": Trainer(lora.wrap(llama.make_loss(cfg), cfg_lora), adapted, optax.adamw(1e-4),
                        logical_axes=lora.logical_axes(adapted, llama.logical_axes), trainable=lora.trainable,
                        **common),
    }  # fmt: skip


def _trainable_params(t: Trainer) -> int:
    mask = t.per_layer.trainable
    leaves = jax.tree.leaves(t.params)
    return sum(x.size for i, x in enumerate(leaves) if mask is None or mask.mask[i])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--plan", default="dp")
    ap.add_argument("--mesh", default="data=1")
    ap.add_argument("--remat", default="none")
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args()
    meshkit.simulate_devices(int(np.prod([int(a.split("=")[1]) for a in args.mesh.split(",")])))
    trainers = _trainers(args)
    tokens = np.random.default_rng(0).integers(0, 1024, size=(args.batch, args.seq + 1)).astype(np.int32)
    batch = (tokens[:, :-1], tokens[:, 1:])
    rows = {}
    for name, t in trainers.items():
        m = memory(t.compiled(batch))
        rows[name] = {"trainable": _trainable_params(t), "optimizer": device_bytes(t.opt_state),
                      "peak": m.argument_bytes + m.temp_bytes, "compiler_peak": m.peak_bytes, "times": []}  # fmt: skip
        jax.block_until_ready(t.step(batch))  # warm
    for _ in range(args.steps):  # interleaved: both runs see the same machine
        for name, t in trainers.items():
            start = time.perf_counter()
            jax.block_until_ready(t.step(batch))
            rows[name]["times"].append(time.perf_counter() - start)
    for r in rows.values():
        r["step_s"] = statistics.median(r["times"])
    print(f"Llama width {args.width}, {args.layers} layers, seq {args.seq}, batch {args.batch}, plan {args.plan} "
          f"on {args.mesh}, remat {args.remat}; LoRA rank {args.rank} on wq,wk,wv,wo")  # fmt: skip
    print(f"{'':18}{'full':>14}{'lora':>14}{'lora/full':>11}")
    for key, label in [("trainable", "trainable params"), ("optimizer", "optimizer bytes"),
                       ("peak", "peak bytes"), ("compiler_peak", "compiler peak"), ("step_s", "step time s")]:  # fmt: skip
        a, b = rows["full"][key], rows["lora"][key]
        if a is None or b is None:
            continue
        fmt = (lambda v: f"{v:14.4f}") if key == "step_s" else (lambda v: f"{int(v):14,d}")
        print(f"{label:18}{fmt(a)}{fmt(b)}{b / a:11.4f}")


if __name__ == "__main__":
    main()
