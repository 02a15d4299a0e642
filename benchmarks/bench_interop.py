"""Host memory of a Hugging Face import and export of a 1.24 B-parameter checkpoint written by
transformers: the peak resident set of each, beside the checkpoint's largest shard and its whole size.

The checkpoint is made once by the reference environment (``.venv-ref``: transformers 4.57.6, torch on
CPU) under ``--ckpt`` (default /tmp, never the repository): a Llama 3.2 1B shaped model (hidden 2048,
16 layers, 32 heads, 8 key/value heads, a 128,256-id vocabulary, tied embeddings, llama3 rotary
scaling), random, in bfloat16, ``save_pretrained(max_shard_size="500MB")``: 2.47 GB in 6 shards, the
embedding (525 MB) alone in the largest.

A fresh process then imports it as ``meshkit train --init-from`` does (``interop.load`` with shardings:
every tensor split over ``--devices`` CPU devices on its first dim where it divides, each device's
block read from the files; in ``--dtype``, bfloat16 by default: the run asks for it) and exports it
again (``interop.save``: tensor by tensor into 2 GiB shards). Each phase's peak RSS is read from
/proc/self/status (VmHWM, reset between phases through /proc/self/clear_refs). On the CPU backend a
device's memory is the host's, so the imported parameters themselves are resident (the whole model, in
``--dtype``): what streaming bounds is the rest, the import's peak above the parameters it holds at the
end and the export's above the parameters it starts with, printed as ratios to the largest shard.
Both are printed for VmRSS (with the checkpoint's pages safetensors maps while it reads: the kernel's
page cache, not the process's own memory) and RssAnon (without them; its peak sampled every 10 ms).
``--host`` imports into host arrays instead (no shardings: ``init_from`` before it took the run's
layout). Running it against an older checkout (``PYTHONPATH=OLD/src``) gives the before figures.

    .venv/bin/python benchmarks/bench_interop.py [--ckpt DIR] [--dtype bfloat16|float32] [--host]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAKE = """
