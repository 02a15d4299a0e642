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
