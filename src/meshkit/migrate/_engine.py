"""One pass over a module: run the rules on every node, record findings, apply the safe rewrites."""

from __future__ import annotations

import ast
import warnings
from collections import Counter
from collections.abc import Iterable

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor
from libcst.metadata import (
    MetadataWrapper,
    PositionProvider,
    QualifiedNameProvider,
    ScopeProvider,
)

from meshkit.migrate._context import Context, code
from meshkit.migrate._model import PARSE_ERROR, REGISTRY, Finding, Import, Rule
from meshkit.migrate._scan import build_context


def _comments(node: cst.CSTNode | cst.FlattenSentinel) -> list[str]:
    """The comments in ``node``, in source order."""
    if isinstance(node, cst.FlattenSentinel):
        return [c for n in node.nodes for c in _comments(n)]
    found: list[str] = []

    class _Collect(cst.CSTVisitor):
        def visit_Comment(self, comment: cst.Comment) -> None:
            found.append(comment.value)

    node.visit(_Collect())
    return found


def _lost(before: cst.CSTNode, after: cst.CSTNode | cst.FlattenSentinel) -> list[str]:
    """Comments of ``before`` that ``after`` no longer has, in source order."""
    kept = Counter(_comments(after))
    lost = []
    for c in _comments(before):
        if kept[c]:
            kept[c] -= 1
        else:
            lost.append(c)
    return lost


_NONE = object()


class _Migrator(cst.CSTTransformer):
    """Runs ``rules`` on every node; with ``fix``, replaces nodes and keeps every comment."""

    # Qualified names are not a dependency: libcst's QualifiedNameProvider is one more visit of every
    # node (a seventh of a run) to store, for each, a lazy ``scope.get_qualified_names_for(node)``;
    # ``_metadata`` computes the same for the nodes a rule asks about.
    METADATA_DEPENDENCIES = (PositionProvider, ScopeProvider)

    def __init__(self, path: str, rules: Iterable[Rule], fix: bool) -> None:
        super().__init__()
        self.path, self.fix = path, fix
        self.by_type: dict[type, list[Rule]] = {}
        for r in rules:
            for t in r.nodes:
                self.by_type.setdefault(t, []).append(r)
        self.findings: list[Finding] = []
        self.imports: set[Import] = set()
        self.unused: set[tuple[str, str]] = set()
        self.helpers: dict[str, None] = {}
        self.orphans: list[str] = []
        # Statements to put before an original statement (by id): (source, blank lines kept after).
        self.before: dict[int, list[tuple[str, int]]] = {}
        self.ctx: Context | None = None
        self.in_import = 0
        # Where non-fallback rules reported, as (start, end) positions, and the fallback findings.
        self.spans: list[tuple[tuple[int, int], tuple[int, int]]] = []
        self.fallbacks: list[tuple[tuple[int, int], Finding]] = []

    def visit_Module(self, node: cst.Module) -> bool:
        self.ctx = build_context(node, self._metadata)
        return True

    def _metadata(self, key: type, node: cst.CSTNode, default: object = _NONE) -> object:
        """``get_metadata``, where ``QualifiedNameProvider`` gives what libcst's provider would: the
        names from the node's scope, an empty set for a node of the module without one, ``default``
        (else KeyError) for a node not in the module."""
        if key is not QualifiedNameProvider:
            return self.get_metadata(key, node) if default is _NONE else self.get_metadata(key, node, default)
        scope = self.get_metadata(ScopeProvider, node, None)
        if scope is not None:
            return scope.get_qualified_names_for(node)
        if node in self.metadata[PositionProvider]:
            return set()
        if default is _NONE:
            raise KeyError(node)
        return default

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.in_import += isinstance(node, cst.Import | cst.ImportFrom)
        return super().on_visit(node)

    def report(self) -> list[Finding]:
        """The findings, fallback ones only where no other rule reported a node containing them."""
        kept = [f for at, f in self.fallbacks if not any(s <= at <= e for s, e in self.spans)]
        return sorted([*self.findings, *kept], key=lambda f: (f.line, f.col, f.rule))

    def on_leave(self, original: cst.CSTNode, updated: cst.CSTNode) -> cst.CSTNode:
        is_import = isinstance(original, cst.Import | cst.ImportFrom)
        self.in_import -= is_import
        if self.in_import and not is_import:
            return updated  # names inside an import statement are the import rules' business
        for r in self.by_type.get(type(original), ()):
            hit = r.check(original, self.ctx)
            if hit is None:
                continue
            where = self.get_metadata(PositionProvider, original)
            start = where.start
            fix = hit.fix if hit.rewrite else f"by hand: {hit.fix}"
            found = Finding(
                path=self.path,
                line=start.line,
                col=start.column + 1,
                rule=r.id,
                message=hit.message,
                fix=fix,
                fixable=hit.rewrite is not None,
            )
            span = ((start.line, start.column), (where.end.line, where.end.column))
            if r.fallback:
                self.fallbacks.append((span[0], found))
                continue
            self.spans.append(span)
            self.findings.append(found)
            if self.fix and hit.rewrite is not None:
                new = hit.rewrite(updated)
                self.orphans.extend(_lost(updated, new))
                updated = new
                self.imports.update(hit.imports)
                self.unused.update(hit.unused)
                self.helpers.update(dict.fromkeys(hit.helpers))
                for stmt, text, gap in hit.before:
                    self.before.setdefault(id(stmt), []).append((text, gap))
        updated = self._adopt_orphans(original, updated)
        return self._insert_before(original, updated)

    def _insert_before(self, original: cst.CSTNode, node: cst.CSTNode) -> cst.CSTNode:
        """``node`` preceded by the statements rewrites inside it need (a mesh), which take its leading lines."""
        pending = self.before.pop(id(original), None)
        if not pending or not isinstance(node, cst.SimpleStatementLine | cst.BaseCompoundStatement):
            return node
        stmts = [cst.parse_statement(text) for text, _ in pending]
        stmts[0] = stmts[0].with_changes(leading_lines=node.leading_lines)
        gap = max(g for _, g in pending)
        return cst.FlattenSentinel([*stmts, node.with_changes(leading_lines=[cst.EmptyLine()] * gap)])

    def _adopt_orphans(self, original: cst.CSTNode, node: cst.CSTNode) -> cst.CSTNode:
        """Put comments a rewrite dropped above the statement that held them, in their source order."""
        if not self.orphans:
            return node
        order = _comments(original)
        ordered = sorted(self.orphans, key=lambda c: order.index(c) if c in order else len(order))
        lines = [cst.EmptyLine(comment=cst.Comment(c)) for c in ordered]
        if isinstance(node, cst.SimpleStatementLine | cst.BaseCompoundStatement):
            self.orphans = []
            return node.with_changes(leading_lines=[*node.leading_lines, *lines])
        if isinstance(node, cst.Module):
            self.orphans = []
            return node.with_changes(header=[*node.header, *lines])
        return node


