"""meshkit migrate, MK015 (issue 51, "the house"): a pmap whose form allows it is written inline.

``--fix`` used to turn every pmap into ``_pmap_via_shard_map``, a 50-line helper added to the module.
Now a pmap is written as the reference chapter's modern form (sections 3.3-3.7), a mesh and
``jax.jit(jax.shard_map(f, mesh=mesh, in_specs=..., out_specs=...))``, where the module shows it is the
same program: the body is elementwise in its mapped arguments (shard_map's block of one row gives
what pmap's slice gave), and every call states how many rows it maps (the mesh's devices). The rest
keeps the helper, and the finding says why. The programs below are written after the chapter's simple
pmap examples (3.3 a pure map, 3.4 replicated parameters, 3.5 collectives, 3.6 an axis name, 3.7 a
nested pmap); run under JAX 0.12's pmap and, fixed, on the suite's 8 CPU devices, they give the same
outputs bit for bit; so do the pmaps of a real legacy file, JAX's Pmap Cookbook
(tests/corpus/legacy/jax__cloud_tpu_colabs__Pmap_Cookbook.py, run as tests/fixtures/migrate/inline/pmap_cookbook.py
without its 5000 x 6000 matrices and plots).
"""

import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from _tiers import tiered
from meshkit.migrate import fix_source, lint_source
from meshkit.migrate.rules_pmap import HELPER

HEAD = "import jax\nimport jax.numpy as jnp\nfrom jax import lax\n\n"

# Each defines ``out*``; the pmaps are written inline except those the comment names.
SEED = {
    "3.3 a pure map over all devices": """
        n = jax.local_device_count()
        sharded_data = jnp.arange(n * 8 * 16, dtype=jnp.float32).reshape((n, 8, 16))

        def simple_computation(x):
            return x * 2.0 + 1.0

        parallel_computation = jax.pmap(simple_computation)
        out = parallel_computation(sharded_data)
        out_pair = jax.pmap(lambda x: (x - 1.0, {"twice": 2.0 * x}))(sharded_data)
    """,
    "3.3 on 4 of the 8 devices": """
        num_devices_to_use = 4
        sharded_data = jnp.arange(4 * 8 * 16, dtype=jnp.float32).reshape((num_devices_to_use, 8, 16))
        out = jax.pmap(lambda x: x * 2.0 + 1.0)(sharded_data)
        out_devices = sorted(d.id for d in out.sharding.device_set)
    """,
    "3.4 parameters broadcast with in_axes None": """
        def predict(params, inputs):
            return jnp.dot(inputs, params["w"]) + params["b"]

        num_devices = jax.local_device_count()
        k_w, k_b, k_x = jax.random.split(jax.random.key(0), 3)
        params = {"w": jax.random.normal(k_w, (10, 5)), "b": jax.random.normal(k_b, (5,))}
        dummy_data = jax.random.normal(k_x, (32 * num_devices, 10))
        sharded_data = dummy_data.reshape((num_devices, 32, 10))
        parallel_predict = jax.pmap(predict, in_axes=(None, 0))
        out = parallel_predict(params, sharded_data)
    """,
    "3.5 psum pmean pmax and a ppermute ring": """
        def sum_across_devices(local_value):
            return lax.psum(local_value, axis_name="batch_axis")

        def get_max_value(local_value):
            return lax.pmax(local_value, axis_name="data_split")

        values = jnp.arange(4.0)
        out_sum = jax.pmap(sum_across_devices, axis_name="batch_axis")(values)
        out_mean = jax.pmap(lambda v: lax.pmean(v, "batch_axis"), axis_name="batch_axis")(values)
        out_max = jax.pmap(get_max_value, axis_name="data_split")(jnp.array([2.0, 5.0, 1.0, 4.0]))
        n = jax.device_count()
        ring = jax.pmap(lambda x: lax.ppermute(x, "i", [(j, (j + 1) % n) for j in range(n)]), axis_name="i")
        out_ring = ring(jnp.arange(n * 3.0).reshape(n, 3))
    """,
    # The training step keeps the helper: jax.grad of a mean over the batch sees the block's extra axis.
    "3.6 an axis name used by psum": """
        def scaled_sum(x):
            scaled_x = x * 2.0
            return lax.psum(scaled_x, axis_name="devices")

        n_devices = jax.local_device_count()
        data = jnp.arange(n_devices, dtype=jnp.float32)
        parallel_computation = jax.pmap(scaled_sum, axis_name="devices")
        out = parallel_computation(data)
        out_two = jax.pmap(scaled_sum, axis_name="devices")(jnp.arange(2.0))

        def loss_fn(params, batch):
            return jnp.mean((params["w"] * batch["x"] + params["b"] - batch["y"]) ** 2)

        def parallel_update_step(params, sharded_batch):
            grads = lax.pmean(jax.grad(loss_fn)(params, sharded_batch), axis_name="data_parallel_axis")
            return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

        xs = jnp.arange(n_devices * 4, dtype=jnp.float32).reshape((n_devices, 4, 1))
        p_update_step = jax.pmap(parallel_update_step, axis_name="data_parallel_axis", in_axes=(None, 0))
        out_params = p_update_step({"w": jnp.ones(()), "b": jnp.zeros(())}, {"x": xs, "y": xs * 2.0 + 0.5})
    """,
}
HELPER_KEPT = {"3.6 an axis name used by psum": 1}


