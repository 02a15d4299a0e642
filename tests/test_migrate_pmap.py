"""meshkit migrate, MK015: pmap -> jax.jit(jax.shard_map(jax.vmap(f))) keeps pmap's results exactly."""

import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from meshkit.migrate import fix_source, lint_source

FIXTURE = Path(__file__).parent / "fixtures" / "migrate" / "legacy_train.py"


def src(text: str) -> str:
    return textwrap.dedent(text).lstrip()


def run(text: str) -> dict:
    ns: dict = {}
    exec(compile(text, "<snippet>", "exec"), ns)
    return ns


def assert_same(a, b):
    """Same tree of arrays, values and shapes."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)
        assert np.shape(x) == np.shape(y)


def rewrite_matches_pmap(before: str) -> str:
    """Fix ``before``, run both, and check ``out`` is the same; returns the fixed text."""
    after = fix_source(before)
    assert "pmap" not in after, after
    assert_same(run(after)["out"], run(before)["out"])
    return after


def test_call_with_axis_name_and_collective():
    before = src("""
        import jax
        import jax.numpy as jnp
        f = jax.pmap(lambda x: x - jax.lax.pmean(x, "i"), axis_name="i")
        out = f(jnp.arange(16.0).reshape(8, 2))
    """)
    assert [f.rule for f in lint_source(before)] == ["MK015"]
    after = rewrite_matches_pmap(before)
    assert "from jax.sharding import PartitionSpec as P\n" in after
    assert 'in_specs=P("i"), out_specs=P("i")' in after


def test_decorator_with_broadcast_argument_and_several_outputs():
    before = src("""
        from functools import partial
        import jax
        import jax.numpy as jnp

        @partial(jax.pmap, axis_name="batch", in_axes=(None, 0))
        def step(w, x):
            return jax.lax.psum(x @ w, "batch"), jax.lax.axis_index("batch"), jax.lax.all_gather(x, "batch")

        out = step(jnp.arange(3.0), jnp.arange(48.0).reshape(8, 2, 3))
    """)
    after = rewrite_matches_pmap(before)
    assert "@jax.jit\n@jax.shard_map(" in after and "@partial(jax.vmap, in_axes=(None, 0))\ndef step" in after
    assert 'in_specs=(P(), P("batch"))' in after


def test_bare_decorator_over_a_pytree_and_unused_imports_dropped():
    before = src("""
        import jax
        import jax.numpy as jnp
        from jax import pmap

        @jax.pmap
        def double(tree):
            return jax.tree.map(lambda a: 2 * a, tree)

        g = pmap(lambda x, y: x * y, "i")
        out = double({"a": jnp.ones((8, 3)), "b": jnp.arange(8)}), g(jnp.arange(8), jnp.arange(8))
    """)
    after = rewrite_matches_pmap(before)
    assert "from jax import pmap" not in after and "@jax.vmap\ndef double" in after


def test_fixture_training_step_matches_numpy():
    after = fix_source(FIXTURE.read_text())
    assert "jax.pmap" not in after and lint_source(after) == []
    grad0, doubled, sizes, x, y = run(after)["run"]()
    x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
    expected = np.mean([xd.T @ (-yd) / xd.shape[0] for xd, yd in zip(x64, y64, strict=True)], axis=0)
    np.testing.assert_allclose(grad0, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(doubled, np.broadcast_to(2 * expected, (jax.device_count(), 3)), rtol=1e-5)
    assert sizes == {"x": (8, 4, 3), "y": (8, 4)}


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        ('jax.pmap(f, axis_name="i", out_axes=1)', "out_axes != 0"),
        ('jax.pmap(f, axis_name="i", static_broadcasted_argnums=(1,))', "static_broadcasted_argnums"),
        ("jax.pmap(g)", "collectives but no axis_name"),
        ('partial(jax.pmap, axis_name="i")(f)', "pmap applied through partial"),
        ('jax.pmap(f, axis_name="i", devices=jax.devices()[:2])', "pmap argument devices="),
        ('jax.pmap(f, axis_name="i", in_axes=(0, -1))', "in_axes not a literal"),
    ],
)
def test_not_mechanical_is_reported_with_a_recipe(call, reason):
    before = src(f"""
        from functools import partial
        import jax

        def f(x, y):
            return x + y

        def g(x):
            return jax.lax.psum(x, "i")

        h = {call}
    """)
    (finding,) = [f for f in lint_source(before) if f.rule == "MK015"]
    assert reason in finding.message and not finding.fixable and finding.fix.startswith("by hand: ")
    assert fix_source(before) == before
