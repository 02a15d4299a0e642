"""meshkit migrate, MK015 (issue 35 regression): a simple pmap in a legacy module is rewritten again.

Since pmaps bound to attributes were followed by name (``self.forward = jax.pmap(forward)`` under
``forward``), a bare name and a member of the same name were one: a pmapped function calling the
plain ``forward`` def, or a pmap of a plain ``step`` beside some ``self.step`` pmap, or two
classes each binding ``self.train_step``, was 'nested pmap'; and ``state.step.shape`` counted as
reading ``.shape`` on a pmapped def ``step``. Each is rewritten again (as before that change) and
gives pmap's outputs; what really is nested, or really reads ``.lower``, is still left alone.

Reads of attributes had the same fault (the trust issue): a pmap bound to ``self.loss`` counted
``loss.mean()`` on a local named ``loss``, and ``state.step.shape`` on another object; a variable
pmap counted a same-named local of another scope (a loop variable, a comprehension's, a file
opened by ``with``). A read counts where it is of the pmap: ``self.loss.<attr>`` in its class, a
name that libcst's scopes resolve to the pmap's binding; where that cannot be known (another
object's ``.step``) it counts if the attribute is one pmap's function has and the rewrite's has
otherwise (``.lower``), so those are still left alone.
"""

import textwrap

import jax
import numpy as np
import pytest

from meshkit.migrate import fix_source, lint_source
from meshkit.migrate.rules_pmap import HELPER

HEAD = "import jax\nimport jax.numpy as jnp\n\n"
X = "jnp.arange(8.0).reshape(8, 1)"

# Each defines ``out``; every pmap in it is simple and must be rewritten.
SIMPLE = {
    "pmapped_fn_calls_a_plain_def_named_like_a_member_pmap": f"""
        def forward(x):
            return x * 2

        def train_step(x):
            return forward(x) + 1

        class Model:
            def __init__(self):
                self.forward = jax.pmap(forward)

        p_train_step = jax.pmap(train_step)
        out = (p_train_step({X}), Model().forward({X}))
    """,
    "pmap_of_a_plain_def_named_like_a_member_pmap": f"""
        def step(x):
            return x * 2

        def other(x):
            return x + 1

        class Runner:
            def __init__(self):
                self.step = jax.pmap(other)

        p = jax.pmap(step)
        out = (p({X}), Runner().step({X}))
    """,
    "two_classes_bind_the_same_member": f"""
        def train_step(x):
            return x * 2

        class A:
            def __init__(self):
                self.train_step = jax.pmap(train_step)

        class B:
            def __init__(self):
                self.train_step = jax.pmap(train_step)

        out = (A().train_step({X}), B().train_step({X}))
    """,
    "a_member_of_another_object_has_the_pmapped_defs_name": f"""
        @jax.pmap
        def step(x):
            return x * 2

        class State:
            step = jnp.zeros(())

        state = State()
        out = (step({X}), state.step.shape)
    """,
    "a_local_of_another_function_has_the_name_the_pmapped_fn_calls": f"""
        def forward(x):
            return x * 2

        def train_step(x):
            return forward(x) + 1

        def evaluate():
            forward = jax.pmap(lambda x: x - 1)
            return forward({X})

        out = (jax.pmap(train_step)({X}), evaluate())
    """,
    "member_pmap_beside_a_local_of_its_name_that_reads_an_attribute": """
        def loss_fn(params, batch):
            return jax.lax.pmean(jnp.mean((batch * params) ** 2), axis_name="batch")

        class Trainer:
            def __init__(self):
                self.loss = jax.pmap(loss_fn, axis_name="batch")

            def evaluate(self, params, batch):
                loss = self.loss(params, batch)
                return loss.mean()

        n = jax.local_device_count()
        out = Trainer().evaluate(jnp.ones((n, 3)), jnp.arange(3.0 * n).reshape(n, 3))
    """,
    "member_pmap_beside_another_objects_member_shape": f"""
        class State:
            step = jnp.zeros((2, 5))

        class Runner:
            def __init__(self):
                self.step = jax.pmap(lambda x: x * 2)

        state = State()
        print(state.step.shape)
        out = (Runner().step({X}), state.step.shape)
    """,
    "member_pmap_beside_another_classes_member_item": f"""
        def train_step(x):
            return x + 1

        class State:
            def __init__(self):
                self.train_step = jnp.array(3)

            def steps(self):
                return self.train_step.item()

        class Trainer:
            def __init__(self):
                self.train_step = jax.pmap(train_step)

        state = State()
        out = (Trainer().train_step({X}), state.train_step.item(), state.steps())
    """,
    "a_loop_variable_of_another_function_has_the_pmaps_name": f"""
        def _predict(x):
            return x * 3

        predict = jax.pmap(_predict)

        def shapes(results):
            found = []
            for predict in results:
                found.append(predict.shape)
            return found

        out = (predict({X}), shapes([jnp.zeros(2), jnp.zeros((1, 3))]))
    """,
    "a_comprehension_variable_has_the_pmaps_name": f"""
        step = jax.pmap(lambda x: x - 1)
        shapes = [step.shape for step in (jnp.zeros(2), jnp.zeros(3))]
        out = (step({X}), shapes)
    """,
    "a_file_opened_in_another_function_has_the_pmaps_name": f"""
        import os

        f = jax.pmap(lambda x: x + 2)

        def save(path, text):
            with open(path, "w") as f:
                f.write(text)

        save(os.devnull, "done")
        out = f({X})
    """,
}