def module(body: str) -> str:
    return HEAD + textwrap.dedent(body).lstrip()


def outputs(text: str) -> dict:
    ns: dict = {}
    exec(compile(text, "<snippet>", "exec"), ns)
    return {k: v for k, v in ns.items() if k.startswith("out")}


def pmaps(text: str) -> list:
    return [f for f in lint_source(text) if f.rule == "MK015"]


def inline(finding) -> bool:
    return finding.fixable and finding.fix.startswith("written inline")


@pytest.mark.parametrize(
    "name",
    tiered(
        [(n,) for n in SEED],
        SEED,
        core={
            "3.3 a pure map over all devices",
            "3.4 parameters broadcast with in_axes None",
            "3.6 an axis name used by psum",
        },
    ),
)
def test_the_chapters_simple_pmaps_are_written_inline_and_give_pmaps_outputs_bitwise(name):
    before = module(SEED[name])
    found = pmaps(before)
    kept = HELPER_KEPT.get(name, 0)
    assert sum(map(inline, found)) == len(found) - kept and all(f.fixable for f in found)
    after = fix_source(before)
    assert "jax.pmap" not in after and (f"def {HELPER}(" in after) == bool(kept)
    assert "jax.jit(jax.shard_map(" in after and fix_source(after) == after
    old, new = outputs(before), outputs(after)
    assert old.keys() == new.keys() and str(jax.tree.structure(old)) == str(jax.tree.structure(new))
    for x, y in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True):
        assert np.shape(x) == np.shape(y)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


COOKBOOK = Path(__file__).parent / "fixtures" / "migrate" / "inline" / "pmap_cookbook.py"


def test_a_real_legacy_files_pmaps_give_pmaps_outputs_bitwise_inline():
    """The Pmap Cookbook's pure maps and normalize (a lambda, then a decorated def) are written inline
    over 7, 3, 8 and 4 devices; its matmul reads x.T and keeps the helper."""
    before = COOKBOOK.read_text()
    assert [inline(f) for f in pmaps(before)] == [True, True, True, False, True, True]
    after = fix_source(before)
    assert f"def {HELPER}(" in after and after.count("jax.jit(jax.shard_map(") == 4 and "@jax.jit\n" in after
    old, new = outputs(before), outputs(after)
    assert old.keys() == new.keys() and len(old) == 6
    for name, x in old.items():
        assert np.shape(x) == np.shape(new[name]), name
        np.testing.assert_array_equal(np.asarray(new[name]), np.asarray(x), err_msg=name)


def test_the_inline_form_is_the_chapters_mesh_and_shard_map():
    fixed = fix_source(module(SEED["3.4 parameters broadcast with in_axes None"]))
    lines = fixed.splitlines()
    assert "from jax.sharding import PartitionSpec as P" in lines
    i = lines.index('mesh = jax.sharding.Mesh(jax.devices(), ("i",))')
    assert lines[i + 1] == (
        'parallel_predict = jax.jit(jax.shard_map(predict, mesh=mesh, in_specs=(P(), P("i")), out_specs=P("i")))'
    )
    four = fix_source(module(SEED["3.3 on 4 of the 8 devices"]))
    assert 'mesh = jax.sharding.Mesh(jax.devices()[:4], ("i",))' in four


def test_a_nested_pmap_is_left_as_it_is():
    """3.7: nested pmaps raise in JAX 0.12; neither the inline form nor the helper can keep that."""
    before = module("""
        from functools import partial

        @partial(jax.pmap, axis_name="model")
        def inner_op(x, p):
            return lax.psum(x * p, axis_name="model") * 2

        @partial(jax.pmap, axis_name="data")
        def outer_op(x, p):
            return lax.psum(inner_op(x, p), axis_name="data")

        out = outer_op(jnp.arange(4.0).reshape(2, 2), jnp.ones((2, 2)))
    """)
    assert all(not f.fixable and "nested pmap" in f.message for f in pmaps(before))
    assert fix_source(before) == before


