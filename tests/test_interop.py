"""Hugging Face checkpoints without the reference: loading into a plan's layout holds a fraction of
the model on the host at any time; the planner's Llama presets are meshkit's Llama."""

import os

import jax
import pytest
from jax.sharding import PartitionSpec as P

from meshkit import interop
from meshkit.models import llama, num_params
from meshkit.planner.presets import PRESETS
from meshkit.planner.sizes import param_count

_LOAD_PEAK = """
import json, sys, tracemalloc
import jax
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import NamedSharding, PartitionSpec as P
from meshkit import interop
from meshkit.mesh import make_mesh
from meshkit.models import llama
from meshkit.plans.placement import place
from meshkit.plans.tp_rules import VOCAB_TP_RULES
from meshkit.spec import get_plan

cfg = llama.LlamaConfig(vocab_size=512, seq_len=64, layers=4, width=256, heads=4, kv_heads=2)
params = llama.init(jax.random.key(0), cfg)
interop.save(params, cfg, sys.argv[1], max_shard_bytes=2**21)
mesh = make_mesh("data=4,model=2", axis_types="auto")
layout = place(params, get_plan("fsdp+tp"), mesh, rules=VOCAB_TP_RULES, logical_axes=llama.logical_axes(params),
               units=llama.units(cfg))
shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), layout.param_specs(), is_leaf=lambda x: isinstance(x, P))
tracemalloc.start()
loaded, _ = interop.load(sys.argv[1], cfg, shardings=shardings)
jax.block_until_ready(loaded)
_, sharded = tracemalloc.get_traced_memory()
tracemalloc.reset_peak()
whole, _ = interop.load(sys.argv[1], cfg)
_, host = tracemalloc.get_traced_memory()
tracemalloc.stop()
same = jax.tree.map(lambda a, b, c: bool((a == b).all() and (b == c).all()), params, loaded, whole)
print(json.dumps({"sharded": sharded, "host": host, "total": sum(x.nbytes for x in jax.tree.leaves(params)),
                  "same": all(jax.tree.leaves(same)), "spec": str(loaded["blocks"][0]["mlp"]["w_up"].sharding.spec)}))
"""


def test_sharded_load_reads_each_devices_block_and_never_the_whole_model(tmp_path):
    """A 16 MiB Llama in 2 MiB shards, loaded into fsdp+tp's layout on data=4,model=2: the host's
    peak (tracemalloc: NumPy and the safetensors reads) stays under a third of the model (measured
    4.2 MB of 16.8, four times the largest leaf), where loading to host arrays holds all of it. Measured in
    a fresh process: tracemalloc counts every thread's allocations, and a worker's earlier test can leave
    threads working (an asynchronous save's: 11.9 MB counted once in a full run)."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _LOAD_PEAK, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    m = json.loads(done.stdout.splitlines()[-1])
    assert len(list((tmp_path / "ckpt").glob("model-*.safetensors"))) >= 8
    assert m["sharded"] < m["total"] / 3, m
    assert m["host"] > 0.9 * m["total"], m  # the measurement sees a whole model when one is read
    assert m["spec"] == str(P("data", "model")) and m["same"], m


@pytest.mark.parametrize("name", ["llama2-70b", "llama3-8b"])
def test_planner_presets_are_the_llama(name):
    """``LlamaConfig.from_shape`` of a preset has the preset's shape, and the planner counts its
    parameters exactly (from shapes: nothing allocated)."""
    shape = PRESETS[name]
    cfg = llama.LlamaConfig.from_shape(shape)
    assert cfg.shape(name) == shape
    params = jax.eval_shape(lambda: llama.init(jax.random.key(0), cfg))
    assert num_params(params) == param_count(shape)


def _llama_16mb():
    """A 16.8 MB float32 Llama whose largest tensors (embedding, head) are 0.5 MB each."""
    return llama.LlamaConfig(vocab_size=512, seq_len=64, layers=4, width=256, heads=4, kv_heads=2)


_EXPORT_RSS = """
import dataclasses, gc, json, sys
from pathlib import Path
import jax
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import NamedSharding, PartitionSpec as P
from meshkit import interop
from meshkit.mesh import make_mesh
from meshkit.models import llama

def status(key):
    return next(int(l.split()[1]) * 1024 for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))

cfg = llama.LlamaConfig(vocab_size=4096, seq_len=64, layers=3, width=1024, heads=8, kv_heads=8, ffn=2816)
mesh = make_mesh("data=8", axis_types="auto")
shapes = jax.eval_shape(lambda: llama.init(jax.random.key(0), cfg))
shardings = jax.tree.map(lambda s: NamedSharding(mesh, P("data")), shapes)
params = jax.jit(lambda: llama.init(jax.random.key(0), cfg), out_shardings=shardings)()
jax.block_until_ready(params)
gc.collect()
before = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) from here
interop.save(params, cfg, sys.argv[1], max_shard_bytes=2**26)
leaves = jax.tree.leaves(params)
print(json.dumps({"growth": status("VmHWM") - before, "after": status("VmRSS") - before,
                  "total": sum(x.nbytes for x in leaves), "largest": max(x.nbytes for x in leaves)}))
