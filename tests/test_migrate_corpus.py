"""meshkit migrate on real legacy code: every file of tests/corpus/legacy, and snippets distilled from them.

The corpus files are old versions of public repositories' files (tests/corpus/legacy/SOURCES names
repository, commit and path). ``--fix`` must leave each one parseable, be idempotent, keep every
comment, rewrite nothing it left with a recipe, and find what EXPECTED says (reviewed by hand).
The snippets (tests/corpus/snippets) are small runnable programs with those files' pmap patterns:
run before and after ``--fix`` on 8 simulated devices, they give the same outputs.

The differential corpus (tests/corpus/differential) is a second, separate set of pmap-era files
(its SOURCES: 42 files of 16 other repositories, 2020-2023, with the lines of every pmap the tool
rewrites or leaves); each rewritten pmap is reproduced by a snippet, whose outputs under JAX 0.12's
pmap and after ``--fix`` must be bitwise equal.
"""

import io
import tokenize
import warnings
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest

from meshkit.migrate import fix_source, lint_source, migrate_file
from meshkit.migrate.rules_pmap import HELPER

CORPUS = Path(__file__).parent / "corpus"
LEGACY = sorted((CORPUS / "legacy").glob("*.py"))
SNIPPETS = sorted((CORPUS / "snippets").glob("*.py"))
DIFFERENTIAL = CORPUS / "differential"
DIFF_SNIPPETS = sorted(p for p in DIFFERENTIAL.glob("*.py") if p.name != "measure.py")
MULTIHOST = ("process_index()", "process_count()", "host_id()", "host_count()")

# Per file: (MK015 pmaps rewritten, MK015 left with a recipe, rules with a fix applied besides MK002).
# Reviewed against the sources: the pmaps left are in multi-host modules (process_index/host_id
# branches), use static_broadcasted_argnums, are passed around by name (trax) or nested (the Pmap
# Cookbook's, which JAX 0.12 refuses); the rewritten ones are single-host scripts, docs and
# libraries. MK002 is checked by the recipe invariant.
EXPECTED = {
    "EasyLM__EasyLM__jax_utils.py": (0, 0, {"MK007", "MK017"}),
    "EasyLM__EasyLM__main__gptj_train.py": (0, 0, {"MK017"}),
    "big_vision__big_vision__evaluators__classification.py": (1, 0, {"MK015"}),
    "big_vision__big_vision__train.py": (0, 1, {"MK001"}),
    "big_vision__big_vision__trainers__proj__image_text__contrastive.py": (0, 1, {"MK001"}),
    "big_vision__big_vision__utils.py": (0, 1, {"MK001"}),
    "brax__brax__training__es.py": (0, 1, {"MK001", "MK016"}),
    "brax__brax__training__normalization.py": (0, 0, {"MK001"}),
    "brax__brax__training__ppo.py": (0, 2, {"MK001", "MK016"}),
    "dalle_mini__dev__seq2seq__run_seq2seq_flax.py": (0, 3, {"MK001", "MK016"}),
    "deepmind_research__byol__byol_experiment.py": (2, 0, {"MK001", "MK015", "MK016"}),
    "deepmind_research__byol__utils__optimizers.py": (0, 0, {"MK016"}),
    "deepmind_research__glassy_dynamics__train_using_jax.py": (0, 0, set()),
    "deepmind_research__kfac_ferminet_alpha__utils.py": (0, 4, {"MK001", "MK016", "MK023"}),
    "deepmind_research__nfnets__experiment.py": (3, 0, {"MK001", "MK015", "MK016"}),
    "dm_haiku__examples__imagenet__train.py": (2, 0, {"MK001", "MK015"}),
    "dm_haiku__examples__impala_lite.py": (0, 0, {"MK001", "MK016"}),
    "dm_haiku__examples__mnist.py": (0, 0, {"MK001", "MK016"}),
    "dm_haiku__examples__mnist_pruning.py": (0, 0, {"MK001", "MK016", "MK019", "MK020"}),
    "dm_haiku__examples__rnn__train.py": (0, 0, {"MK020"}),
    "ferminet__ferminet__constants.py": (1, 0, {"MK015"}),
    "ferminet__ferminet__pretrain.py": (0, 0, set()),
    "ferminet__ferminet__train.py": (1, 0, {"MK007", "MK015"}),
    "flax__examples__imagenet__train.py": (0, 3, {"MK001", "MK016"}),
    "flax__examples__imagenet__train_2020.py": (0, 3, {"MK001", "MK016"}),
    "flax__examples__lm1b__train.py": (0, 4, {"MK001", "MK023"}),
    "flax__examples__nlp_seq__train.py": (0, 2, {"MK001"}),
    "flax__examples__pixelcnn__sample.py": (0, 1, set()),
    "flax__examples__pixelcnn__train.py": (0, 2, {"MK001", "MK016"}),
    "flax__examples__wmt__train.py": (0, 5, {"MK001"}),
    "flax__flax__jax_utils.py": (0, 0, {"MK001"}),
    "flax__flax__training__common_utils.py": (0, 0, {"MK001", "MK016"}),
    "jax__docs__jax-101__05.1-pytrees.py": (0, 0, {"MK001", "MK016"}),
    "jax__cloud_tpu_colabs__Pmap_Cookbook.py": (10, 4, {"MK015"}),
    "jax__docs__jax-101__06-parallelism.py": (6, 0, {"MK001", "MK015", "MK016"}),
    "jax__examples__differentially_private_sgd.py": (0, 0, set()),
    "jax__examples__spmd_mnist_classifier_fromscratch.py": (1, 0, {"MK015"}),
    "jax_md__jax_md__partition.py": (0, 0, {"MK020", "MK021"}),
    "jax_md__jax_md__simulate.py": (0, 0, {"MK020"}),
    "jaxline__jaxline__experiment.py": (1, 0, {"MK015"}),
    "jaxline__jaxline__train.py": (0, 1, {"MK001"}),
    "jaxline__jaxline__utils.py": (0, 1, {"MK001"}),
    "mesh_transformer_jax__device_train.py": (0, 0, set()),
    "mesh_transformer_jax__mesh_transformer__train_actor.py": (0, 0, set()),
    "mesh_transformer_jax__mesh_transformer__transformer_shard.py": (0, 0, {"MK001", "MK016", "MK017"}),
    "mesh_transformer_jax__mesh_transformer__util.py": (0, 0, {"MK001", "MK016"}),
    "objax__objax__module.py": (0, 1, {"MK001"}),
    "objax__objax__util__util.py": (1, 0, {"MK015"}),
    "optax__optax___src__transform.py": (0, 0, {"MK001", "MK016"}),
    "scenic__scenic__dataset_lib__dataset_utils.py": (0, 0, {"MK001"}),
    "scenic__scenic__train_lib__classification_trainer.py": (0, 2, {"MK001"}),
    "scenic__scenic__train_lib__train_utils.py": (0, 2, {"MK001", "MK016"}),
    "t5x__t5x__multihost_utils.py": (0, 1, {"MK001"}),
    "t5x__t5x__partitioning.py": (0, 0, {"MK001"}),
    "trax__trax__fastmath__jax.py": (0, 1, set()),
    "trax__trax__layers__acceleration.py": (0, 0, set()),
    "trax__trax__optimizers__trainer.py": (0, 0, set()),
    "vision_transformer__vit_jax__inference_time.py": (1, 0, {"MK015"}),
    "vision_transformer__vit_jax__train.py": (2, 0, {"MK001", "MK015"}),
    "vision_transformer__vit_jax__utils.py": (0, 0, {"MK001", "MK016"}),
}