def test_the_readme_example():
    """The README's script becomes 7 lines, not a 50-line helper; without a call it keeps the helper."""
    called = "import jax\ndouble = jax.pmap(lambda x: 2 * x)\nprint(double(jax.numpy.arange(jax.device_count())))\nkey = jax.random.PRNGKey(0)\n"
    fixed = fix_source(called)
    assert fixed.splitlines() == [
        "import jax",
        "from jax.sharding import PartitionSpec as P",
        "",
        'mesh = jax.sharding.Mesh(jax.devices(), ("i",))',
        'double = jax.jit(jax.shard_map(lambda x: 2 * x, mesh=mesh, in_specs=P("i"), out_specs=P("i")))',
        "print(double(jax.numpy.arange(jax.device_count())))",
        "key = jax.random.key(0)",
    ]
    uncalled = "import jax\ndouble = jax.pmap(lambda x: 2 * x)\nkey = jax.random.PRNGKey(0)\n"
    (finding,) = pmaps(uncalled)
    assert finding.fixable and "not inline: nothing in this module calls double" in finding.fix
    assert len(fix_source(uncalled).splitlines()) > 45


# Each keeps the helper (rewritten, not inline), for the reason given; ``X`` (8 rows) is made first
# unless the case says otherwise.
KEEPS_HELPER = {
    "indexing": ("f = jax.pmap(lambda x: x[0] * 2)\nout = f(X)\n", "`x[0]` indexes"),
    "shape": ("f = jax.pmap(lambda x: x / x.shape[0])\nout = f(X)\n", "`x.shape` reads an attribute"),
    "reduction": ("f = jax.pmap(lambda x: jnp.sum(x))\nout = f(X)\n", "the body calls `jnp.sum`"),
    "reduction_by_name": ("out = jax.pmap(jnp.mean)(X)\n", "pmap maps `jnp.mean`"),
    "replicated_of_unknown_rank": (
        "def g(w):\n    return jax.pmap(lambda w, x: w * x, in_axes=(None, 0))(w, X)\n\nout = g(jnp.ones(3))\n",
        "broadcasts a replicated value",
    ),
    "replicated_output": (
        "out = jax.pmap(lambda w, x: w + 0 * jnp.sum(x), in_axes=(None, 0))(1.0, X)\n",
        "the body calls `jnp.sum`",
    ),
    "keywords_at_a_call": ("f = jax.pmap(lambda x: x * 2)\nout = f(x=X)\n", "passes keyword or * arguments"),
    "length_not_stated": (
        "_f = jax.pmap(lambda x: x * 2)\n\ndef g(batch):\n    return _f(batch)\n\nout = g(X)\n",
        "is not known here",
    ),
    "two_lengths": (
        "f = jax.pmap(lambda x: x * 2)\nout = f(X), f(jnp.arange(4.0))\n",
        "different lengths",
    ),
    "passed_on": ("f = jax.jit(jax.pmap(lambda x: x * 2))\nout = f(X)\n", "passed on"),
    "donation": (
        "f = jax.pmap(lambda x: x * 2, donate_argnums=0)\nout = f(X)\n",
        "donate_argnums",
    ),
    "called_only_from_functions": (
        "double = jax.pmap(lambda x: 2 * x)\n\ndef main():\n    return double(jnp.arange(8.0))\n\nout = main()\n",
        "other modules may call",
    ),
    "mesh_before_the_first_array": (  # at import: the module makes no array before main() runs
        "NO_X\n_double = jax.pmap(lambda x: 2 * x)\n\ndef main():\n    return _double(jnp.arange(8.0))\n\n"
        "out = main()\n",
        "the mesh would be built before the program first creates an array",
    ),
    "loop": (
        "def f(x):\n    for _ in range(2):\n        x = x * 2\n    return x\n\nout = jax.pmap(f)(X)\n",
        "f has a for statement",
    ),
}


@pytest.mark.parametrize("name", sorted(KEEPS_HELPER))
def test_what_is_not_provably_elementwise_or_sized_keeps_the_helper_and_says_why(name):
    body, reason = KEEPS_HELPER[name]
    x = "X = jnp.arange(8.0).reshape(8, 1)\n"
    before = HEAD + (body.removeprefix("NO_X\n") if body.startswith("NO_X\n") else x + body)
    (finding,) = pmaps(before)
    assert finding.fixable and not inline(finding), finding.fix
    assert "not inline: " in finding.fix and reason in finding.fix, finding.fix
    after = fix_source(before)
    assert f"def {HELPER}(" in after and "jax.jit(jax.shard_map(" not in after