def _is_import(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, cst.Import | cst.ImportFrom) for s in stmt.body
    )


def _add_helpers(tree: cst.Module, helpers: Iterable[str], existing: set[str]) -> cst.Module:
    """``tree`` with each helper not yet defined placed after the module's leading imports."""
    body = list(tree.body)
    at = 0
    for i, stmt in enumerate(body):
        docstring = (
            i == 0 and isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Expr)
        )
        if _is_import(stmt) or docstring:
            at = i + 1
        else:
            break
    new = [
        s
        for h in helpers
        for s in cst.parse_module(h).body
        if getattr(s, "name", None) is None or s.name.value not in existing
    ]
    if not new:
        return tree
    new[0] = new[0].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
    if at < len(body):
        body[at] = body[at].with_changes(
            leading_lines=[cst.EmptyLine(), cst.EmptyLine(), *body[at].leading_lines]
        )
    return tree.with_changes(body=[*body[:at], *new, *body[at:]])


def _bound_imports(tree: cst.Module) -> set[tuple[str, str | None, str | None]]:
    """The top-level imports already present, in AddImportsVisitor's terms."""
    found = set()
    for stmt in tree.body:
        if not _is_import(stmt):
            continue
        for small in stmt.body:
            if isinstance(small, cst.Import):
                found.update(
                    (code(a.name), None, a.asname.name.value if a.asname else None) for a in small.names
                )
            elif (
                small.module is not None
                and not small.relative
                and not isinstance(small.names, cst.ImportStar)
            ):
                found.update(
                    (code(small.module), code(a.name), a.asname.name.value if a.asname else None)
                    for a in small.names
                )
    return found


