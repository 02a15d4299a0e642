"""Model families as the unit of extension (``meshkit.models.registry``): every row is whole and
consistent with its model, its Hugging Face format reads back what it writes, and a family added
as one row trains, verifies and is refused where it has no format, with no module above the models
changed."""

import dataclasses
import textwrap

import jax
import numpy as np
import pytest

from meshkit import interop
from meshkit.models import registry
from meshkit.models.shape import ModelShape
from meshkit.train import config as C
from meshkit.train import job

FAMILIES = registry.names()


@pytest.mark.parametrize("name", FAMILIES)
def test_each_row_is_its_models(name):
    """The row's config class builds its small model, which the registry maps back to the row; its
    shape is the row's (gated or not) and rebuilds the same model; its options are shape fields and
    run options; its whole units are logical axes of its parameters."""
    family = registry.family(name)
    cfg = family.small(layers=2, heads=4, experts=0, scan_layers=False)
    assert registry.family_of(cfg) is family and isinstance(cfg, family.config)
    shape = cfg.shape()
    assert shape.gated == family.gated
    assert family.config.from_shape(shape).shape() == shape
    assert set(family.options) <= {f.name for f in dataclasses.fields(ModelShape)} & set(C.OPTIONS)
    params = jax.eval_shape(lambda: family.module.init(jax.random.key(0), cfg))
    axes = {a for leaf in jax.tree.leaves(family.module.logical_axes(params), is_leaf=lambda x: isinstance(x, tuple)) for a in leaf}  # fmt: skip
    assert set(family.units(cfg)) <= axes
    assert set(family.options_of(cfg)) == set(family.options)


@pytest.mark.parametrize("name", [f.name for f in registry.families() if f.hf is not None])
def test_each_hugging_face_format_reads_back_what_it_writes(name, tmp_path):
    """``config.json`` and every weight of the family's small model, written and read back, are the
    model's own: the weight-name mapping covers every leaf, both ways."""
    family = registry.family(name)
    cfg = family.small(layers=2, heads=4, experts=0, scan_layers=False)
    assert interop.config_from_hf(interop.config_to_hf(cfg)) == cfg
    params = family.module.init(jax.random.key(1), cfg)
    interop.save(params, cfg, tmp_path / "ckpt")
    loaded, read = interop.load(tmp_path / "ckpt")
    assert read == cfg
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


TOY = '''
"""A third family for the test: meshkit's GPT under another config class, with no Hugging Face format."""
import dataclasses

from meshkit.models import gpt
from meshkit.models.family import Family
from meshkit.models.gpt import apply, flops_per_token, init, logical_axes, make_loss, stages  # noqa: F401


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ToyConfig(gpt.GPTConfig):
    pass


FAMILY = Family(name="toy", about="a GPT by another name", module_name="meshkit_toy_family", config_name="ToyConfig",
                learned_positions=True, small=lambda **kw: ToyConfig(vocab_size=64, seq_len=16, width=32, **kw))
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    (tmp_path / "meshkit_toy_family.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_ROWS", (*registry._ROWS, "meshkit_toy_family"))
    return registry.family("toy")


def test_a_new_family_is_one_row(toy):
    """Registered as one row, a GPT copy named 'toy' is a run's model (its config, shape and checks),
    verify's workload (a certificate of dp+tp passes), ``--model``'s help names it, and its missing
    Hugging Face format is refused by name; an option of another family is refused for it."""
    from meshkit import verify

    cfg = C.tiny().replace(model="toy")
    C.validate(cfg)
    model = job.model_config(cfg, toy, 64)
    assert registry.family_of(model) is toy and type(model).__name__ == "ToyConfig"
    assert job.model_shape(cfg, toy, 64).name == "toy"
    with pytest.raises(C.ConfigError, match=r"--kv-heads (is|are) for --model llama"):
        C.validate(cfg.replace(kv_heads=2))
    assert "toy (a GPT by another name)" in registry.summary()
    with pytest.raises(interop.InteropError, match="model family toy has no Hugging Face format"):
        interop.config_to_hf(model)
    cert = verify.verify("dp+tp", "toy", mesh="data=4,model=2", steps=2)
    assert cert.ok, cert.checks
