"""Quantized training (``--quantize int8``, ``meshkit.models.quantize``) beside bf16, side by side in one run.

Two measurements, each on the accelerator present (``python benchmarks/device_check.py --quantize`` on
the TPU v5e chip runs both at the 0.7 B Llama):

- speed: the device check's Llama under a Trainer (plan dp on one device, bf16 compute over float32
  parameters, AdamW, ``--remat``), its step with the blocks' matmuls in bf16 and in int8, at the same
  batch: tokens/s, the ratio (issue 53's bar: int8 at least 1.3x bf16), the compiled peak, and the
  first losses (close, not equal: int8 rounds);
- convergence (``--converge STEPS``): both trained ``STEPS`` steps on real text, Python's reference docs
  (``pydoc_data.topics``, bytes as tokens, the last tenth held out), the same batches in the same order:
  the mean loss of the last 20 steps and the held-out loss of each, and their relative gap (the bar:
  within 2%). On a CPU at a small size (``--size tiny``) in a few minutes.

    .venv/bin/python benchmarks/bench_quantize.py [--size 0.7b] [--batch 3] [--remat dots] [--seq 2048]
        [--converge 300 [--seq 256 --batch 8]] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import numpy as np
import optax

from bench_loss_chunk import time_step
from meshkit.analysis import memory
from meshkit.models import llama, quantize
from meshkit.spec.batch import TokenBatch

GIB = 2**30
SIZES = {  # the device check's (device_check.SIZES), with a byte vocabulary for the text
    "tiny": {"layers": 2, "width": 128, "heads": 4, "kv_heads": 2, "ffn": 384},
    "small": {"layers": 4, "width": 256, "heads": 4, "kv_heads": 2, "ffn": 768},
    "0.25b": {"layers": 16, "width": 1024, "heads": 8, "kv_heads": 4, "ffn": 2816},
    "0.7b": {"layers": 12, "width": 2048, "heads": 16, "kv_heads": 8, "ffn": 5632},
}
MODES = ("none", "int8")


def trainer(cfg, mode: str, remat: str, lr: float, optimizer: str = "adamw", loss_chunk: int = 0):
    """The Llama's Trainer on this process's first device (plan dp over one), its matmuls in ``mode``;
    ``optimizer`` AdamW or optax's Muon (the blocks' matrices, ``train.optim.muon_matrices``; AdamW for the
    rest), the head and its loss ``loss_chunk`` positions at a time where given (``--loss-chunk``)."""
    from jax.sharding import Mesh

    from meshkit import Trainer
    from meshkit.train.optim import muon_matrices

    params = llama.init(jax.random.key(0), cfg)
    axes = llama.logical_axes(params)
    loss = quantize.wrap(llama.make_loss(cfg, loss_chunk=loss_chunk), mode)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, 20, 10_000)
    opt = (optax.contrib.muon(schedule, muon_weight_dimension_numbers=muon_matrices(axes), weight_decay=0.01)
           if optimizer == "muon" else optax.adamw(schedule, weight_decay=0.01))  # fmt: skip
    one = Mesh(np.asarray(jax.devices()[:1]), ("data",))
    return Trainer(loss, params, opt, plan="dp", mesh=one, remat=remat, compute_dtype="bfloat16",
                   logical_axes=axes)  # fmt: skip


def speed(cfg, mode: str, batch: int, remat: str, steps: int, **options) -> dict:
    """One Trainer's step compiled and timed (``steps`` after two untimed) on random tokens (``options``:
    :func:`trainer`'s)."""
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, cfg.seq_len + 1), dtype=np.int32)
    row: dict = {"quantize": mode, "batch": batch}
    try:
        t = trainer(cfg, mode, remat, 1e-4, **options)
        timed = time_step(t, TokenBatch(tokens[:, :-1], tokens[:, 1:]), steps)
    except Exception as e:  # out of memory at compile or run
        return row | {"error": str(e).splitlines()[0][:200]}
    return row | timed | {"tokens_per_s": batch * cfg.seq_len / timed["step_s"]}