def _fix_imports(tree: cst.Module, migrator: _Migrator) -> cst.Module:
    """Add the imports fixes need and drop those they left unused (libcst's codemods, run only when needed)."""
    tree = _add_helpers(tree, migrator.helpers, {n for n in migrator.ctx.module_names if n})
    bound = _bound_imports(tree)
    needed = migrator.imports - bound
    unused = {b for b in bound if b[:2] in migrator.unused}
    if not (needed or unused):
        return tree
    context = CodemodContext()
    for module, obj, asname in sorted(needed, key=str):
        AddImportsVisitor.add_needed_import(context, module, obj, asname)
    for module, obj, asname in sorted(unused, key=str):
        RemoveImportsVisitor.remove_unused_import(context, module, obj, asname)
    if needed:
        tree = AddImportsVisitor(context).transform_module(tree)
    return RemoveImportsVisitor(context).transform_module(tree) if unused else tree


# The deepest nesting handed to libcst: its native parser can overflow the C stack (a segfault) or
# take minutes on deeper input, and its visitors recurse in Python. Real code stays far below.
MAX_DEPTH = 200
_DEEP = "file too deeply nested for the parser"


def _depth(tree: ast.AST) -> tuple[int, int]:
    """How deeply ``tree`` nests as libcst sees it (``a and b and c`` nests there, not in ``ast``),
    and the line where it is deepest; without recursing."""
    deepest, line, stack = 0, 1, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, ast.BoolOp):
            depth += len(node.values) - 1
        elif isinstance(node, ast.alias | ast.ImportFrom):
            depth += (getattr(node, "name", None) or getattr(node, "module", None) or "").count(".")
        if depth > deepest:
            deepest, line = depth, getattr(node, "lineno", line)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return deepest, line


def _unparsable(text: str, path: str) -> tuple[int, int, str] | None:
    """Why the file cannot be handed to libcst, as (line, 0-based column, message); None when it can.

    Python's own parser goes first: its message is clearer than libcst's, and it refuses input
    nested too deeply for itself (2,000 parentheses) with an error, where libcst would crash.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes and the like: the file's business, not ours
            tree = compile(text, path, "exec", flags=ast.PyCF_ONLY_AST)
    except SyntaxError as e:
        return e.lineno or 1, max((e.offset or 1) - 1, 0), f"cannot parse: {e.msg}"
    except (RecursionError, MemoryError, ValueError) as e:
        return 1, 0, f"cannot parse: {str(e) or type(e).__name__}"
    depth, line = _depth(tree)
    if depth > MAX_DEPTH:
        return line, 0, f"{_DEEP} (depth {depth} > {MAX_DEPTH}): left unchanged"
    return None


def _parse_error(path: str, line: int, col: int, message: str) -> Finding:
    fix = "make the file valid Python, then run migrate again"
    if message.startswith(_DEEP):
        fix = f"split the deepest expression (nesting depth at most {MAX_DEPTH}), then run migrate again"
    return Finding(
        path=path,
        line=line,
        col=col + 1,
        rule=PARSE_ERROR.id,
        message=(message.strip().splitlines() or ["cannot parse: syntax error"])[0],
        fix=f"by hand: {fix}",
        fixable=False,
    )


def run(
    text: str, path: str = "<string>", *, fix: bool = False, select: Iterable[str] | None = None
) -> tuple[list[Finding], str]:
    """Findings in ``text`` and, with ``fix``, the text with every safe fix applied.

    A file that does not parse, or nests too deeply to parse safely, gives one MK000 finding and
    comes back unchanged.
    """
    rules = [REGISTRY[i] for i in sorted(REGISTRY) if select is None or i in set(select)]
    refused = _unparsable(text, path)
    if refused is not None:
        return [_parse_error(path, *refused)], text
    try:
        # The tree is parsed here and used by nothing else: no defensive deep copy (7% of a run).
        wrapper = MetadataWrapper(cst.parse_module(text), unsafe_skip_copy=True)
        migrator = _Migrator(path, rules, fix)
        tree = wrapper.visit(migrator)
        if fix:
            tree = _fix_imports(tree, migrator)
    except cst.ParserSyntaxError as e:  # Python reads the file, libcst does not: say so, change nothing
        message = f"libcst cannot parse this file (Python can): {e.message}; left unchanged"
        return [_parse_error(path, e.raw_line, e.raw_column, message)], text
    except RecursionError:
        message = f"{_DEEP}: left unchanged"
        return [_parse_error(path, 1, 0, message)], text
    return migrator.report(), tree.code if fix else text