import sys, torch
from transformers import AutoModelForCausalLM, LlamaConfig
torch.manual_seed(0)
config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                     max_position_embeddings=131072, rms_norm_eps=1e-5, head_dim=64,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1], max_shard_size="500MB")
print(sum(p.numel() for p in model.parameters()))
"""
"""The checkpoint, as transformers writes it (Llama-3.2-1B's config.json, random weights)."""


def make_checkpoint(ckpt: Path, python: str) -> None:
    if (ckpt / "model.safetensors.index.json").is_file():
        return
    start = time.perf_counter()
    tmp = ckpt.with_name(ckpt.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    done = subprocess.run([python, "-c", MAKE, str(tmp)], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"making the checkpoint failed: {done.stderr[-2000:]}")
    tmp.rename(ckpt)
    print(f"made {ckpt}: {int(done.stdout.split()[-1]):,} parameters in {time.perf_counter() - start:.0f} s")


def tensors(ckpt: Path) -> dict[str, tuple[str, int]]:
    """Each tensor's file and bytes, from the safetensors headers."""
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                out[name] = (f.name, t["data_offsets"][1] - t["data_offsets"][0])
    return out


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


class _AnonPeak:
    """The largest RssAnon seen (sampled every 10 ms by a thread): the process's own memory without the
    checkpoint's pages that safetensors maps, which count in VmRSS while mapped but are the kernel's
    page cache (dropped under pressure, shared with every reader of the file)."""

    def __init__(self) -> None:
        import threading

        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _status("RssAnon"))

    def take(self) -> int:
        """The peak since the last take (and now)."""
        peak, self.peak = max(self.peak, _status("RssAnon")), _status("RssAnon")
        return peak


def child(ckpt: Path, out: Path, dtype: str, devices: int, host: bool) -> None:
    """Import then export in this (fresh) process; prints the phases' bytes as one JSON line."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", devices)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from meshkit import interop
    from meshkit.mesh import make_mesh
    from meshkit.models import llama

    jax.devices()
    base, base_anon = _status("VmRSS"), _status("RssAnon")
    anon = _AnonPeak()
    _reset_peak()
    start = time.perf_counter()
    cfg = dataclasses.replace(interop.read_config(ckpt), dtype=dtype)
    shardings = None
    if not host:
        mesh = make_mesh(f"data={devices}", axis_types="auto")
        split = lambda s: NamedSharding(mesh, P("data") if s.shape[0] % devices == 0 else P())  # noqa: E731
        shardings = jax.tree.map(split, jax.eval_shape(lambda: llama.init(jax.random.key(0), cfg)))
    params, _ = interop.load(ckpt, cfg, shardings=shardings)
    jax.block_until_ready(params)
    load_s = time.perf_counter() - start
    imported, held, imported_anon, held_anon = (
        _status("VmHWM"),
        _status("VmRSS"),
        anon.take(),
        _status("RssAnon"),
    )
    _reset_peak()
    start = time.perf_counter()
    interop.save(params, cfg, out)
    save_s = time.perf_counter() - start
    exported, exported_anon = _status("VmHWM"), anon.take()
    import resource

    lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"base": base, "import_peak": imported, "held": held, "export_peak": exported,
                      "base_anon": base_anon, "import_anon": imported_anon, "held_anon": held_anon,
                      "export_anon": exported_anon, "lifetime": lifetime, "load_s": load_s, "save_s": save_s,
                      "meshkit": str(Path(interop.__file__).parents[1])}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ckpt", type=Path, default=Path(tempfile.gettempdir()) / "meshkit-bench-interop" / "llama-1b"
    )
    parser.add_argument("--reference", default=str(ROOT / ".venv-ref" / "bin" / "python"))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--host", action="store_true", help="import into host arrays (no shardings)")
    parser.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.dtype, args.devices, args.host)
        return
    args.ckpt.parent.mkdir(parents=True, exist_ok=True)
    make_checkpoint(args.ckpt, args.reference)
    sizes = tensors(args.ckpt)
    files = {f: sum(b for g, b in sizes.values() if g == f) for f, _ in sizes.values()}
    whole, shard, largest = sum(files.values()), max(files.values()), max(b for _, b in sizes.values())
    out = Path(tempfile.mkdtemp(dir=args.ckpt.parent)) / "export"
    try:
        cmd = [sys.executable, __file__, "--child", str(args.ckpt), str(out), "--dtype", args.dtype,
               "--devices", str(args.devices), *(["--host"] if args.host else [])]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(done.stderr[-3000:])
        m = json.loads(done.stdout.splitlines()[-1])
        written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    where = "host arrays" if args.host else f"{args.devices} CPU devices (data={args.devices})"
    print(f"checkpoint {args.ckpt}: {gb(whole)} in {len(files)} shards, largest shard {gb(shard)}, "
          f"largest tensor {gb(largest)}; imported into {where} in {args.dtype} by {m['meshkit']}")  # fmt: skip
    params = m["held"] - m["base"]
    print(f"process before import: {gb(m['base'])}; parameters held after import: {gb(params)} ({params / whole:.2f}x the checkpoint)")  # fmt: skip
    for phase, secs in (("import", m["load_s"]), ("export", m["save_s"])):
        for what, peak, start in (("RSS", m[f"{phase}_peak"], m["held"]),
                                  ("RssAnon", m[f"{phase}_anon"], m["held_anon"])):  # fmt: skip
            above = peak - start
            print(f"{phase} ({secs:.0f} s): peak {what} {gb(peak)} = {peak / whole:.2f}x the checkpoint; above the "
                  f"held parameters {gb(above)} = {above / shard:.2f}x the largest shard, {above / whole:.2f}x the checkpoint")  # fmt: skip
    print(f"export wrote {gb(written)}; the process's lifetime peak (getrusage) {gb(m['lifetime'])}")


if __name__ == "__main__":
    main()
