"""The structure the code keeps: layers that import downwards, no package reaching into another's
private modules, and every set of allowed values declared once (in ``meshkit.spec``).

Read from the sources' own imports (every ``import``, also inside functions), so that a change that
breaks the structure fails here, not in a review.
"""

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

from meshkit import spec

SRC = Path(__file__).resolve().parent.parent / "src" / "meshkit"


@functools.cache
def _parse(text: str) -> ast.Module:
    """A source's syntax tree, parsed once per text: the checks only read it, and the mutation tests run
    each check twice on a copy of the sources that differs from them in one file."""
    return ast.parse(text)


@pytest.fixture(scope="module", autouse=True)
def _forget_the_trees():
    """The trees (some 100 MB) are let go with this file: the worker runs other files after it."""
    yield
    _parse.cache_clear()


#: The layers, lowest first: a module imports from its own layer or below. (``cli`` is the top.)
LAYERS = [
    {"_errors", "fmt", "files", "migrate", "user_code"},
    {"devices", "mesh", "spec", "distributed", "compile_cache", "targets"},
    {"analysis", "launch"},
    {"plans"},
    {"models", "adapters", "interop"},
    {"planner"},
    {"data", "rewards"},
    {"train"},
    {"verify", "examples", "selftest"},
    {"cli", "__init__"},
]
#: Imports that run up a layer, each with why (at most two).
UPWARD: dict[tuple[str, str], str] = {}


def _unit(module: str) -> str:
    """The top-level unit of a module path ``meshkit.a.b``: ``a`` (a package or a root module)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(unit: str) -> int:
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"{unit} is in no layer of LAYERS: add it")


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        yield name, path


def _module_names() -> set[str]:
    return {n for n, _ in _modules()}


def _absolute(node: ast.ImportFrom, path: Path) -> str | None:
    """The module an ``from X import ...`` names, relative imports (``from .x``, ``from .. import``)
    resolved against the file's own package."""
    if not node.level:
        return node.module
    rel = path.relative_to(SRC.parent).with_suffix("")
    package = list(rel.parts[:-1])  # a module's package; a package's __init__ is its own package
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports(path: Path, names: set[str]):
    """(module imported, names taken) for every import in the file: ``import`` statements (also
    relative ones and those inside functions) and ``importlib.import_module`` of a module named by a
    string, and every string that names a meshkit module whole in a file that imports importlib
    (the lazy name maps of ``meshkit/__init__.py`` and ``train/__init__.py``)."""
    tree = _parse(path.read_text())
    lazy = any(
        (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "importlib" for a in n.names))
        or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "importlib")
        for n in ast.walk(tree)
    )
    for node in ast.walk(tree):
        module = _absolute(node, path) if isinstance(node, ast.ImportFrom) else None
        if module == "meshkit" or (module and module in names and _is_package(module)):
            for a in node.names:  # from meshkit import plans / from meshkit.plans import _fsdp
                sub = f"{module}.{a.name}"
                yield (sub, []) if sub in names else (module, [a.name])
        elif module and module.startswith("meshkit"):
            yield module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("meshkit"):
                    yield a.name, []
        elif lazy and isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            yield node.value, []


def _edges():
    modules = _module_names()
    for name, path in _modules():
        for target, names in _imports(path, modules):
            yield name, target, names


def test_every_module_is_in_a_layer_and_imports_go_down():
    up = []
    for src, dst, _ in _edges():
        a, b = _unit(src), _unit(dst)
        if a != b and _layer(b) > _layer(a):
            up.append((a, b, src, dst))
    unexplained = [u for u in up if (u[0], u[1]) not in UPWARD]
    assert not unexplained, unexplained
    assert len({(a, b) for a, b, *_ in up}) <= 2


def test_the_design_page_lists_the_layers():
    """docs/design.md's table of layers names the packages of ``LAYERS``, layer by layer (it had 9 rows
    for 10 layers)."""
    text = (SRC.parent.parent / "docs" / "design.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (.+?) \|", text, flags=re.M)
    documented = {
        int(n): {name.split(".")[-1] for name in re.findall(r"`([\w.]+)`", packages)} for n, packages in rows
    }
    want = {i: {u for u in units if u != "__init__"} for i, units in enumerate(LAYERS)}
    assert documented == want


def test_no_import_cycle_between_files():
    graph: dict[str, set[str]] = {}
    names = {n for n, _ in _modules()}
    for src, dst, taken in _edges():
        # ``from meshkit.plans import x`` where x is a module counts as importing that module
        targets = [f"{dst}.{t}" for t in taken if f"{dst}.{t}" in names] or [dst]
        graph.setdefault(src, set()).update(t for t in targets if t in names and t != src)
    seen, stack, cycles = set(), [], []

    def visit(n):
        if n in stack:
            cycles.append([*stack[stack.index(n) :], n])
            return
        if n in seen:
            return
        seen.add(n)
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            visit(m)
        stack.pop()

    for n in sorted(graph):
        visit(n)
    assert not cycles, cycles