# Per file, the rewritten pmaps written inline (jax.jit(jax.shard_map(...)) over a mesh), not with the
# helper: those whose body is elementwise and whose calls state the mapped length (the Pmap Cookbook's
# x ** 2, jnp.add and normalize examples; its matmul, mean, random and halo-exchange bodies keep the
# helper). tests/test_migrate_inline.py runs those examples (tests/fixtures/migrate/inline/pmap_cookbook.py).
INLINE = {"jax__cloud_tpu_colabs__Pmap_Cookbook.py": 5}


def outcomes(path: Path) -> set[str]:
    """What fixing the file exercises: the rules fixed, pmaps rewritten (inline or not), left with a
    recipe, multi-host."""
    rewritten, left, rules = EXPECTED[path.name]
    flags = {
        "rewritten": rewritten,
        "inline": INLINE.get(path.name, 0),
        "left": left,
        "multihost": any(m in path.read_text() for m in MULTIHOST),
    }
    return (set(rules) | {k for k, v in flags.items() if v}) or {"none"}


def core_files(paths: list[Path]) -> set[str]:
    """The fewest files (greedily) that between them exercise every outcome any file does."""
    todo, core = set().union(*map(outcomes, paths)), set()
    while todo:
        best = max(paths, key=lambda p: (len(outcomes(p) & todo), -len(p.name), p.name))
        todo -= outcomes(best)
        core.add(best.stem)
    return core


def tiered_paths(paths: list[Path], core: set[str]) -> list:
    return [pytest.param(p, id=p.stem, marks=() if p.stem in core else pytest.mark.sweep) for p in paths]


# Tiers: the legacy files that between them exercise every rule and outcome (core_files) and the first
# two snippets of each corpus are core; the corpus's other files (further inputs to the same rules) sweep.
CORE_LEGACY = core_files(LEGACY)


def comments(text: str) -> Counter:
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return Counter(t.string for t in tokens if t.type == tokenize.COMMENT)


def test_corpus_is_large_enough_and_every_file_has_a_source():
    sources = (CORPUS / "legacy" / "SOURCES").read_text().splitlines()
    rows = [line.split() for line in sources if line and not line.startswith("#")]
    assert {r[0] for r in rows} == {p.name for p in LEGACY}
    assert all(len(r[2]) == 40 for r in rows)  # a full commit hash
    assert len(LEGACY) >= 48 and len({r[1] for r in rows}) >= 15


