"""The structure the code keeps: layers that import downwards, no package reaching into another's
private modules, and every set of allowed values declared once (in ``meshkit.spec``).

Read from the sources' own imports (every ``import``, also inside functions), so that a change that
breaks the structure fails here, not in a review.
"""

import ast
from pathlib import Path

import pytest

from meshkit import spec

SRC = Path(__file__).resolve().parent.parent / "src" / "meshkit"

#: The layers, lowest first: a module imports from its own layer or below. (``cli`` is the top.)
LAYERS = [
    {"_errors", "fmt", "_heartbeat", "migrate"},
    {"devices", "mesh", "spec", "distributed", "compile_cache"},
    {"analysis", "launch"},
    {"plans"},
    {"models", "adapters", "interop"},
    {"planner"},
    {"data"},
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


def _imports(path: Path):
    """(module imported, names taken) for every import statement in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "meshkit":  # from meshkit import plans
            for a in node.names:
                sub = SRC / a.name
                yield (
                    (f"meshkit.{a.name}" if sub.is_dir() or sub.with_suffix(".py").exists() else "meshkit"),
                    [],
                )
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshkit"):
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("meshkit"):
                    yield a.name, []


def _edges():
    for name, path in _modules():
        for target, names in _imports(path):
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
            if not m.endswith("__init__") and m != n.rsplit(".", 1)[0]:
                visit(m)
        stack.pop()

    for n in sorted(graph):
        visit(n)
    # a package's __init__ re-exporting its modules is no cycle of files
    real = [c for c in cycles if not any(_is_package(x) for x in c)]
    assert not real, real


def _is_package(module: str) -> bool:
    return (SRC.parent / Path(*module.split(".")) / "__init__.py").is_file()


def test_no_package_imports_another_packages_private_names():
    bad = []
    for src, dst, names in _edges():
        if _unit(src) == _unit(dst):
            continue
        private_module = any(part.startswith("_") for part in dst.split(".")[2:])
        private_names = [n for n in names if n.startswith("_")]
        if dst == "meshkit._errors":  # the root's error types, which every package raises
            continue
        if private_module or private_names:
            bad.append((src, dst, private_names))
    assert not bad, bad


def _literals(path: Path):
    """String tuples/lists/sets/dict keys written in the file (the shape of a declaration)."""
    for node in ast.walk(ast.parse(path.read_text())):
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
        if name in ("meshkit.spec", "meshkit.plans._remat"):
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
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.startswith("jax._src.clusters") for n in names):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found
