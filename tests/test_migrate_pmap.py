"""meshkit migrate, MK015: pmap -> the shard_map helper keeps pmap's results exactly, or is left with a recipe."""

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from _limits import limit
from meshkit.migrate import fix_source, lint_source
from meshkit.migrate.rules_pmap import HELPER, PMAP_HELPER

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


def rewrite_matches_pmap(before: str, inline: bool = False) -> str:
    """Fix ``before``, run both, and check ``out`` is the same; returns the fixed text.

    ``inline``: every pmap is written as jax.jit(jax.shard_map(...)) in place (no helper), else
    the helper is added.
    """
    after = fix_source(before)
    assert "jax.pmap" not in after and (f"def {HELPER}(" not in after) == inline, after
    assert [f for f in lint_source(after) if f.rule == "MK015"] == []
    assert_same(run(after)["out"], run(before)["out"])
    return after


def mk015(text: str) -> list:
    return [f for f in lint_source(text) if f.rule == "MK015"]


def test_immediately_called_pmap_is_one_site_and_keeps_its_function_and_axis():
    before = src("""
        import jax
        import jax.numpy as jnp
        out = jax.pmap(lambda x: x - jax.lax.pmean(x, "i"), axis_name="i")(jnp.arange(16.0).reshape(8, 2))
    """)
    (finding,) = mk015(before)
    assert finding.fixable and finding.fix.startswith("written inline")
    after = rewrite_matches_pmap(before, inline=True)
    assert after.splitlines()[-2:] == [
        'mesh = jax.sharding.Mesh(jax.devices()[:8], ("i",))',
        'out = jax.jit(jax.shard_map(lambda x: x - jax.lax.pmean(x, "i"), mesh=mesh, in_specs=P("i"), '
        'out_specs=P("i")))(jnp.arange(16.0).reshape(8, 2))',
    ]


def test_keyword_arguments_at_call_sites_are_mapped_as_pmap_maps_them():
    before = src("""
        import jax
        import jax.numpy as jnp

        def step(state, batch, dropout_rng):
            noise = jax.random.uniform(dropout_rng, batch.shape)
            return state + jax.lax.psum(batch * noise, "b")

        p_step = jax.pmap(step, axis_name="b")
        rngs = jax.random.split(jax.random.key(0), 8)
        out = p_step(jnp.ones(8), jnp.arange(8.0), dropout_rng=rngs), p_step(jnp.ones(8), batch=jnp.ones(8), dropout_rng=rngs)
    """)
    rewrite_matches_pmap(before)


def test_short_leading_axis_uses_as_many_devices_as_it_has():
    before = src("""
        import jax
        import jax.numpy as jnp
        f = jax.pmap(lambda x: (x / jax.lax.psum(x, "i"), jax.lax.all_gather(x, "i")), axis_name="i")
        out = f(jnp.arange(1.0, 5.0)), f(jnp.arange(1.0, 9.0)), f(jnp.arange(1.0, 3.0))
    """)
    after = rewrite_matches_pmap(before)
    short, gathered = run(after)["out"][0]
    np.testing.assert_array_equal(gathered, np.broadcast_to(np.arange(1.0, 5.0), (4, 4)))
    np.testing.assert_allclose(short, np.arange(1.0, 5.0) / 10.0, rtol=1e-6)
    assert short.sharding.num_devices == 4