@pytest.mark.slow
@pytest.mark.parametrize("path", tiered_paths(LEGACY, CORE_LEGACY))
def test_fix_on_a_real_legacy_file(path: Path):
    result = migrate_file(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)  # old files' invalid escapes, as in the originals
        compile(result.fixed, str(path), "exec")
    assert result.stable, "--fix is not idempotent: a second fix changes the file again"
    assert comments(result.fixed) == comments(result.source)
    assert all(not f.fixable and f.fix.startswith("by hand: ") for f in result.remaining)
    # Nothing left with a recipe was rewritten anyway (MK012 is about a pmap that may be rewritten).
    recipes = Counter((f.rule, f.message) for f in result.findings if not f.fixable and f.rule != "MK012")
    assert Counter((f.rule, f.message) for f in result.remaining if f.rule != "MK012") == recipes
    pmaps = [f for f in result.findings if f.rule == "MK015"]
    rewritten = sum(f.fixable for f in pmaps)
    inline = sum(f.fixable and f.fix.startswith("written inline") for f in pmaps)
    assert (f"def {HELPER}(" in result.fixed) == (rewritten > inline)
    assert inline == INLINE.get(path.name, 0)
    code_lines = [line.split("#")[0] for line in result.source.splitlines()]
    if any(m in line for line in code_lines for m in MULTIHOST):
        assert rewritten == 0 and all("multi-host" in f.message for f in pmaps)
    fixed_rules = {f.rule for f in result.findings if f.fixable}
    assert (rewritten, len(pmaps) - rewritten, fixed_rules - {"MK002"}) == EXPECTED[path.name]


def outputs(text: str, name: str) -> dict:
    ns: dict = {"__name__": "snippet"}
    with warnings.catch_warnings():
        # A donated buffer no output can reuse (multinerf donates its batch): XLA says so, pmap too.
        warnings.filterwarnings("ignore", "Some donated buffers were not usable", UserWarning)
        exec(compile(text, name, "exec"), ns)
    return {k: v for k, v in ns.items() if k.startswith("out")}


def fixed_gives_the_same_outputs(path: Path, bitwise: bool = False) -> None:
    """``--fix`` on the snippet at ``path`` rewrites every pmap, and the outputs before and after agree."""
    before = path.read_text()
    after = fix_source(before)
    assert f"def {HELPER}(" in after and not [f for f in lint_source(after) if f.rule == "MK015"]
    old, new = outputs(before, path.name), outputs(after, path.name)
    # Classes a snippet defines are new objects in each run: compare the trees' printed structure.
    assert old and str(jax.tree.structure(old)) == str(jax.tree.structure(new))
    for x, y in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True):
        assert np.shape(x) == np.shape(y)
        if bitwise:
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
        else:
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("path", tiered_paths(SNIPPETS, {p.stem for p in SNIPPETS[:2]}))
def test_distilled_snippet_gives_the_same_outputs_after_fix(path: Path):
    fixed_gives_the_same_outputs(path)


def differential_rows() -> list[list[str]]:
    lines = (DIFFERENTIAL / "SOURCES").read_text().splitlines()
    return [line.split() for line in lines if line.strip() and not line.startswith("#")]


def test_differential_corpus_is_new_and_every_rewritten_pmap_has_its_snippet():
    rows = differential_rows()
    assert all(len(r) == 7 and len(r[1]) == 40 and "2020-01-01" <= r[2] < "2024-01-01" for r in rows)
    assert len(rows) >= 40 and len({r[0] for r in rows}) >= 12
    legacy = [line.split() for line in (CORPUS / "legacy" / "SOURCES").read_text().splitlines()]
    assert not {(r[1], r[3]) for r in legacy if r and not r[0].startswith("#")} & {(r[0], r[3]) for r in rows}
    with_snippet = {r[6]: r for r in rows if r[6] != "-"}
    assert all((r[4] == "-") == (r[6] == "-") for r in rows)  # a snippet exactly where pmaps are rewritten
    assert set(with_snippet) == {p.name for p in DIFF_SNIPPETS}
    for name, (repository, _, _, path, rewritten, _, _) in with_snippet.items():
        text = (DIFFERENTIAL / name).read_text()
        lines = rewritten.split(",")
        where = f"{repository} {path} (see SOURCES), line{'s' if len(lines) > 1 else ''} {', '.join(lines)}."
        assert where in text.splitlines()[0], name
        pmaps = [f for f in lint_source(text) if f.rule == "MK015"]
        assert len(pmaps) == len(lines) and all(f.fixable for f in pmaps), name


@pytest.mark.slow
@pytest.mark.parametrize("path", tiered_paths(DIFF_SNIPPETS, {p.stem for p in DIFF_SNIPPETS[:2]}))
def test_rewritten_pmaps_of_the_differential_corpus_give_pmaps_outputs_bitwise(path: Path):
    fixed_gives_the_same_outputs(path, bitwise=True)