# Still left with a recipe: nested for real (the name reaches a pmap), or .lower read on the pmap.
LEFT = {
    "module_level_rebinding_called_inside": (
        """
        def forward(x):
            return x * 2

        forward = jax.pmap(forward)

        @jax.pmap
        def train_step(x):
            return forward(x) + 1
        """,
        "nested pmap",
    ),
    "pmap_of_a_local_pmap": (
        """
        def main():
            g = jax.pmap(lambda x: x, axis_name="j")
            return jax.pmap(g, axis_name="i")
        """,
        "nested pmap",
    ),
    "rebinding_twice": (
        """
        def step(x):
            return x

        step = jax.pmap(step)
        step = jax.pmap(step)
        """,
        "nested pmap",
    ),
    "member_lower_read": (
        """
        class Trainer:
            def __init__(self):
                self.step = jax.pmap(lambda x: x * 2)

            def hlo(self, x):
                return self.step.lower(x).as_text()
        """,
        "attributes are used (.lower)",
    ),
    "decorated_method_lower_read": (
        """
        class Trainer:
            @jax.pmap
            def step(x):
                return x * 2

            def hlo(self, x):
                return self.step.lower(x).as_text()
        """,
        "attributes are used (.lower)",
    ),
    "variable_lower_read": (
        """
        @jax.pmap
        def step(x):
            return x * 2

        text = step.lower(jnp.ones((8, 1))).as_text()
        """,
        "attributes are used (.lower)",
    ),
    "member_lower_read_on_another_name_of_the_object": (
        """
        class Trainer:
            def __init__(self):
                self.step = jax.pmap(lambda x: x * 2)

        trainer = Trainer()
        text = trainer.step.lower(jnp.ones((8, 1))).as_text()
        """,
        "attributes are used (.lower)",
    ),
    "variable_lower_read_in_another_function": (
        """
        @jax.pmap
        def step(x):
            return x * 2

        def hlo(x):
            return step.lower(x).as_text()
        """,
        "attributes are used (.lower)",
    ),
    "member_read_on_its_own_base": (
        """
        class Trainer:
            def __init__(self):
                self.loss = jax.pmap(lambda x: x * 2)

            def name(self):
                return self.loss.__code__.co_name
        """,
        "attributes are used (.__code__)",
    ),
}


def module(body: str) -> str:
    return HEAD + textwrap.dedent(body).lstrip()


def outputs(text: str):
    ns: dict = {}
    exec(compile(text, "<snippet>", "exec"), ns)
    return ns["out"]


@pytest.mark.parametrize("name", sorted(SIMPLE))
def test_a_simple_pmap_is_rewritten_and_gives_pmaps_outputs_bitwise(name):
    before = module(SIMPLE[name])
    pmaps = [f for f in lint_source(before) if f.rule == "MK015"]
    assert pmaps and all(f.fixable for f in pmaps), [f.message for f in pmaps]
    assert not [f for f in lint_source(before) if f.rule == "MK014"]
    after = fix_source(before)
    # Rewritten: with the helper, or inline (jax.jit(jax.shard_map(...))) where the body is elementwise.
    assert "jax.pmap" not in after and (f"def {HELPER}(" in after or "jax.shard_map(" in after)
    old, new = outputs(before), outputs(after)
    assert jax.tree.structure(old) == jax.tree.structure(new)
    for x, y in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True):
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


@pytest.mark.parametrize("name", sorted(LEFT))
def test_what_is_nested_or_reads_lower_is_still_left_with_a_recipe(name):
    body, reason = LEFT[name]
    before = module(body)
    pmaps = [f for f in lint_source(before) if f.rule == "MK015"]
    assert pmaps and any(reason in f.message for f in pmaps), [f.message for f in pmaps]
    assert not any(f.fixable for f in pmaps)
    assert fix_source(before) == before
