"""Checkpoints in the background: how long the training loop blocks per save, and how much slower a
step is while a save is being written, for asynchronous saves (``meshkit train``'s) beside blocking
ones (``Checkpointer.save(..., wait=True)``), in one run.

A GPT (default width 512, 8 layers: 25 M parameters, 0.3 GB of parameters and Adam state) trained
by ``Trainer`` under data parallelism; the batch is small so that a save spans several steps. Per
way, ``--saves`` rounds of: ``--between`` steps without a save (the baseline), a save (timed), and
``wait()`` (timed: what the next save would wait for). Blocking saves go first and give the time a
write takes; after each asynchronous save the loop steps on for 1.5 times that, and the steps that
started within it count as "during the save". Blocked per save: the save call plus the wait.
Goal: a step during an asynchronous save at most 1.1x one without.

    .venv/bin/python benchmarks/bench_checkpoint.py [--width 512] [--layers 8] [--saves 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import numpy as np
import optax

from meshkit.models import gpt, num_params
from meshkit.train import Trainer
from meshkit.train.checkpoint import Checkpointer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--saves", type=int, default=3, help="save rounds per way")
    ap.add_argument("--between", type=int, default=4, help="steps without a save in flight before each save")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()

    cfg = gpt.GPTConfig(vocab_size=256, seq_len=args.seq, layers=args.layers, width=args.width, heads=8)
    n = jax.device_count()
    trainer = Trainer(gpt.make_loss(cfg), gpt.init(jax.random.key(0), cfg), optax.adamw(1e-4), plan="dp",
                      mesh=f"data={n}")  # fmt: skip
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (args.batch * n, args.seq + 1), dtype=np.int32)
    batch = (tokens[:, :-1], tokens[:, 1:])
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((trainer.params, trainer.opt_state)))

    def step() -> float:
        start = time.perf_counter()
        float(trainer.step(batch)["loss"])  # waits for the step
        return time.perf_counter() - start

    for _ in range(3):  # compile, warm up
        step()
    without: list[float] = []
    blocked: dict[str, list[float]] = {"blocking": [], "async": []}
    during: list[float] = []  # steps that started while an asynchronous save was being written
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        number = 0
        for way in ("blocking", "async"):  # blocking first: its saves measure how long a write takes
            with Checkpointer(os.path.join(tmp, way), keep=2) as ck:
                for _ in range(args.saves):
                    without += [step() for _ in range(args.between)]
                    number += 1
                    start = time.perf_counter()
                    ck.save(
                        number, trainer.params, trainer.opt_state, {"step": number}, wait=way == "blocking"
                    )
                    call = time.perf_counter() - start
                    if way == "async":
                        write = statistics.median(blocked["blocking"])
                        while (began := time.perf_counter() - start) < 1.5 * write:
                            took = step()
                            if began < write:
                                during.append(took)
                    waited = time.perf_counter()
                    ck.wait()  # what the next save would wait for, were it now
                    blocked[way].append(call + time.perf_counter() - waited)
    base = statistics.median(without)
    q1, _, q3 = statistics.quantiles(without, n=4)
    print(f"gpt width {cfg.width}, {cfg.layers} layers: {num_params(trainer.params) / 1e6:.1f} M parameters, "
          f"{state_bytes / 2**20:,.0f} MiB of parameters and optimizer state; batch {args.batch * n}x{args.seq}, "
          f"{n} {jax.default_backend()} device(s); {args.saves} saves per way")  # fmt: skip
    print(f"step without a save in flight: {base * 1e3:.1f} ms (median of {len(without)}; "
          f"quartiles {q1 * 1e3:.1f} to {q3 * 1e3:.1f} ms)")  # fmt: skip
    print(
        "| way | loop blocked per save (s) | step during the save (ms) | during / without |\n|---|---|---|---|"
    )
    ratio = statistics.median(during) / base
    print(f"| blocking | {statistics.median(blocked['blocking']):.3f} | (the loop waits) | - |")
    print(f"| async | {statistics.median(blocked['async']):.3f} | {statistics.median(during) * 1e3:.1f} "
          f"(median of {len(during)}) | {ratio:.2f}x |")  # fmt: skip
    b, a = statistics.median(blocked["blocking"]), statistics.median(blocked["async"])
    print(f"the loop blocks {a:.3f} s per asynchronous save against {b:.3f} s per blocking one ({b / a:.1f}x less); "
          f"a step during an asynchronous save: {ratio:.2f}x one without (goal <= 1.1x)")  # fmt: skip


if __name__ == "__main__":
    main()
