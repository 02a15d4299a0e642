"""Checkpoints in the background: how much slower a step is while a save is being written, and how
long the training loop blocks per save, measured side by side in one run.

A GPT (default width 512, 8 layers: 25 M parameters, 0.3 GB of parameters and Adam state) trained
by ``Trainer`` under data parallelism; the batch is small so that a save spans several steps.

1. Steps during a save (issue 35). Blocking saves (``Checkpointer.save(..., wait=True)``) first,
   which give the time a write takes; then ``--saves`` rounds of ``--between`` steps without a save
   (the baseline), an asynchronous save, and steps until it is written: those are "during the save".
   Goal: a step during a save at most 1.1x one without.
2. Blocking per save, meshkit against a plain orbax ``CheckpointManager`` keeping as many steps
   (issue 39), in alternate rounds: a save, then steps until the write is done (orbax's
   ``is_saving_in_progress``), so that what the loop blocks for is the save's own bookkeeping, not
   the write; the saves past ``keep`` each delete a step. Blocked: meshkit's ``save`` (which waits
   for the previous one), orbax's ``wait_until_finished`` + ``save``. Goal: within 1.2x of orbax.
   The first step after each save is shown too: on the CPU backend orbax's copy off the devices is
   a view of the live buffers, so that step (donating its inputs) allocates and copies them anew,
   where meshkit copies once in ``save``.

    .venv/bin/python benchmarks/bench_checkpoint.py [--width 512] [--layers 8] [--saves 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

from meshkit.models import gpt, num_params
from meshkit.train import Trainer
from meshkit.train.checkpoint import Checkpointer


def _median_ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} ms"


def during_saves(step: Callable[[], float], trainer: Trainer, tmp: str, args) -> None:
    """Part 1: steps while an asynchronous save is written, against steps without one."""
    without: list[float] = []
    during: list[float] = []
    blocking: list[float] = []
    calls: list[float] = []
    waits: list[float] = []
    with Checkpointer(os.path.join(tmp, "blocking"), keep=2) as ck:
        for number in range(1, args.saves + 1):
            without += [step() for _ in range(args.between)]
            start = time.perf_counter()
            ck.save(number, trainer.params, trainer.opt_state, {"step": number})
            blocking.append(time.perf_counter() - start)
    with Checkpointer(os.path.join(tmp, "async"), keep=2) as ck:
        for number in range(1, args.saves + 1):
            without += [step() for _ in range(args.between)]
            start = time.perf_counter()
            ck.save(number, trainer.params, trainer.opt_state, {"step": number}, wait=False)
            calls.append(time.perf_counter() - start)
            while ck._manager.is_saving_in_progress():  # the write goes on
                during.append(step())
            start = time.perf_counter()
            ck.wait()
            waits.append(time.perf_counter() - start)
    base = statistics.median(without)
    q1, _, q3 = statistics.quantiles(without, n=4)
    ratio = statistics.median(during) / base
    print(f"step without a save in flight: {_median_ms(without)} (median of {len(without)}; "
          f"quartiles {q1 * 1e3:.1f} to {q3 * 1e3:.1f} ms)")  # fmt: skip
    print(f"blocking save: {statistics.median(blocking):.3f} s; asynchronous: the call {statistics.median(calls):.3f} s, "
          f"then {len(during) / args.saves:.1f} steps per save while it is written, wait() {statistics.median(waits):.3f} s")  # fmt: skip
    print(f"step during an asynchronous save: {_median_ms(during)} (median of {len(during)}): "
          f"{ratio:.2f}x one without (goal <= 1.1x)")  # fmt: skip


class _Orbax:
    """A plain orbax CheckpointManager keeping ``keep`` steps, saving the items meshkit saves."""

    def __init__(self, directory: str, keep: int) -> None:
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True)
        self.manager = ocp.CheckpointManager(directory, options=options)

    def save(self, number: int, params, opt_state, meta: dict) -> None:
        self.manager.wait_until_finished()
        self.manager.save(number, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta)))  # fmt: skip

    def writing(self) -> bool:
        return self.manager.is_saving_in_progress()

    def close(self) -> None:
        self.manager.close()


class _Meshkit:
    def __init__(self, directory: str, keep: int) -> None:
        self.ck = Checkpointer(directory, keep=keep)

    def save(self, number: int, params, opt_state, meta: dict) -> None:
        self.ck.save(number, params, opt_state, meta, wait=False)

    def writing(self) -> bool:
        return self.ck._manager.is_saving_in_progress()

    def close(self) -> None:
        self.ck.close()


def blocking_per_save(step: Callable[[], float], trainer: Trainer, tmp: str, args) -> None:
    """Part 2: what the loop blocks for per save, meshkit against plain orbax, in alternate rounds."""
    ways = {"meshkit": _Meshkit(os.path.join(tmp, "meshkit"), args.keep),
            "orbax": _Orbax(os.path.join(tmp, "orbax"), args.keep)}  # fmt: skip
    blocked: dict[str, list[float]] = {w: [] for w in ways}
    first: dict[str, list[float]] = {w: [] for w in ways}
    normal: list[float] = []
    try:
        for number in range(1, args.keep + args.saves + 1):
            for way, saver in ways.items():
                normal += [step() for _ in range(2)]
                start = time.perf_counter()
                saver.save(number, trainer.params, trainer.opt_state, {"step": number})
                took = time.perf_counter() - start
                after = step()
                while saver.writing():
                    step()
                if number > args.keep:  # this save deletes the oldest step
                    blocked[way].append(took)
                    first[way].append(after)
    finally:
        for saver in ways.values():
            saver.close()
    base = statistics.median(normal)
    print(
        "| way | loop blocked per save past keep (s) | first step after the save | x a step |\n|---|---|---|---|"
    )
    for way in ways:
        b, f = statistics.median(blocked[way]), statistics.median(first[way])
        print(f"| {way} | {b:.3f} | {f * 1e3:.1f} ms | {f / base:.2f}x |")
    m, o = (statistics.median(blocked[w]) for w in ways)
    lost = {w: statistics.median(blocked[w]) + statistics.median(first[w]) - base for w in ways}
    print(f"meshkit blocks {m / o:.2f}x as long per save as plain orbax (goal <= 1.2x); with the first step "
          f"after it, the loop loses {lost['meshkit']:.3f} s per save against {lost['orbax']:.3f} s")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--saves", type=int, default=3, help="timed save rounds per way and part")
    ap.add_argument("--between", type=int, default=4, help="steps without a save in flight before each save")
    ap.add_argument("--keep", type=int, default=2, help="steps kept (part 2)")
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
    print(f"gpt width {cfg.width}, {cfg.layers} layers: {num_params(trainer.params) / 1e6:.1f} M parameters, "
          f"{state_bytes / 2**20:,.0f} MiB of parameters and optimizer state; batch {args.batch * n}x{args.seq}, "
          f"{n} {jax.default_backend()} device(s); load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        during_saves(step, trainer, tmp, args)
        blocking_per_save(step, trainer, tmp, args)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