def test_module_level_pmap_builds_no_mesh_at_import(tmp_path: Path):
    """The fixed module is imported before the device count is configured: nothing may start the backend."""
    legacy = src("""
        import jax
        import jax.numpy as jnp
        double = jax.pmap(lambda x: 2 * jax.lax.psum(x, "d"), axis_name="d")
    """)
    fixed = fix_source(legacy)
    assert "jax.sharding.Mesh(" in fixed and f"double = {HELPER}(lambda x" in fixed
    (tmp_path / "legacy_mod.py").write_text(fixed)
    main = src("""
        import os
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax
        import legacy_mod
        jax.config.update("jax_num_cpu_devices", 4)
        print(jax.device_count(), legacy_mod.double(jax.numpy.arange(4.0)).tolist())
    """)
    done = subprocess.run(
        [sys.executable, "-c", main],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=limit(1),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["4", "[12.0,", "12.0,", "12.0,", "12.0]"]


def test_decorator_with_broadcast_argument_donation_and_several_outputs():
    before = src("""
        from functools import partial
        import jax
        import jax.numpy as jnp

        @partial(jax.pmap, axis_name="batch", in_axes=(None, 0), donate_argnums=(1,))
        def step(w, x):
            return jax.lax.psum(x @ w, "batch"), jax.lax.axis_index("batch"), x + jax.lax.pmean(x, "batch")

        out = step(jnp.arange(3.0), jnp.arange(48.0).reshape(8, 2, 3))
    """)
    after = rewrite_matches_pmap(before)
    assert f'@partial({HELPER}, axis_name="batch", in_axes=(None, 0), donate_argnums=(1,))\ndef step' in after


def test_bare_decorator_imported_aliases_and_unused_imports_dropped():
    before = src("""
        import jax
        import jax.numpy as jnp
        from jax import pmap
        from jax import pmap as pm

        @jax.pmap
        def double(tree):
            return jax.tree.map(lambda a: 2 * a, tree)

        g = pmap(lambda x, y: x * y, "i")
        h = pm(lambda x: x + 1)
        out = double({"a": jnp.ones((8, 3)), "b": jnp.arange(8)}), g(jnp.arange(8), jnp.arange(8)), h(jnp.ones(8))
    """)
    after = rewrite_matches_pmap(before)
    assert "from jax import pmap" not in after and f"@{HELPER}\ndef double" in after
    assert len(mk015(before)) == 3


def test_pmap_from_the_removed_jax_api_module_is_recognised():
    before = "from jax.api import pmap\nf = pmap(lambda x: x * 2)\n"
    assert [f.rule for f in lint_source(before)] == ["MK021", "MK015"]
    after = fix_source(before)
    assert "jax.api" not in after and "import jax\n" in after and f"f = {HELPER}(lambda x: x * 2)" in after
    np.testing.assert_array_equal(run(after)["f"](np.arange(8.0)), np.arange(8.0) * 2)


def test_shadowed_p_is_left_alone():
    """Where the module binds ``P`` itself, the inline form spells jax.sharding.PartitionSpec in full
    (the helper always does): a module's own ``P`` is never touched."""
    before = src("""
        import jax
        import jax.numpy as jnp
        P = 3  # the module's own P
        f = jax.pmap(lambda x: x * P, axis_name="i")
        out = f(jnp.arange(8.0)), P
    """)
    after = rewrite_matches_pmap(before, inline=True)
    assert "import PartitionSpec" not in after and "P = 3  # the module's own P" in after
    assert 'in_specs=jax.sharding.PartitionSpec("i"), out_specs=jax.sharding.PartitionSpec("i")' in after
    assert run(after)["out"][1] == 3


def test_fixture_training_step_matches_numpy():
    after = fix_source(FIXTURE.read_text())
    assert "jax.pmap" not in after and "jax.random.key(0)" in after and lint_source(after) == []
    grad0, doubled, sizes, x, y = run(after)["run"]()
    x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
    expected = np.mean([xd.T @ (-yd) / xd.shape[0] for xd, yd in zip(x64, y64, strict=True)], axis=0)
    np.testing.assert_allclose(grad0, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(doubled, np.broadcast_to(2 * expected, (jax.device_count(), 3)), rtol=1e-5)
    assert sizes == {"x": (8, 4, 3), "y": (8, 4)}


def test_multi_host_code_is_left_alone_with_a_warning():
    before = src("""
        import jax
        import jax.numpy as jnp

        def train(batch):
            step = jax.pmap(lambda x: jax.lax.pmean(x, "i"), axis_name="i")
            if jax.process_index() == 0:
                print("host 0")
            return step(batch.reshape(jax.local_device_count(), -1))
    """)
    (finding,) = mk015(before)
    assert "multi-host code (jax.process_index at line 6)" in finding.message and not finding.fixable
    assert "make_array_from_process_local_data" in finding.fix
    assert fix_source(before) == before


def test_helper_is_added_once_and_reused_on_a_later_fix():
    before = "import jax\nf = jax.pmap(lambda x: x)\ng = jax.pmap(lambda x: x, in_axes=-1)\n"
    once = fix_source(before)
    assert once.count(f"def {HELPER}(") == 1 and "g = jax.pmap(" in once
    by_hand = once.replace("in_axes=-1", "in_axes=0")
    twice = fix_source(by_hand)
    assert twice.count(f"def {HELPER}(") == 1 and "g = _pmap_via_shard_map(lambda x: x, in_axes=0)" in twice
    taken = f"import jax\n{HELPER} = 1\nf = jax.pmap(lambda x: x)\n"
    (finding,) = mk015(taken)
    assert f"already binds {HELPER}" in finding.message and fix_source(taken) == taken


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        ('jax.pmap(f, axis_name="i", out_axes=1)', "out_axes != 0"),
        ('jax.pmap(f, axis_name="i", static_broadcasted_argnums=(1,))', "static_broadcasted_argnums"),
        ("jax.pmap(g)", "collectives but no axis_name"),
        ('jax.pmap(f, axis_name="i", devices=jax.devices()[:2])', "pmap argument devices="),
        ('jax.pmap(f, axis_name="i", in_axes=(0, -1))', "in_axes not a literal"),
        ("jax.pmap(f, **options)", "passed with * or **"),
        ("jax.pmap", "named here but not applied"),
        ('jax.pmap(f, axis_name="i")\n        text = h.lower(1, 2)', "attributes are used"),
        ('jax.pmap(f, axis_name="i").lower(1, 2)', "attributes are used"),
    ],
)
def test_not_provable_is_reported_with_a_recipe(call, reason):
    before = src(f"""
        from functools import partial
        import jax

        def f(x, y):
            return x + y

        def g(x):
            return jax.lax.psum(x, "i")

        h = {call}
    """)
    (finding,) = mk015(before)
    assert reason in finding.message and not finding.fixable and finding.fix.startswith("by hand: ")
    assert fix_source(before) == before