def compiled(cfg, mode: str, batch: int, remat: str, target: str) -> dict:
    """The step compiled for ``target``'s first chip by libtpu on this machine (no TPU needed): its peak
    and temporaries, and how many of its matmuls (XLA:TPU's ``convolution``) multiply int8 operands."""
    import re

    from meshkit.plans.assemble import assemble
    from meshkit.spec import ParallelSpec
    from meshkit.targets import target_devices

    devices = target_devices(target)[:1]
    shapes = jax.eval_shape(lambda: llama.init(jax.random.key(0), cfg))
    spec = ParallelSpec(plan="dp", mesh="data=1", remat=remat, precision="bf16")
    step = assemble(quantize.wrap(llama.make_loss(cfg), mode), shapes, optax.adamw(1e-4), spec, devices=devices,
                    logical_axes=llama.logical_axes(shapes))  # fmt: skip
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len), np.int32)
    row: dict = {"quantize": mode, "batch": batch, "device": devices[0].device_kind}
    try:
        program = step.step.lower(*step.abstract_args(shapes, TokenBatch(tokens, tokens))).compile()
    except Exception as e:  # XLA:TPU's refusal of a step past the chip's memory
        return row | {"error": str(e).splitlines()[0][:200]}
    m, text = memory(program), program.as_text()
    row["estimated_cycles"] = cycles(text)
    types = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", text))  # each instruction's element type
    matmuls = re.findall(r"= \S+ (?:convolution|dot)\(([^)]*)\)", text)
    int8 = sum(any(types.get(o.split()[-1]) == "s8" or "s8[" in o for o in ops.split(",")) for ops in matmuls)
    return row | {"peak_gib": (m.peak_bytes or m.total_bytes) / GIB, "temp_gib": m.temp_bytes / GIB,
                  "matmuls": len(matmuls), "int8_matmuls": int8}  # fmt: skip


def cycles(text: str) -> dict[str, int]:
    """XLA:TPU's own estimate of a compiled step's cycles (each instruction's ``estimated_cycles`` times how
    often its computation runs: ``analysis.frequencies``, a scanned loop's trip count read from its canonical
    form) by kind: the matmuls on int8 operands and the others, the passes that make int8 operands (an
    absolute maximum, a rounding to ``s8``), and the rest. Kernels (splash) carry no estimate and are not
    counted."""
    import re

    from meshkit.analysis._hlo import frequencies, parse_module

    module = parse_module(text)
    runs = frequencies(module)
    convolutions: dict[str, list] = {}  # a fused computation's matmuls
    for inst in module.instructions:
        if inst.opcode == "convolution":
            convolutions.setdefault(inst.computation, []).append(inst)
    out = dict.fromkeys(("matmul int8", "matmul", "quantize", "other"), 0)
    for inst in module.instructions:
        n = re.search(r'"estimated_cycles":"(\d+)"', inst.attrs)
        if not n or inst.computation not in runs:
            continue
        fused = (re.search(r"calls=%([\w.\-]+)", inst.attrs) or [None, inst.computation])[1]
        convs = convolutions.get(fused, [inst] if inst.opcode == "convolution" else [])
        if convs:
            types = module.operand_types(convs[0]) or ()
            k = "matmul int8" if any(t.dtype == "s8" for t in types) else "matmul"
        elif "s8[" in inst.type_text or inst.name.startswith("abs_reduce"):
            k = "quantize"
        else:
            k = "other"
        out[k] += int(n[1]) * runs[inst.computation].count
    return out


