"""The reference chapter's verified figures, reproduced with meshkit's ledgers on 8 devices."""

import jax
import numpy as np
import pytest

from meshkit import examples
from meshkit.analysis import communication, memory, ring_traffic


def compiled(name):
    fn, args = getattr(examples, name)()
    return fn, args, fn.lower(*args).compile()


def tree_bytes(tree):
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def test_dp_mlp_adam_one_all_reduce_of_params_plus_loss():
    _, (params, *_), c = compiled("dp_mlp_adam")
    led = communication(c)
    assert led.kinds() == ["all-reduce"] and led.count() == 1
    (rec,) = led.records
    assert tree_bytes(params) == 23072
    assert rec.size_bytes == tree_bytes(params) + 4  # every gradient and the f32 loss, combined
    assert rec.group_size == 8 and rec.axes == ("data",)
    assert led.traffic_bytes == pytest.approx(2 * 7 / 8 * (23072 + 4))


def test_fsdp_gradient_all_gather_and_reduce_scatter_and_argument_bytes():
    fn, args, c = compiled("fsdp_mlp_grad")
    led = communication(c)
    assert led.kinds() == ["all-gather", "reduce-scatter"]
    params = args[0]
    n_leaves = len(jax.tree.leaves(params))
    assert led.count("all-gather") == led.count("reduce-scatter") == n_leaves
    # gathers bring back every full parameter; scatters hand back every gradient shard
    assert led.by_op()["all-gather"].size_bytes == 23072
    assert led.by_op()["reduce-scatter"].size_bytes == 23072
    data_local = (256 * 16 + 256 * 8) * 4 // 8
    assert data_local == 3072
    _, dp_args, dp_c = compiled("dp_mlp_grad")
    assert memory(dp_c).argument_bytes == 23072 + 3072
    assert memory(c).argument_bytes == 23072 // 8 + 3072 == 5956
    # the sharded gradient equals the single-device gradient
    g_fsdp = fn(*args)
    host = jax.tree.map(np.asarray, dp_args)
    g_ref = jax.grad(lambda p: examples.mlp.loss(p, (host[1], host[2])))(host[0])
    for a, b in zip(jax.tree.leaves(g_fsdp), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_megatron_block_forward_has_one_all_reduce_over_model():
    fn, args, c = compiled("megatron_mlp")
    led = communication(c)
    assert led.kinds() == ["all-reduce"] and led.count() == 1
    assert led.records[0].axes == ("model",) and led.records[0].group_size == 2
    x, w1, w2 = (np.asarray(a, np.float64) for a in args)
    np.testing.assert_allclose(np.asarray(fn(*args)), np.maximum(x @ w1, 0) @ w2, atol=1e-5)


def test_all_to_all_transpose_uses_no_all_gather():
    fn, (a,), c = compiled("alltoall_transpose")
    led = communication(c)
    assert led.kinds() == ["all-to-all"] and led.count() == 1
    assert np.array_equal(np.asarray(fn(a)), np.asarray(a).T)


def test_pmean_and_psum_over_n_compile_to_the_same_collectives():
    a = communication(compiled("pmean_step")[2])
    b = communication(compiled("psum_div_step")[2])
    sig = lambda led: [(r.op, r.size_bytes, r.group_size, r.axes) for r in led.records]  # noqa: E731
    assert sig(a) == sig(b) == [("all-reduce", 4, 8, ("i",))]


def test_halo_exchange_uses_collective_permute_and_matches_numpy():
    fn, (x,), c = compiled("halo_exchange")
    led = communication(c)
    assert led.kinds() == ["collective-permute"]
    assert all(r.traffic_bytes == r.size_bytes == 4 for r in led.records)
    ref = np.convolve(np.pad(np.asarray(x, np.float64), 1), np.ones(3), mode="valid")
    np.testing.assert_allclose(np.asarray(fn(x)), ref, rtol=1e-6)


def test_lowered_is_compiled_and_mesh_taken_from_input_shardings():
    fn, args = examples.dp_mlp_adam()
    led = communication(fn.lower(*args))
    assert led.mesh == (("data", 8),) and led.num_devices == 8


def test_ring_identity_all_reduce_is_reduce_scatter_plus_all_gather():
    for n in (2, 4, 8, 64):
        s = 1024.0 * n
        assert ring_traffic("all-reduce", s, n) == pytest.approx(
            ring_traffic("reduce-scatter", s, n) + ring_traffic("all-gather", s, n)
        )


@pytest.mark.parametrize(
    "shape",
    [(("data", 1), ("model", 8)), (("model", 8), ("data", 1)), (("data", 2), ("pipe", 1), ("model", 4))],
)
def test_meshes_with_a_size_1_axis(shape):
    """A mesh axis of size 1 (``--mesh data=1,model=8``) names no devices of its own: groups over
    the other axes still match, and the ledger reads the program (issue 10: it raised before)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    names = tuple(n for n, _ in shape)
    sizes = tuple(s for _, s in shape)
    mesh = jax.make_mesh(sizes, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))

    def step(x):
        return jax.lax.psum(x, "model") + jax.lax.psum(2 * x, names), jax.lax.all_gather(
            x, "model", tiled=True
        )

    spec = P(names)
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))
    x = jax.device_put(np.arange(8 * 4, dtype=np.float32), NamedSharding(mesh, spec))
    led = communication(fn.lower(x).compile())
    assert led.mesh == shape
    model = dict(shape)["model"]
    wide = tuple(n for n, s in shape if s > 1)
    for r in led.records:
        assert r.axes in (("model",), wide, names) and r.group_size == (model if r.axes == ("model",) else 8)
    assert {r.op for r in led.records} == {"all-reduce", "all-gather"}
    assert any(r.axes == ("model",) and r.op == "all-gather" for r in led.records)
    summed, gathered = fn(x)
    grid = np.asarray(x, np.float64).reshape(*sizes, 4)  # each device's block, in mesh order
    want = grid.sum(axis=names.index("model"), keepdims=True) + 2 * grid.sum(
        axis=tuple(range(len(sizes))), keepdims=True
    )
    np.testing.assert_allclose(
        np.asarray(summed).reshape(*sizes, 4), np.broadcast_to(want, grid.shape), rtol=1e-6
    )
    assert np.asarray(gathered).shape == (8 * 4 * model,)


@pytest.mark.parametrize("shape", [(("data", 1), ("model", 8)), (("data", 2), ("pipe", 1), ("model", 4))])
def test_partitioner_groups_match_mesh_axes_with_a_size_1_axis(shape):
    """Groups the partitioner prints as iota lists are matched to the mesh of the input shardings."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    names = tuple(n for n, _ in shape)
    sizes = tuple(s for _, s in shape)
    mesh = jax.make_mesh(sizes, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
    a = jax.device_put(np.ones((16, 64), np.float32), NamedSharding(mesh, P(None, "model")))
    b = jax.device_put(np.ones((64, 8), np.float32), NamedSharding(mesh, P("model", None)))
    fn = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P()))
    led = communication(fn.lower(a, b).compile())
    assert led.mesh == shape and led.kinds() == ["all-reduce"]
    (rec,) = led.records
    assert rec.axes == ("model",) and rec.group_size == dict(shape)["model"]
    np.testing.assert_allclose(np.asarray(fn(a, b)), np.full((16, 8), 64.0))
