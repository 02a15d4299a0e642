"""The head and the loss in pieces (``--loss-chunk``): the compiled training step's peak memory on one TPU
v5e chip, from libtpu's compiler on this machine (no TPU needed), side by side with the whole logits.

The device check's 0.7 B Llama (width 2048, 12 layers, 16 heads, 8 key/value heads, MLP 5632) with Llama
3's vocabulary of 128,256, sequences of 2048, bf16 compute over float32 parameters, AdamW, remat of the
dots, one chip (plan dp). For each piece length (0: the whole logits) and each batch: XLA:TPU's own peak
per chip, its temporaries, and whether it fits the chip's 15.75 GiB (the compiler refuses a step that
does not). Issue 53's goal: the compiled peak at least 30% lower than the whole head's, or a larger batch.

``--run`` trains on the accelerator present instead (``python benchmarks/device_check.py --loss-chunk`` on
the TPU v5e chip: the whole head and pieces of 512 at batches 4 and 8): per piece length and batch, a
Trainer's step (the same model and options) compiled and timed, side by side: tokens/s, the first loss
(equal up to bf16 rounding), the compiled peak and the device's own peak bytes in use.

    .venv/bin/python benchmarks/bench_loss_chunk.py [--target v5e:1x1] [--chunks 0,512,1024] [--batches 2,3,4]
        [--shape L,D,H,K,F] [--run [--steps 10]] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import optax

from meshkit.analysis import memory
from meshkit.models import llama
from meshkit.plans.assemble import assemble
from meshkit.spec import ParallelSpec
from meshkit.spec.batch import TokenBatch
from meshkit.targets import target_devices

GIB = 2**30


def compiled_memory(cfg, chunk: int, batch: int, devices, remat: str) -> dict:
    """One step's figures, or the compiler's refusal."""
    shapes = jax.eval_shape(lambda: llama.init(jax.random.key(0), cfg))
    spec = ParallelSpec(plan="dp", mesh="data=1", remat=remat, precision="bf16")
    step = assemble(llama.make_loss(cfg, loss_chunk=chunk), shapes, optax.adamw(1e-4), spec, devices=devices,
                    logical_axes=llama.logical_axes(shapes))  # fmt: skip
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len), jnp.int32)
    try:
        m = memory(step.step.lower(*step.abstract_args(shapes, TokenBatch(tokens, tokens))).compile())
    except Exception as e:  # XLA:TPU's refusal of a step past the chip's memory
        return {"chunk": chunk, "batch": batch, "fits": False, "error": str(e).splitlines()[0][:160]}
    return {"chunk": chunk, "batch": batch, "fits": True, "peak_gib": (m.peak_bytes or m.total_bytes) / GIB,
            "temp_gib": m.temp_bytes / GIB}  # fmt: skip


def trained(cfg, chunk: int, batch: int, remat: str, steps: int) -> dict:
    """A Trainer's step on this process's first device, compiled and timed (``steps`` after two untimed)."""
    import numpy as np

    from meshkit import Trainer

    params = llama.init(jax.random.key(0), cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, cfg.seq_len + 1), dtype=np.int32)
    row = {"chunk": chunk, "batch": batch}
    try:
        t = Trainer(llama.make_loss(cfg, loss_chunk=chunk), params, optax.adamw(1e-4), plan="dp", mesh="data=1",
                    remat=remat, compute_dtype="bfloat16", logical_axes=llama.logical_axes(params))  # fmt: skip
        timed = time_step(t, TokenBatch(tokens[:, :-1], tokens[:, 1:]), steps)
    except Exception as e:  # out of memory at compile or run
        return row | {"fits": False, "error": str(e).splitlines()[0][:160]}
    stats = jax.devices()[0].memory_stats() or {}
    return row | timed | {"fits": True, "tokens_per_s": batch * cfg.seq_len / timed["step_s"],
                          "device_peak_gib": stats.get("peak_bytes_in_use", 0) / GIB}  # fmt: skip


def time_step(t, batch, steps: int) -> dict:
    """A Trainer's step on ``batch``: compiled (its peak and temporaries), its first loss, then ``steps``
    timed after one untimed (``bench_quantize`` times its variants the same way)."""
    placed = t.put_batch(batch)
    begin = time.perf_counter()
    m = memory(t.compiled(placed))
    compile_s = time.perf_counter() - begin
    first = float(t.step(placed)["loss"])
    t.step(placed)
    jax.block_until_ready(t.params)
    begin = time.perf_counter()
    for _ in range(steps):
        t.step(placed)
    jax.block_until_ready(t.params)
    return {"compile_s": compile_s, "first_loss": first, "step_s": (time.perf_counter() - begin) / steps,
            "peak_gib": (m.peak_bytes or m.total_bytes) / GIB, "temp_gib": m.temp_bytes / GIB}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="v5e:1x1")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--chunks", default="0,512,1024")
    ap.add_argument("--batches", default="2,3,4")
    ap.add_argument("--remat", default="dots")
    ap.add_argument("--shape", default="12,2048,16,8,5632", help="layers,width,heads,kv_heads,ffn (0.7b's)")
    ap.add_argument("--run", action="store_true", help="train on this process's accelerator instead")
    ap.add_argument("--steps", type=int, default=10, help="--run: timed steps")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    layers, width, heads, kv_heads, ffn = map(int, args.shape.split(","))
    cfg = llama.LlamaConfig(vocab_size=args.vocab, seq_len=args.seq, layers=layers, width=width, heads=heads,
                            kv_heads=kv_heads, ffn=ffn, compute_dtype="bfloat16", scan_layers=True)  # fmt: skip
    runs = [(int(b), int(c)) for b in args.batches.split(",") for c in args.chunks.split(",")]
    if args.run:
        devices = jax.devices()[:1]
        rows = [trained(cfg, c, b, args.remat, args.steps) for b, c in runs]
    else:
        devices = target_devices(args.target)[:1]
        rows = [compiled_memory(cfg, c, b, devices, args.remat) for b, c in runs]
    print(f"llama {layers} layers, width {width}, vocab {cfg.vocab_size}, seq {cfg.seq_len}, remat {args.remat}, "
          f"one {devices[0].device_kind}")  # fmt: skip
    print(
        "| batch | --loss-chunk | peak GiB | temporaries GiB | peak / whole head's | run |\n|---|---|---|---|---|---|"
    )
    whole = {r["batch"]: r for r in rows if r["chunk"] == 0}
    for r in rows:
        if not r["fits"]:
            print(f"| {r['batch']} | {r['chunk'] or 'whole'} | does not fit: {r['error']} | | | |")
            continue
        base = whole.get(r["batch"], {})
        ratio = f"{r['peak_gib'] / base['peak_gib']:.3f}" if base.get("fits") else "-"
        ran = f"{r['tokens_per_s']:,.0f} tokens/s, first loss {r['first_loss']:.4f}" if "step_s" in r else ""
        print(
            f"| {r['batch']} | {r['chunk'] or 'whole'} | {r['peak_gib']:.2f} | {r['temp_gib']:.2f} | {ratio} | {ran} |"
        )
    out = {"device": devices[0].device_kind, "jax": jax.__version__, "vocab": cfg.vocab_size, "seq": cfg.seq_len,
           "shape": args.shape, "remat": args.remat, "rows": rows}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
