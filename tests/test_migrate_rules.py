"""meshkit migrate, rules MK001-MK014: each finds its pattern, and each fix runs under JAX 0.12 on 8 devices."""

import textwrap
import warnings

import jax
import numpy as np
import pytest

from meshkit.migrate import RULES, fix_source, lint_source


def src(text: str) -> str:
    return textwrap.dedent(text).lstrip()


def rules_in(text: str) -> list[str]:
    return [f.rule for f in lint_source(text)]


def run(text: str) -> dict:
    """Execute ``text`` in a fresh namespace and return the namespace."""
    ns: dict = {}
    exec(compile(text, "<snippet>", "exec"), ns)
    return ns


def test_registry_has_ids_titles_and_checks():
    assert [r for r in RULES if r != "MK000"] == [f"MK{i:03d}" for i in range(1, 23)]
    assert all(r.title and (r.nodes or r.id == "MK000") for r in RULES.values())


def test_mk001_tree_aliases_become_jax_tree():
    before = src("""
        import jax
        out = jax.tree_map(lambda a: a * 2, {"a": 1, "b": (2, 3)})
        leaves = jax.tree_leaves(out)
        flat, tree = jax.tree_flatten(out)
        back = jax.tree_unflatten(jax.tree_structure(out), flat)
        ok = jax.tree_util.tree_map(lambda a: a, 1)
    """)
    assert rules_in(before) == ["MK001"] * 5
    with pytest.raises(AttributeError):
        run(before)
    after = fix_source(before)
    assert "jax.tree.map(" in after and "jax.tree.unflatten(jax.tree.structure(out)" in after
    assert "jax.tree_util.tree_map" in after
    ns = run(after)
    assert ns["out"] == {"a": 2, "b": (4, 6)} and ns["leaves"] == [2, 4, 6] and ns["back"] == ns["out"]


def test_mk001_from_import_keeps_the_local_name():
    before = "from jax import tree_map\nout = tree_map(lambda a: a + 1, [1, 2])\n"
    after = fix_source(before)
    assert after.startswith("from jax.tree import map as tree_map\n")
    assert run(after)["out"] == [2, 3]
    mixed = "from jax import numpy, tree_map\n"
    assert rules_in(mixed) == ["MK001"] and fix_source(mixed) == mixed


def test_mk002_prng_key_becomes_typed_key_with_same_bits():
    before = "import jax\nk = jax.random.PRNGKey(0)\nx = jax.random.normal(k, (3,))\n"
    assert rules_in(before) == ["MK002"]
    after = fix_source(before)
    assert "jax.random.key(0)" in after
    np.testing.assert_array_equal(run(after)["x"], run(before)["x"])
    imported = fix_source("from jax.random import PRNGKey\nk = PRNGKey(1)\n")
    assert imported.startswith("from jax.random import key as PRNGKey\n")


def test_mk003_device_call_becomes_attribute():
    before = "import jax.numpy as jnp\nd = jnp.ones(3).device()\n"
    assert rules_in(before) == ["MK003"]
    with pytest.raises(TypeError):
        run(before)
    assert run(fix_source(before))["d"] == jax.devices()[0]
    assert rules_in("class A:\n    def f(self):\n        return self.device()\n") == []
    assert rules_in("d = x.device(0)\n") == []


def test_mk004_experimental_maps_is_reported_not_fixed():
    before = src("""
        import jax.experimental.maps
        from jax.experimental.maps import Mesh, xmap
        from jax.experimental import maps
    """)
    found = lint_source(before)
    assert [f.rule for f in found] == ["MK004"] * 3
    assert all(not f.fixable and "jax.make_mesh" in f.fix for f in found)
    assert fix_source(before) == before
    with pytest.raises(ModuleNotFoundError):
        run("import jax.experimental.maps\n")


SHARD_MAP = src("""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from jax.experimental.shard_map import shard_map

    mesh = jax.sharding.Mesh(jax.devices(), ("i",))
    total = shard_map(lambda x: jax.lax.psum(x, "i"), mesh, P("i"), P(), check_rep=True)(jnp.arange(8.0))
""")


def test_mk005_experimental_shard_map_becomes_jax_shard_map():
    assert rules_in(SHARD_MAP) == ["MK005", "MK005"]
    after = fix_source(SHARD_MAP)
    assert "from jax import shard_map\n" in after
    assert 'mesh=mesh, in_specs=P("i"), out_specs=P(), check_vma=True' in after
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        original = run(SHARD_MAP)["total"]
    np.testing.assert_array_equal(run(after)["total"], original)
    np.testing.assert_array_equal(original, [28.0])


def test_mk005_attribute_form_needs_import_jax_only():
    before = "import jax.experimental.shard_map\nf = jax.experimental.shard_map.shard_map\n"
    assert fix_source(before).endswith("f = jax.shard_map\n")


def test_mk006_cpu_device_count_option_renamed():
    before = 'import jax\njax.config.update("jax_cpu_device_count", 8)\nn = jax.device_count()\n'
    assert rules_in(before) == ["MK006"]
    with pytest.raises(AttributeError):
        run(before)
    after = fix_source(before)
    assert '"jax_num_cpu_devices"' in after
    assert run(after)["n"] == 8


