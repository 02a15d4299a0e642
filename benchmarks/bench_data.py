"""The data pipeline's cost (issue 25): prepare's throughput, the input wait of the main job, and the
measurements behind the reader's design.

1. ``meshkit data prepare`` on the embedded default (Python's reference docs, 0.5 MB) repeated
   ``--scale`` times: MB/s of text through each pass (check, BPE training, encoding + writing) and
   in all, tokens/s of the encoding.
2. The main job (``make run``: the default preset on those shards, 8 simulated CPU devices): per step,
   the time to draw this process's batch and place it (``next(batches)`` + ``global_batch``, the input
   wait) beside the step itself, with grain's thread prefetch (the job's setting) and without. The
   goal: input wait under 2% of the step.
3. Reading a window of ``seq_len + 1`` ids at random from a 100 MB shard: ``os.pread`` (what
   meshkit does) beside ``numpy.memmap`` slicing; and grain's ``index_shuffle`` per element, which
   the global shuffle calls once per window.
4. The same texts from each source ``prepare`` reads (text files, JSONL, Parquet, a datasets
   directory's Arrow files): MB/s of text through one reading pass alone, and through ``prepare`` with
   the tokenizer given (check + encode + write). ``--sources`` runs this section only.

    .venv/bin/python benchmarks/bench_data.py [--scale 4] [--vocab-size 2048] [--steps 60] [--sources]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np


def bench_prepare(root: Path, scale: int, vocab: int) -> Path:
    from meshkit.data.prepare import prepare
    from meshkit.data.text import default_documents

    texts = root / "text"
    texts.mkdir()
    for copy in range(scale):
        for i, t in enumerate(default_documents()):
            (texts / f"{copy:02d}-{i:03d}.txt").write_text(t, encoding="utf-8")
    phases: dict[str, list[float]] = {}

    def report(p, phase):
        phases.setdefault(phase, [time.perf_counter(), 0.0])[1] = time.perf_counter()

    start = time.perf_counter()
    out = root / "data"
    manifest = prepare([str(texts)], out, vocab_size=vocab, report=report)
    total = time.perf_counter() - start
    mb = manifest["text_bytes"] / 1e6
    print(
        f"1. prepare: {manifest['documents']} documents, {mb:.2f} MB -> {manifest['tokens']:,} tokens (vocab {vocab})"
    )
    order = ["check", "tokenizer", "encode"]
    ends = {name: phases[name][1] for name in order if name in phases}
    begin = start
    for name in order:
        if name in ends:
            secs = ends[name] - begin
            extra = f", {manifest['tokens'] / secs:,.0f} tokens/s" if name == "encode" else ""
            print(f"   {name:<9} {secs:6.2f} s  {mb / secs:7.2f} MB/s{extra}")
            begin = ends[name]
    print(f"   all       {total:6.2f} s  {mb / total:7.2f} MB/s (the three passes)")
    return out


def bench_input_wait(data: Path, steps: int) -> None:
    import jax

    from meshkit.data import global_batch
    from meshkit.train import config as C
    from meshkit.train.job import PREFETCH_THREADS, prepare

    print(
        f"2. input wait of the main job (default preset on the shards, {jax.device_count()} devices, {steps} steps)"
    )
    for threads in (PREFETCH_THREADS, 0):
        with tempfile.TemporaryDirectory() as tmp:
            job = prepare(C.default().replace(data=str(data), run_dir=str(Path(tmp) / "run")))
            job.batches.threads = threads
            t = job.trainer
            waits, steps_s = [], []
            for i in range(steps + 3):
                a = time.perf_counter()
                batch = global_batch(t.shardings.batch, next(job.batches))
                b = time.perf_counter()
                float(t.step(batch)["loss"])
                c = time.perf_counter()
                if i >= 3:  # past compilation and the prefetch's first fill
                    waits.append(b - a)
                    steps_s.append(c - b)
            job.batches.close()
        frac = sum(waits) / (sum(waits) + sum(steps_s))
        print(f"   prefetch threads {threads}: input {statistics.median(waits) * 1e3:6.3f} ms median, "
              f"step {statistics.median(steps_s) * 1e3:7.2f} ms median; input wait {100 * frac:5.2f}% of step time")  # fmt: skip


def bench_reads(root: Path) -> None:
    from grain.experimental import index_shuffle

    n, window, reads = 50_000_000, 129, 20_000
    path = root / "shard.bin"
    np.random.default_rng(0).integers(0, 8192, n, dtype=np.uint16).tofile(path)
    starts = np.random.default_rng(1).integers(0, n - window, reads)
    mm = np.memmap(path, dtype=np.uint16, mode="r")
    a = time.perf_counter()
    for s in starts:
        np.array(mm[s : s + window], dtype=np.int32)
    b = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    for s in starts:
        np.frombuffer(os.pread(fd, 2 * window, 2 * int(s)), np.uint16).astype(np.int32)
    c = time.perf_counter()
    os.close(fd)
    for i in range(reads):
        index_shuffle(i, max_index=10**6, seed=3, rounds=4)
    d = time.perf_counter()
    print(f"3. one window of {window} ids from a 100 MB shard (page cache warm): pread {1e6 * (c - b) / reads:.1f} us, "
          f"memmap {1e6 * (b - a) / reads:.1f} us; grain index_shuffle {1e6 * (d - c) / reads:.1f} us per window")  # fmt: skip


def _sources(root: Path, texts: list[str]) -> dict[str, Path]:
    """The texts as text files, JSONL, Parquet and a datasets directory (save_to_disk's layout)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "text").mkdir(parents=True)
    for i, t in enumerate(texts):
        (root / "text" / f"{i:05d}.txt").write_text(t, encoding="utf-8")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    table = pa.table({"text": texts})
    pq.write_table(table, root / "docs.parquet")
    ds = root / "datasets"
    ds.mkdir()
    with pa.OSFile(str(ds / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        for batch in table.to_batches(max_chunksize=1000):  # datasets' writer_batch_size
            w.write_batch(batch)
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (ds / "dataset_info.json").write_text("{}")
    return {"text files": root / "text", "JSONL": root / "docs.jsonl", "Parquet": root / "docs.parquet",
            "datasets dir": ds}  # fmt: skip


def bench_sources(root: Path, scale: int, vocab: int) -> None:
    from meshkit.data import readers
    from meshkit.data.prepare import prepare
    from meshkit.data.text import default_documents

    texts = [t for _ in range(scale) for t in default_documents()]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    print(f"4. prepare from each source: {len(texts)} documents, {mb:.2f} MB of text")
    tok = root / "tok"
    prepare([], tok, vocab_size=vocab)
    for name, path in _sources(root / "sources", texts).items():
        a = time.perf_counter()
        for _ in readers.Reader(readers.list_inputs([str(path)])).pieces():
            pass
        b = time.perf_counter()
        prepare([str(path)], root / f"out-{name.split()[0]}", tokenizer=str(tok / "tokenizer.json"))
        c = time.perf_counter()
        print(
            f"   {name:<12} read {mb / (b - a):8.1f} MB/s   prepare {mb / (c - b):6.2f} MB/s ({c - b:.2f} s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=4, help="copies of the default text to prepare")
    parser.add_argument("--vocab-size", type=int, default=2048, help="the BPE's ids (make run's)")
    parser.add_argument("--steps", type=int, default=60, help="steps timed per setting")
    parser.add_argument("--sources", action="store_true", help="only section 4 (prepare from each source)")
    args = parser.parse_args()
    if args.sources:
        with tempfile.TemporaryDirectory() as tmp:
            bench_sources(Path(tmp), args.scale, args.vocab_size)
        return
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = bench_prepare(root, args.scale, args.vocab_size)
        bench_input_wait(data, args.steps)
        bench_reads(root)
        bench_sources(root, args.scale, args.vocab_size)


if __name__ == "__main__":
    main()