@pytest.mark.parametrize(
    "loop",
    [
        "jax.lax.fori_loop(0, 3, lambda i, c: c + x, jnp.zeros(()))",
        "jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + x), (0, jnp.zeros(())))[1]",
        "jax.lax.scan(lambda c, _: (c + x, None), jnp.zeros(()), None, length=3)[0]",
    ],
    ids=["fori_loop", "while_loop", "scan"],
)
def test_loop_carry_that_starts_constant_and_becomes_per_device(loop):
    """pmap checks no replication: a carry typed as replicated that turns per-device is fine there."""
    before = src(f"""
        import jax
        import jax.numpy as jnp

        def body(x):
            return {loop} + jax.lax.psum(x, "i")

        out = jax.pmap(body, axis_name="i")(jnp.arange(8.0))
    """)
    rewrite_matches_pmap(before)


def test_callback_without_vmap_method_runs_as_under_pmap():
    """pmap does not vmap the body, so a pure_callback needs no vmap_method."""
    before = src("""
        import jax
        import jax.numpy as jnp
        import numpy as np

        def body(x):
            y = jax.pure_callback(lambda a: np.sin(np.asarray(a)), jax.ShapeDtypeStruct(x.shape, x.dtype), x)
            return jax.lax.pmean(y, "i"), y

        out = jax.pmap(body, axis_name="i")(jnp.arange(16.0).reshape(8, 2))
    """)
    rewrite_matches_pmap(before)


def test_rewritten_function_keeps_its_name_and_docstring():
    """Another module may read them (logging, registries): the helper copies them as pmap does."""
    before = src('''
        import functools
        import jax

        def double(x):
            """Twice x."""
            return x * 2

        p_double = jax.pmap(double)
        p_scaled = jax.pmap(functools.partial(functools.partial(double), x=1.0))
    ''')
    pmapped, rewritten = run(before), run(fix_source(before))
    assert (rewritten["p_double"].__name__, rewritten["p_double"].__qualname__) == ("double", "double")
    for name in ("p_double", "p_scaled"):
        assert [getattr(pmapped[name], a) for a in ("__name__", "__qualname__", "__doc__")] == [
            getattr(rewritten[name], a) for a in ("__name__", "__qualname__", "__doc__")
        ]


def test_pmap_bound_to_an_attribute_whose_lower_is_used_is_left_alone():
    before = src("""
        import jax

        class Trainer:
            def __init__(self):
                self.step = jax.pmap(lambda x: x * 2, axis_name="i")

            def hlo(self, x):
                return self.step.lower(x).as_text()
    """)
    (finding,) = mk015(before)
    assert "attributes are used (.lower)" in finding.message and not finding.fixable
    assert fix_source(before) == before
    assert run(before)["Trainer"]().hlo(np.arange(8.0)).startswith("module")  # which the helper lacks
    names_only = before.replace("self.step.lower(x).as_text()", "self.step.__name__")
    assert mk015(names_only)[0].fixable  # the helper copies __name__: reading it blocks nothing


@pytest.mark.parametrize(
    "mapped",
    [
        '@partial(jax.pmap, axis_name="i")\n@partial(jax.pmap, axis_name="j")\ndef f(x):\n    return x\n',
        'g = jax.pmap(lambda x: x, axis_name="j")\nf = jax.pmap(g, axis_name="i")\n',
        'f = jax.pmap(jax.pmap(lambda x: x, axis_name="j"), axis_name="i")\n',
        '@jax.pmap\ndef g(x):\n    return x\n\n\nf = jax.pmap(g, axis_name="i")\n',
    ],
    ids=["stacked_decorators", "pmap_of_a_pmapped_name", "pmap_of_pmap", "pmap_of_a_pmapped_def"],
)
def test_pmap_of_a_pmapped_function_is_nested_and_left_with_a_recipe(mapped):
    before = "from functools import partial\n\nimport jax\n\n" + mapped
    found = lint_source(before)
    (nested,) = [f for f in found if f.rule == "MK014"]
    assert "nested pmap" in nested.message and "2D mesh" in nested.fix
    assert [f.fixable for f in found if f.rule == "MK015"] == [False, False]
    assert fix_source(before) == before
    with pytest.raises(ValueError, match="should match the mesh"):  # JAX 0.12's pmap refuses it too
        run(before + "out = f(jax.numpy.ones((2, 4)))\n")


def test_a_helper_from_an_earlier_meshkit_is_replaced_by_the_current_one():
    earlier = (FIXTURE.parent / "earlier" / "helper_40ff648.py").read_text()
    with pytest.raises(TypeError, match="carry"):
        run(earlier)
    (finding,) = mk015(earlier)
    assert "earlier meshkit helper" in finding.message and finding.fixable
    after = fix_source(earlier)
    assert after.count(f"def {HELPER}(") == 1 and PMAP_HELPER.strip() in after and fix_source(after) == after
    x = np.arange(8.0)
    np.testing.assert_allclose(run(after)["out"], 3 * x + x.sum())  # three loop steps, plus the psum