def test_mk007_device_array_becomes_jax_array():
    before = "import jax.numpy as jnp\nok = isinstance(jnp.ones(3), jnp.DeviceArray)\n"
    assert rules_in(before) == ["MK007"]
    with pytest.raises(AttributeError):
        run(before)
    after = fix_source(before)
    assert "import jax\n" in after and "jax.Array)" in after
    assert run(after)["ok"] is True
    imported = fix_source("from jax.interpreters.xla import DeviceArray\nok = isinstance(1, DeviceArray)\n")
    assert imported.startswith("from jax import Array as DeviceArray\n")
    assert run(imported)["ok"] is False


def test_mk008_jit_device_dropped_only_when_it_is_the_default_device():
    before = src("""
        import jax
        import jax.numpy as jnp
        f = jax.jit(lambda x: x + 1, device=jax.devices()[0])
        out = f(jnp.arange(3))
    """)
    (finding,) = lint_source(before)
    assert finding.rule == "MK008" and finding.fixable and "computation follows data" in finding.fix
    after = fix_source(before)
    assert "device=" not in after and "jax.jit(lambda x: x + 1)" in after
    np.testing.assert_array_equal(run(after)["out"], [1, 2, 3])
    other = "import jax\nf = jax.jit(g, device=jax.devices()[3])\n"
    (finding,) = lint_source(other)
    assert not finding.fixable and finding.fix.startswith("by hand: device_put the inputs")
    assert fix_source(other) == other


def test_mk009_pmap_jit_kwarg_removed():
    before = (
        "import jax\nimport jax.numpy as jnp\nout = jax.pmap(lambda x: x * 2, jit=True)(jnp.arange(8.0))\n"
    )
    assert "MK009" in rules_in(before)
    with pytest.raises(TypeError):
        run(before)
    after = fix_source(before, select=["MK009"])
    assert "jax.pmap(lambda x: x * 2)(" in after
    np.testing.assert_array_equal(run(after)["out"], np.arange(8.0) * 2)
    decorated = 'from functools import partial\nimport jax\n@partial(jax.pmap, axis_name="i", jit=True)\ndef f(x):\n    return x\n'
    assert '@partial(jax.pmap, axis_name="i")\n' in fix_source(decorated, select=["MK009"])


def test_mk010_float_shapes_become_ints():
    before = src("""
        import jax.numpy as jnp
        a = jnp.ones(16.)
        b = jnp.zeros((4., 2))
        c = jnp.full(shape=(2.0, 3), fill_value=1.5)
    """)
    assert rules_in(before) == ["MK010"] * 3
    with pytest.raises(TypeError):
        run(before)
    after = fix_source(before)
    assert "jnp.ones(16)" in after and "jnp.zeros((4, 2))" in after and "fill_value=1.5" in after
    ns = run(after)
    assert (ns["a"].shape, ns["b"].shape, ns["c"].shape) == ((16,), (4, 2), (2, 3))
    fractional = "import jax.numpy as jnp\na = jnp.ones(2.5)\n"
    assert rules_in(fractional) == ["MK010"] and fix_source(fractional) == fractional


def test_mk011_collective_without_axis_name_is_reported():
    before = "import jax\nfrom jax import lax\na = jax.lax.psum(x)\nb = lax.pmean(x)\nc = lax.psum(x, 'i')\n"
    found = lint_source(before)
    assert [(f.rule, f.line, f.fixable) for f in found] == [("MK011", 3, False), ("MK011", 4, False)]
    assert fix_source(before) == before
    with pytest.raises(TypeError):
        jax.lax.psum(1.0)


def test_mk012_params_mapped_by_default_suggests_broadcast():
    before = "import jax\ndef step(params, batch):\n    return params + batch\nf = jax.pmap(step)\n"
    (finding, rewrite) = lint_source(before)
    assert finding.rule == "MK012" and "in_axes=(None, 0)" in finding.fix and not finding.fixable
    assert rewrite.rule == "MK015" and not rewrite.fixable and fix_source(before) == before
    assert rules_in(before.replace("pmap(step)", "pmap(step, in_axes=(None, 0))")) == ["MK015"]


def test_mk013_all_none_in_axes_is_reported_with_replication_recipe():
    for in_axes in ("None", "(None, None)"):
        before = f"import jax\nf = jax.pmap(lambda a, b: a + b, in_axes={in_axes})\n"
        found = [f for f in lint_source(before) if f.rule == "MK013"]
        assert len(found) == 1 and "NamedSharding(mesh, P())" in found[0].fix
        assert fix_source(before) == before
    with pytest.raises(ValueError):
        jax.pmap(lambda a: a, in_axes=None)(np.ones(8))


def test_mk014_nested_pmap_is_reported_and_not_rewritten():
    before = src("""
        import jax
        inner = jax.pmap(lambda x: x + 1)

        @jax.pmap
        def outer(x):
            return inner(x)
    """)
    found = lint_source(before)
    assert [f.rule for f in found] == ["MK015", "MK015", "MK014"]
    assert found[2].line == 6 and "2D mesh" in found[2].fix
    assert fix_source(before) == before