def matmuls(steps: int) -> list[dict]:
    """The 0.7 B Llama's projection shapes (3 sequences of 2048; and a 4096-wide model's at 8) one matmul at
    a time on this device: bf16, int8 operands with int32 sums (the hardware's rate), and Qwix's quantized
    matmul (``quantize.linear``) forward, and forward with both gradients, each against bf16's."""
    import jax.numpy as jnp

    def timed(f, *args) -> float:
        f = jax.jit(f)
        jax.block_until_ready(f(*args))
        begin = time.perf_counter()
        for _ in range(steps):
            r = f(*args)
        jax.block_until_ready(r)
        return (time.perf_counter() - begin) / steps

    def quantized(x, w):
        with quantize.quantized("int8"):
            return quantize.linear(x.reshape(-1, 2048, x.shape[-1]), w)  # sequences of 2048

    def square(f):
        return lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2)

    rows, dims = [], (((1,), (0,)), ((), ()))
    for m, k, n in [(6144, 2048, 5632), (6144, 5632, 2048), (6144, 2048, 2048), (16384, 4096, 4096)]:
        x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        w = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
        plain = timed(lambda a, b: a @ b, x, w)
        raw = timed(lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.int32),
                    x.astype(jnp.int8), w.astype(jnp.int8))  # fmt: skip
        both = timed(jax.grad(square(lambda a, b: a @ b), (0, 1)), x, w)
        rows.append({"shape": [m, k, n], "bf16_tflops": 2 * m * k * n / plain / 1e12,
                     "int8_tops": 2 * m * k * n / raw / 1e12, "qwix_forward": plain / timed(quantized, x, w),
                     "qwix_forward_backward": both / timed(jax.grad(square(quantized), (0, 1)), x, w)})  # fmt: skip
    return rows


def text_tokens() -> np.ndarray:
    """Python's reference docs as bytes: real text nobody here wrote, present wherever Python is."""
    from pydoc_data.topics import topics

    return np.frombuffer("\n\n".join(topics[k] for k in sorted(topics)).encode(), dtype=np.uint8).astype(
        np.int32
    )