def _is_package(module: str) -> bool:
    return (SRC.parent / Path(*module.split(".")) / "__init__.py").is_file()


def test_no_package_imports_another_packages_private_names():
    bad = []
    for src, dst, names in _edges():
        if _unit(src) == _unit(dst):
            continue
        # a private module of another package, or a private module at the root (``meshkit._x``)
        private_module = any(part.startswith("_") for part in dst.split(".")[1:])
        private_names = [n for n in names if n.startswith("_")]
        if dst == "meshkit._errors":  # the root's error types, which every package raises
            continue
        if private_module or private_names:
            bad.append((src, dst, private_names))
    assert not bad, bad


def _in_spec(module: str) -> bool:
    """Whether a module is the spec package, where the allowed values are declared."""
    return module == "meshkit.spec" or module.startswith("meshkit.spec.")


def _literals(path: Path):
    """String tuples/lists/sets/dict keys written in the file (the shape of a declaration)."""
    for node in ast.walk(_parse(path.read_text())):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        values = {e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        if len(values) >= 2:
            yield node.lineno, values


@pytest.mark.parametrize(
    "allowed",
    [set(spec.REMAT_POLICIES), set(spec.PIPELINE_SCHEDULES), set(spec.ZERO_STAGES), set(spec.PRECISIONS)],
    ids=["remat", "schedules", "zero", "precisions"],
)
def test_allowed_values_are_declared_once(allowed):
    """No collection of two or more of these names is written outside ``meshkit.spec`` (and the
    remat policies' jax meaning, ``plans/_remat.py``, which asserts it has them all)."""
    found = []
    for name, path in _modules():
        if _in_spec(name) or name == "meshkit.plans._remat":
            continue
        for line, values in _literals(path):
            if len(values & allowed) >= 2:
                found.append(f"{path.relative_to(SRC.parent)}:{line}: {sorted(values & allowed)}")
    assert not found, found


def test_no_private_jax_cluster_detection():
    """Schedulers are read from their documented variables and JAX's public ``jax.distributed.initialize
    (cluster_detection_method=...)`` finds the rest: nothing imports ``jax._src.clusters``, whose classes
    are no API and change between releases."""
    found = []
    tests = SRC.parent.parent / "tests"
    for path in [
        *SRC.rglob("*.py"),
        *tests.glob("*.py"),
        *tests.glob("workers/*.py"),
        *tests.glob("mp/*.py"),
    ]:
        for node in ast.walk(_parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.startswith("jax._src.clusters") for n in names):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found


#: The plan names that are also the planner's degree names (``dp=4,tp=2``): a pair of these alone is
#: not a list of plans.
DEGREES = {"dp", "tp", "pp", "cp", "ep"}
ALLOWED = {
    "plans": set(spec.PLANS),
    "zero": set(spec.ZERO_STAGES),
    "remat": set(spec.REMAT_POLICIES),
    "schedules": set(spec.PIPELINE_SCHEDULES),
    "precisions": set(spec.PRECISIONS),
    "attention": set(spec.CONTEXT_ATTENTION),
}


def _texts(tree: ast.AST):
    """(line, text) of every string a user may read (help texts, error lines): the string constants
    and f-string parts that are not docstrings."""
    docs = {
        id(n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value


def _written_lists(path: Path) -> list[str]:
    """Places where a user-facing text writes two or more allowed values of one set as a list
    (``dp, zero1 or zero2``), which goes stale when the set changes: texts format them from spec."""
    found = []
    for line, text in _texts(_parse(path.read_text())):
        for what, names in ALLOWED.items():
            alt = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
            pat = (
                rf"(?<![\w+\-/])({alt})(?![\w+\-])(?:\s*\([^)]*\))?\s*(?:,|/| or | and )\s*({alt})(?![\w+\-])"
            )
            for m in re.finditer(pat, text):
                if what == "plans" and {m[1], m[2]} <= DEGREES:
                    continue
                found.append(f"{path.relative_to(SRC.parent)}:{line}: {what}: {m[0]!r}")
    return found


def test_no_allowed_values_written_in_help_texts_or_errors():
    """Help texts and error lines list plans, ZeRO stages, remat policies, schedules, precisions and
    context attentions from ``meshkit.spec`` (``describe_plans``, ``one_of``, ``plans_of``), never by
    hand (``meshkit train --help`` once omitted fsdp+cp and fsdp+ep, and --deterministic 4 of 8 plans)."""
    found = [f for name, path in _modules() if not _in_spec(name) for f in _written_lists(path)]
    assert not found, found


def test_help_texts_name_every_plan():
    """``meshkit train --help`` and ``meshkit verify --help`` name every plan, and --deterministic
    every plan deterministic mode covers (read from the rendered commands)."""
    import typer.main

    from meshkit.cli import app

    command = typer.main.get_command(app)
    for sub in ("train", "verify"):
        helps = {p.name: p.help or "" for p in command.commands[sub].params}
        listed = set(re.findall(r"[\w+]+", helps["plan"]))
        assert set(spec.PLANS) <= listed, (sub, set(spec.PLANS) - listed)
    det = set(
        re.findall(r"[\w+]+", {p.name: p.help for p in command.commands["train"].params}["deterministic"])
    )
    assert set(spec.DETERMINISTIC_PLANS) <= det


def _names_a_family(node: ast.AST, families: set[str]) -> bool:
    """A string that is a registered family's name or its scanned form (``gpt-scan``: ``meshkit verify``'s
    workloads), or a tuple, list or set holding one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.removesuffix("-scan") in families
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_family(e, families) for e in node.elts)
    return False


def test_no_module_outside_models_compares_a_family_name():
    """Model families are the unit of extension (``meshkit.models.registry``): outside ``meshkit/models/``
    no module compares a value with a family's name (``== "llama"``, ``in ("gpt", "gpt-scan")``, a
    ``case "gpt":``) or dispatches on it by a dict keyed by one; it asks the family's row instead, so
    that a new family touches no module above the models."""
    from meshkit.models import registry

    families = set(registry.names())
    found = []
    for name, path in _modules():
        if name == "meshkit.models" or name.startswith("meshkit.models."):
            continue
        for node in ast.walk(_parse(path.read_text())):
            if isinstance(node, ast.Compare):
                hit = any(_names_a_family(n, families) for n in [node.left, *node.comparators])
            elif isinstance(node, ast.MatchValue):
                hit = _names_a_family(node.value, families)
            elif isinstance(node, ast.Dict):
                hit = any(k is not None and _names_a_family(k, families) for k in node.keys)
            else:
                continue
            if hit:
                found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}")
    assert not found, found


MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def test_no_file_or_function_is_too_long():
    """No source file over ``MAX_FILE_LINES`` lines and no function over ``MAX_FUNCTION_LINES``: a long
    one is split where its parts have names of their own."""
    long = []
    for _, path in _modules():
        text = path.read_text()
        if (n := text.count("\n")) > MAX_FILE_LINES:
            long.append(f"{path.relative_to(SRC.parent)}: {n} lines")
        for node in ast.walk(_parse(text)):
            n = (
                node.end_lineno - node.lineno + 1
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                else 0
            )
            if n > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(SRC.parent)}:{node.lineno} {node.name}: {n} lines")
    assert not long, long


MUTATIONS = {
    # blind spot -> (file to change, text appended, the check that must catch it)
    "relative import up a layer": ("analysis/cost.py", "from ..train import trainer\n", "layers"),
    "importlib import up a layer": (
        "analysis/cost.py",
        "import importlib\n_T = importlib.import_module('meshkit.train.trainer')\n",
        "layers",
    ),
    "cycle through a package __init__": (
        "models/gpt.py",
        "from meshkit.models import num_params\n",
        "cycles",
    ),
    "root-level private module": ("launch/__init__.py", "from meshkit._helper import x\n", "private"),
    "plans written in a help text": ("cli/verify.py", '_H = "plans dp, zero1 or zero2"\n', "texts"),
    "plans written in an error line": (
        "plans/_context.py",
        'def _f():\n    raise ValueError("a mixture of experts: use ep or dp+ep")\n',
        "texts",
    ),
    "schedules written in a help text": ("cli/plan.py", '_H = "gpipe or 1f1b"\n', "texts"),
    "a family's name compared": (
        "train/job.py",
        'def _f(cfg):\n    return cfg.model == "llama"\n',
        "families",
    ),
    "a family's name in a tuple": (
        "verify/__init__.py",
        'def _f(m):\n    return m in ("gpt-scan", "mlp")\n',
        "families",
    ),
    "a dispatch on a family's name": ("interop/hf.py", '_BY = {"gpt": 1, "other": 2}\n', "families"),
    "a file over the limit": ("fmt.py", "_X = 0\n" * 500, "sizes"),
    "a function over the limit": ("fmt.py", "def _f():\n" + "    x = 0\n" * 80, "sizes"),
}
CHECKS = {
    "layers": test_every_module_is_in_a_layer_and_imports_go_down,
    "cycles": test_no_import_cycle_between_files,
    "private": test_no_package_imports_another_packages_private_names,
    "texts": test_no_allowed_values_written_in_help_texts_or_errors,
    "families": test_no_module_outside_models_compares_a_family_name,
    "sizes": test_no_file_or_function_is_too_long,
}


@pytest.mark.parametrize("blind_spot", list(MUTATIONS))
def test_each_check_catches_its_mutation(blind_spot, tmp_path, monkeypatch):
    """Each check, run on a copy of the sources with one violation written in, fails (and passes on
    the copy as it is: the violation, not the copy, is what it catches)."""
    import shutil

    copy = tmp_path / "meshkit"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(sys.modules[__name__], "SRC", copy)
    rel, text, check = MUTATIONS[blind_spot]
    if check == "private":
        (copy / "_helper.py").write_text("x = 1\n")
    CHECKS[check]()
    with (copy / rel).open("a") as f:
        f.write("\n" + text)
    with pytest.raises(AssertionError):
        CHECKS[check]()
