"""Issue 53's variants of one training step side by side in one run: bf16, int8, Muon, the head in pieces.

The device check's 0.7 B Llama (sequences of 2048, bf16 compute over float32 parameters, plan dp on the
process's first device, ``--remat``), one Trainer per row at the same batch, each timed as
``bench_quantize`` times its rows (``bench_loss_chunk.time_step``: the compiled peak, the first loss, then
``--steps`` timed after two):

- ``bf16``: AdamW, every matmul in bf16 (the device check's meshkit step);
- ``int8``: the blocks' matmuls through Qwix in int8, forward and backward (``--quantize int8``);
- ``muon``: optax's Muon on the blocks' matrices (``train.optim.muon_matrices``), AdamW on the rest: one
  float32 moment a matrix where AdamW keeps two, and five Newton-Schulz iterations on every matrix a step;
- ``chunk``: the head and its loss 512 positions at a time (``--loss-chunk 512``).

Tokens/s, each row's ratio to bf16's, MFU (``llama.flops_per_token`` over the chip's peak at bf16:
``planner.hardware.peak_flops``; Muon's own matmuls are not the model's and are not counted), the compiled
peak and the first loss. On the TPU v5e chip: ``python benchmarks/device_check.py --variants``; on a CPU at
``--size tiny`` in seconds (``tests/test_device_check.py``)::

    .venv/bin/python benchmarks/bench_variants.py [--size 0.7b] [--batch 3] [--remat dots] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import jax

from bench_quantize import SIZES, speed
from meshkit.models import llama

VARIANTS = {
    "bf16": {"mode": "none"},
    "int8": {"mode": "int8"},
    "muon": {"mode": "none", "optimizer": "muon"},
    "chunk": {"mode": "none", "loss_chunk": 512},
}
"""Each row: its matmuls' mode (``bench_quantize.speed``) and the Trainer's options (``bench_quantize.trainer``)."""


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.7b", choices=list(SIZES))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--remat", default="dots")
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each row")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {', '.join(VARIANTS)}")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    names = a.variants.split(",")
    if unknown := sorted(set(names) - set(VARIANTS)):
        raise SystemExit(f"unknown --variants {', '.join(unknown)}: use some of {', '.join(VARIANTS)}")
    cfg = llama.LlamaConfig(
        vocab_size=32000, seq_len=a.seq, compute_dtype="bfloat16", scan_layers=True, **SIZES[a.size]
    )
    from meshkit.planner.hardware import peak_flops

    device = jax.devices()[0].device_kind
    peak, _ = peak_flops(device, "bf16")
    rows = []
    for name in names:
        options = dict(VARIANTS[name])
        if "loss_chunk" in options:  # a divisor of the sequence (--size tiny's are shorter than a piece)
            options["loss_chunk"] = min(options["loss_chunk"], a.seq)
        row = speed(cfg, options.pop("mode"), a.batch, a.remat, a.steps, **options) | {"variant": name}
        if "step_s" in row and peak:
            row["mfu"] = row["tokens_per_s"] * llama.flops_per_token(cfg) / peak
        rows.append(row)
    base = next((r for r in rows if r["variant"] == "bf16" and "step_s" in r), None)
    print(
        f"Llama {a.size}, seq {a.seq}, batch {a.batch}, remat {a.remat}, bf16 over float32 parameters, one {device}"
    )
    print(
        "| variant | tokens/s | vs bf16 | MFU | compiled peak GiB | first loss |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['error']} | | | | |")
            continue
        r["vs_bf16"] = base["step_s"] / r["step_s"] if base else None
        ratio = f"{r['vs_bf16']:.3f}x" if base else "n/a"
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "n/a"
        print(f"| {r['variant']} | {r['tokens_per_s']:,.0f} | {ratio} | {mfu} | {r['peak_gib']:.2f} | "
              f"{r['first_loss']:.4f} |")  # fmt: skip
    out = {"device": device, "jax": jax.__version__, "size": a.size, "seq": a.seq, "batch": a.batch,
           "remat": a.remat, "rows": rows}  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