def converge(cfg, mode: str, batch: int, remat: str, steps: int, lr: float) -> dict:
    """``steps`` steps on the text's first nine tenths (windows drawn by a fixed seed: the same for every
    mode), then the held-out loss on 16 windows of the last tenth (in the mode trained)."""
    data = text_tokens()
    cut, t = len(data) * 9 // 10, cfg.seq_len + 1
    rng = np.random.default_rng(0)
    tr = trainer(cfg, mode, remat, lr)
    losses, begin = [], time.perf_counter()
    for _ in range(steps):
        starts = rng.integers(0, cut - t, batch)
        rows = np.stack([data[s : s + t] for s in starts])
        losses.append(float(tr.step(tr.put_batch(TokenBatch(rows[:, :-1], rows[:, 1:])))["loss"]))
        if len(losses) % 50 == 0:
            print(
                f"{mode}: step {len(losses)}, loss {np.mean(losses[-50:]):.4f}", file=sys.stderr, flush=True
            )
    seconds = time.perf_counter() - begin
    held = np.stack([data[s : s + t] for s in np.linspace(cut, len(data) - t, 16).astype(int)])
    loss = jax.jit(quantize.wrap(llama.make_loss(cfg), mode))
    held_out = float(loss(tr.params, TokenBatch(held[:, :-1], held[:, 1:])))
    finite = bool(np.isfinite(losses).all())
    return {"quantize": mode, "steps": steps, "first_loss": losses[0], "last20_loss": float(np.mean(losses[-20:])),
            "held_out_loss": held_out, "finite": finite, "seconds": seconds, "losses": losses}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.7b", choices=list(SIZES))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--remat", default="dots")
    ap.add_argument("--steps", type=int, default=10, help="timed steps of the speed run")
    ap.add_argument(
        "--converge", type=int, default=0, help="train this many steps on text instead (0: speed)"
    )
    ap.add_argument("--lr", type=float, default=1e-3, help="--converge: the peak learning rate")
    ap.add_argument(
        "--target", default=None, help="compile only, for this TPU topology (v5e:1x1), with libtpu"
    )
    ap.add_argument(
        "--matmuls", action="store_true", help="time the projections' matmuls one at a time instead"
    )
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    vocab = 256 if a.converge else 32000
    cfg = llama.LlamaConfig(
        vocab_size=vocab, seq_len=a.seq, compute_dtype="bfloat16", scan_layers=True, **SIZES[a.size]
    )
    device = jax.devices()[0].device_kind
    head = f"Llama {a.size}, seq {a.seq}, batch {a.batch}, remat {a.remat}, bf16 over float32 AdamW, one {device}"
    if a.matmuls:
        rows = matmuls(a.steps)
        print(f"one matmul at a time on one {device}: rows x in x out")
        print(
            "| shape | bf16 TFLOP/s | int8 TOP/s | Qwix forward / bf16 | forward + backward / bf16 |\n|---|---|---|---|---|"
        )
        for r in rows:
            print(f"| {' x '.join(map(str, r['shape']))} | {r['bf16_tflops']:.0f} | {r['int8_tops']:.0f} | "
                  f"{r['qwix_forward']:.2f}x | {r['qwix_forward_backward']:.2f}x |")  # fmt: skip
        out = {}
    elif a.target:
        rows = [compiled(cfg, m, a.batch, a.remat, a.target) for m in MODES]
        print(head.replace(f"one {device}", f"compiled for {a.target} here"))
        print("| matmuls | compiled peak GiB | temporaries GiB | int8 matmuls / all |\n|---|---|---|---|")
        for r in rows:
            fig = (f"{r['peak_gib']:.2f} | {r['temp_gib']:.2f} | {r['int8_matmuls']} / {r['matmuls']}"
                   if "error" not in r else f"does not fit: {r['error']} | |")  # fmt: skip
            print(f"| {r['quantize']} | {fig} |")
        for r in rows:  # XLA:TPU's own estimate, in millions of cycles
            if "estimated_cycles" in r:
                print(f"{r['quantize']}: estimated M cycles " + ", ".join(
                    f"{k} {v / 1e6:.1f}" for k, v in r["estimated_cycles"].items()))  # fmt: skip
        out = {"target": a.target}
    elif a.converge:
        rows = [converge(cfg, m, a.batch, a.remat, a.converge, a.lr) for m in MODES]
        base, q = rows
        gap = (q["last20_loss"] - base["last20_loss"]) / base["last20_loss"]
        held = (q["held_out_loss"] - base["held_out_loss"]) / base["held_out_loss"]
        print(head + f", {a.converge} steps on pydoc_data's text")
        print("| matmuls | first loss | mean of the last 20 | held-out | seconds |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['quantize']} | {r['first_loss']:.4f} | {r['last20_loss']:.4f} | {r['held_out_loss']:.4f} | "
                  f"{r['seconds']:.0f} |")  # fmt: skip
        print(
            f"int8 vs bf16: last 20 steps {100 * gap:+.2f}%, held-out {100 * held:+.2f}% (the bar: within 2%)"
        )
        out = {"gap_last20": gap, "gap_held_out": held}
    else:
        rows = [speed(cfg, m, a.batch, a.remat, a.steps) for m in MODES]
        print(head)
        print(
            "| matmuls | tokens/s | step ms | compiled peak GiB | first loss | compile s |\n|---|---|---|---|---|---|"
        )
        for r in rows:
            if "error" in r:
                print(f"| {r['quantize']} | {r['error']} | | | | |")
                continue
            print(f"| {r['quantize']} | {r['tokens_per_s']:,.0f} | {1e3 * r['step_s']:.1f} | {r['peak_gib']:.2f} | "
                  f"{r['first_loss']:.4f} | {r['compile_s']:.1f} |")  # fmt: skip
        ok = all("step_s" in r for r in rows)
        ratio = rows[0]["step_s"] / rows[1]["step_s"] if ok else None
        print(f"int8 / bf16 tokens/s: {ratio:.3f}x (the bar: 1.3x)" if ok else "int8 / bf16: n/a")
        out = {"int8_over_bf16_tokens_per_s": ratio}
    out |= {
        "device": device,
        "jax": jax.__version__,
        "size": a.size,
        "model": dataclasses.asdict(cfg) | {"compute_dtype": "bfloat16"},
        "batch": a.batch,
        "seq": a.seq,
        "remat": a.remat,
        "rows": rows,
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