def test_a_name_read_before_it_is_rebound_to_a_pmap_is_not_nested():
    """A notebook reusing names (the Pmap Cookbook's ``normalize``, a lambda then a pmapped def): the
    pmap of the lambda maps the lambda, not the later pmap, so neither is a nested pmap (both were)."""
    before = HEAD + textwrap.dedent("""
        from functools import partial

        normalize = lambda x: x / lax.psum(x, axis_name="i")
        out_lambda = jax.pmap(normalize, axis_name="i")(jnp.arange(4.0))

        @partial(jax.pmap, axis_name="i")
        def normalize(x):
            return x / lax.psum(x, "i")

        out_def = normalize(jnp.arange(8.0))
    """)
    found = lint_source(before)
    assert not [f for f in found if f.rule == "MK014"]
    assert [inline(f) for f in found if f.rule == "MK015"] == [True, True]
    after = fix_source(before)
    assert '@jax.jit\n@jax.shard_map(mesh=mesh_2, in_specs=P("i"), out_specs=P("i"))\ndef normalize' in after


def test_meshes_take_names_the_module_does_not_use():
    before = (
        HEAD
        + "mesh = 'a name of the module'\nout = jax.pmap(lambda x: -x)(jnp.arange(8.0)), jax.pmap(jnp.abs)(jnp.arange(2.0))\n"
    )
    after = fix_source(before)
    assert "mesh = 'a name of the module'" in after
    assert 'mesh_2 = jax.sharding.Mesh(jax.devices()[:8], ("i",))' in after
    assert 'mesh_3 = jax.sharding.Mesh(jax.devices()[:2], ("i",))' in after
    assert fix_source(after) == after


BROADCASTS = """
    n = jax.device_count()
    X = jnp.arange(n * 3.0).reshape(n, 3) - 5.0
    Y = jnp.arange(n * 6.0).reshape(n, 2, 3)
    W = jnp.arange(12.0).reshape(3, 4) / 7
    V = jnp.arange(3.0)
    out_ranks = jax.pmap(lambda x, y: x + y)(X, Y)
    out_vector = jax.pmap(lambda v, x: jnp.clip(x - v, max=v), in_axes=(None, 0))(V, X)
    out_matmul = jax.pmap(lambda w, x: x @ w, in_axes=(None, 0))(W, Y)
    out_dot = jax.pmap(lambda v, x: jnp.dot(x, v), in_axes=(None, 0))(V, Y)

    def step(x, y):
        z = x * 2.0
        z += y
        return z, {"soft": jax.nn.softmax(z)}

    out_step = jax.pmap(step)(X, X)
"""
# A replicated value longer than the mapped one, a product the block's axis would enter, a global
# array of unknown rank: broadcasting could line them up against the block's extra axis.
NOT_BROADCASTS = {
    "longer_replicated": (
        "out = jax.pmap(lambda v, x: x - v, in_axes=(None, 0))(jnp.ones((4, 3)), X)\n",
        "x - v",
    ),
    "matmul_by_3d": (
        "out = jax.pmap(lambda w, x: x @ w, in_axes=(None, 0))(jnp.ones((2, 3, 4)), X)\n",
        "x @ w",
    ),
    "dot_of_mapped": ("out = jax.pmap(lambda x: jnp.dot(x, x))(X)\n", "jnp.dot(x, x)"),
    "replicated_first": (
        "out = jax.pmap(lambda w, x: jnp.dot(w, x), in_axes=(None, 0))(jnp.ones((4, 3)), X)\n",
        "jnp.dot(w, x)",
    ),
    "global_array": ("C = jnp.ones((5, 3))\nout = jax.pmap(lambda x: x + C)(X)\n", "x + C"),
    "softmax_of_a_scalar_slice": (
        "out = jax.pmap(lambda x: jax.nn.softmax(x))(jnp.arange(8.0))\n",
        "softmax",
    ),
}


def test_broadcasts_and_products_are_inline_where_the_ranks_keep_them_and_give_pmaps_outputs():
    before = module(BROADCASTS)
    assert all(map(inline, pmaps(before))) and len(pmaps(before)) == 5
    old, new = outputs(before), outputs(fix_source(before))
    assert old.keys() == new.keys()
    for x, y in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True):
        assert np.shape(x) == np.shape(y)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


@pytest.mark.parametrize("name", sorted(NOT_BROADCASTS))
def test_what_broadcasting_could_line_up_against_the_blocks_axis_keeps_the_helper(name):
    body, where = NOT_BROADCASTS[name]
    before = HEAD + "X = jnp.arange(24.0).reshape(8, 3)\n" + body
    (finding,) = pmaps(before)
    assert finding.fixable and not inline(finding) and where in finding.fix.split("not inline: ")[1]