"""


def test_export_gathers_one_tensor_at_a_time(tmp_path):
    """A 188 MB float32 Llama split over 8 devices (every tensor gathered when it is written), exported
    in a fresh process: its resident set grows by a small multiple of the largest tensor (16.8 MB: a
    gathered copy and its transpose), not by the model, and does not keep the model after. Measured:
    peak growth 32.5 MB (1.9x the largest tensor, 0.17x the model), the same after (the allocator's
    free memory); before (one dict of host copies, and every gathered copy cached on its jax.Array by
    np.asarray) 358 MB, 1.9x the model, all of it still held after."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _EXPORT_RSS, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    m = json.loads(done.stdout.splitlines()[-1])
    print(f"export peak growth {m['growth'] / 1e6:.1f} MB: {m['growth'] / m['largest']:.2f}x the largest tensor, "
          f"{m['growth'] / m['total']:.3f}x the model ({m['total'] / 1e6:.0f} MB); after {m['after'] / 1e6:.1f} MB")  # fmt: skip
    assert m["growth"] < m["total"] / 3 and m["after"] < m["total"] / 3, m
    assert len(list((tmp_path / "ckpt").glob("model-*.safetensors"))) >= 3


def test_a_bf16_model_exports_bf16_and_reads_back_bf16_where_the_run_asks(tmp_path):
    """bfloat16 parameters are written as BF16 safetensors with torch_dtype bfloat16 in config.json
    (not widened to float32); read into a bfloat16 config they are the same bits, into the default
    float32 one the same values."""
    import dataclasses
    import json

    import numpy as np
    from safetensors import safe_open

    cfg = dataclasses.replace(_llama_16mb(), dtype="bfloat16", layers=2)
    params = llama.init(jax.random.key(0), cfg)
    assert {x.dtype.name for x in jax.tree.leaves(params)} == {"bfloat16"}
    interop.save(params, cfg, tmp_path / "ckpt", max_shard_bytes=2**20)
    files = sorted((tmp_path / "ckpt").glob("*.safetensors"))
    dtypes = set()
    for f in files:
        with safe_open(str(f), framework="numpy") as st:
            dtypes |= {st.get_slice(k).get_dtype() for k in st.keys()}  # noqa: SIM118
    assert len(files) > 1 and dtypes == {"BF16"}
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    again, _ = interop.load(tmp_path / "ckpt", cfg)
    assert all(a.dtype.name == "bfloat16" and np.array_equal(a.view(np.uint16), np.asarray(b).view(np.uint16))
               for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params), strict=True))  # fmt: skip
    wide, read = interop.load(tmp_path / "ckpt")
    assert read.dtype == "float32" and {x.dtype.name for x in jax.tree.leaves(wide)} == {"float32"}
    assert all(np.array_equal(a, np.asarray(b, np.float32))
               for a, b in zip(jax.tree.leaves(wide), jax.tree.leaves(params), strict=True))  # fmt: skip


def test_a_mixture_of_experts_no_format_names_is_refused_in_one_line(tmp_path):
    """A Llama's experts are written as Mixtral's or Qwen3-MoE's (test_hf_moe.py); one neither type holds
    (gates not renormalised, no per-head norms: no Mixtral) is refused in one line, nothing written, and so
    is a GPT's (GPT-2 has no experts) naming the leaves its format lacks; a dense checkpoint read into a
    mixture of experts is refused naming the router it lacks, before any tensor is read."""
    import dataclasses

    from meshkit.models import gpt

    cfg = dataclasses.replace(_llama_16mb(), layers=2, experts=4)
    with pytest.raises(interop.InteropError) as e:
        interop.save(llama.init(jax.random.key(0), cfg), cfg, tmp_path / "out" / "ckpt")
    said = str(e.value)
    assert "\n" not in said and "experts=4 (router_renormalize=False)" in said, said
    assert "is no Hugging Face model type meshkit writes" in said and not (tmp_path / "out").exists()
    dense = dataclasses.replace(cfg, experts=0)
    interop.save(llama.init(jax.random.key(0), dense), dense, tmp_path / "dense")
    mixtral = dataclasses.replace(cfg, router_renormalize=True, capacity_factor=0.0)
    with pytest.raises(
        interop.InteropError, match=r"has no tensor 'model.layers.0.block_sparse_moe.gate.weight'"
    ):
        interop.load(tmp_path / "dense", mixtral)
    moe_gpt = gpt.GPTConfig(vocab_size=64, seq_len=16, layers=1, width=32, heads=4, experts=4)
    with pytest.raises(interop.InteropError) as e:
        interop.save(gpt.init(jax.random.key(0), moe_gpt), moe_gpt, tmp_path / "gpt")
    said = str(e.value)
    assert "\n" not in said and "blocks/moe/" in said and "this format has no mixture of experts" in said, (
        said
    )
