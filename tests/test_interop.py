"""Hugging Face checkpoints without the reference: loading into a plan's layout holds a fraction of
the model on the host at any time; the planner's Llama presets are meshkit's Llama."""

import tracemalloc

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit import interop
from meshkit.mesh import make_mesh
from meshkit.models import llama, num_params
from meshkit.planner.presets import PRESETS
from meshkit.planner.sizes import param_count
from meshkit.plans.placement import VOCAB_TP_RULES, place
from meshkit.spec import get_plan


def test_sharded_load_reads_each_devices_block_and_never_the_whole_model(tmp_path):
    """A 16 MiB Llama in 2 MiB shards, loaded into fsdp+tp's layout on data=4,model=2: the host's
    peak (tracemalloc: NumPy and the safetensors reads) stays under a third of the model (measured
    4.2 MB of 16.8, four times the largest leaf), where loading to host arrays holds all of it."""
    cfg = llama.LlamaConfig(vocab_size=512, seq_len=64, layers=4, width=256, heads=4, kv_heads=2)
    params = llama.init(jax.random.key(0), cfg)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    interop.save(params, cfg, tmp_path / "ckpt", max_shard_bytes=2**21)
    assert len(list((tmp_path / "ckpt").glob("model-*.safetensors"))) >= 8
    mesh = make_mesh("data=4,model=2", axis_types="auto")
    layout = place(params, get_plan("fsdp+tp"), mesh, rules=VOCAB_TP_RULES, logical_axes=llama.logical_axes(params),
                   units=llama.units(cfg))  # fmt: skip
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), layout.param_specs(), is_leaf=lambda x: isinstance(x, P)
    )
    tracemalloc.start()
    try:
        loaded, _ = interop.load(tmp_path / "ckpt", cfg, shardings=shardings)
        jax.block_until_ready(loaded)
        _, sharded_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        whole, _ = interop.load(tmp_path / "ckpt", cfg)
        _, host_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sharded_peak < total / 3, (sharded_peak, total)
    assert host_peak > 0.9 * total  # the measurement sees a whole model when one is read
    assert loaded["blocks"][0]["mlp"]["w_up"].sharding.spec == P("data", "model")
    same = jax.tree.map(lambda a, b, c: bool((a == b).all() and (b == c).all()), params, loaded, whole)
    assert all(jax.tree.leaves(same))


@pytest.mark.parametrize("name", ["llama2-70b", "llama3-8b"])
def test_planner_presets_are_the_llama(name):
    """``LlamaConfig.from_shape`` of a preset has the preset's shape, and the planner counts its
    parameters exactly (from shapes: nothing allocated)."""
    shape = PRESETS[name]
    cfg = llama.LlamaConfig.from_shape(shape)
    assert cfg.shape(name) == shape
    params = jax.eval_shape(lambda: llama.init(jax.random.key(0), cfg))
    assert num_params(params) == param_count(shape)
