"""The body check of the inline form: a function is elementwise in its mapped arguments.

pmap's body sees each mapped argument without its mapped axis (the slice ``x[i]``); shard_map's
sees the device's block, which keeps that axis with length 1 (``x[i:i+1]``). Where the body is
elementwise in its mapped arguments, a row of the block gives what the slice gave and the block of
outputs is the slice's output with the axis put back, which is how pmap stacks it. ``Body`` walks
a lambda or a def of the module and proves that, or raises ``NotInline`` with the first thing that
may not hold: arithmetic and comparisons, elementwise ``jax.numpy``/``jax.nn``/``jax.lax``
functions (``ELEMENTWISE``), ``jnp.dot`` and ``@`` with a replicated right side, ``psum``/``pmean``/
``pmax``/``pmin``/``ppermute`` over pmap's axis, dict entries, calls of such defs. A replicated
value may meet a mapped one only where its rank is known and at most the mapped one's (NumPy
broadcasting lines up trailing axes: a longer replicated value would meet the block's extra axis).
Where only the ranks the calls show could settle that, the check raises ``RankUnknown``:
``_inline.plan`` checks the body first without them, then again with them (``Value``).
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from meshkit.migrate._context import Context, code
from meshkit.migrate._inline_exprs import (
    MAX_DEPTH,
    NotInline,
    bound_value,
    dotted_name,
    is_number,
    negative_int,
)


def _qualified(module: str, names: str) -> set[str]:
    return {f"{module}.{n}" for n in names.split()}


ELEMENTWISE = frozenset(
    _qualified(
        "jax.numpy",
        "abs absolute negative positive sign exp exp2 expm1 log log1p log2 log10 sqrt cbrt square "
        "reciprocal sin cos tan arcsin arccos arctan sinh cosh tanh arcsinh arccosh arctanh floor "
        "ceil trunc rint add subtract multiply divide true_divide floor_divide power float_power mod "
        "remainder fmod maximum minimum fmax fmin arctan2 hypot logaddexp logaddexp2 where clip "
        "isnan isinf isfinite logical_and logical_or logical_not logical_xor greater greater_equal "
        "less less_equal equal not_equal conj conjugate real imag deg2rad rad2deg copysign signbit "
        "sinc heaviside",
    )
    | _qualified(
        "jax.nn",
        "relu relu6 sigmoid silu swish softplus soft_sign log_sigmoid elu leaky_relu selu celu gelu "
        "hard_tanh hard_sigmoid hard_silu hard_swish sparse_plus squareplus mish",
    )
    | _qualified(
        "jax.lax",
        "abs exp log log1p expm1 sin cos tan tanh logistic neg sign floor ceil round sqrt rsqrt cbrt "
        "square integer_pow add sub mul div rem pow max min atan2 stop_gradient",
    )
)
_DTYPES = frozenset(
    _qualified(
        "jax.numpy", "float16 bfloat16 float32 float64 int8 int16 int32 int64 uint8 uint32 bool_ complex64"
    )
    | _qualified("numpy", "float16 float32 float64 int8 int16 int32 int64 uint8 uint32 bool_ complex64")
)
_REDUCE = frozenset(f"jax.lax.{n}" for n in ("psum", "pmean", "pmax", "pmin"))
_LAST_AXIS = frozenset({"jax.nn.softmax", "jax.nn.log_softmax"})


class RankUnknown(NotInline):
    """The body is elementwise only if ranks are what the calls may show: checked again with them."""


@dataclass(frozen=True, slots=True)
class Value:
    """What the checker knows of a value in the body: whether it is mapped (pmap's slice, shard_map's
    block of one row), its rank as pmap's body sees it (None: unknown), a literal container's parts."""

    mapped: bool
    rank: int | None = None
    fields: tuple[tuple[str, Value], ...] | None = None
    items: tuple[Value, ...] | None = None

    @property
    def container(self) -> bool:
        return self.fields is not None or self.items is not None


class Body:
    """Checks that a function gives on shard_map's block what pmap's body gave on the slice, with the
    block's axis kept; raises NotInline with the first thing that may not."""

    def __init__(self, ctx: Context, axis: cst.BaseExpression | None) -> None:
        self.ctx = ctx
        self.axis = axis
        self.stack: list[int] = []

    def function(self, fn: cst.FunctionDef | cst.Lambda, args: list[Value]) -> Value:
        if id(fn) in self.stack or len(self.stack) > MAX_DEPTH:
            raise NotInline("the body calls itself")
        params = fn.params
        if (
            isinstance(params.star_arg, cst.Param | cst.ParamStar)
            or params.kwonly_params
            or params.star_kwarg
        ):
            raise NotInline("the mapped function takes *args, keyword-only or **kwargs parameters")
        names = [p.name.value for p in (*params.posonly_params, *params.params)]
        if len(names) != len(args):
            raise NotInline(f"the function takes {len(names)} arguments where {len(args)} are passed")
        env = dict(zip(names, args, strict=True))
        self.stack.append(id(fn))
        try:
            if isinstance(fn, cst.Lambda):
                return self.expr(fn.body, env)
            return self._statements(fn, env)
        finally:
            self.stack.pop()

    def _statements(self, fn: cst.FunctionDef, env: dict[str, Value]) -> Value:
        body = fn.body.body if isinstance(fn.body, cst.IndentedBlock) else [fn.body]
        small: list[cst.BaseSmallStatement] = []
        for stmt in body:
            if not isinstance(stmt, cst.SimpleStatementLine | cst.SimpleStatementSuite):
                raise NotInline(f"{fn.name.value} has a {type(stmt).__name__.lower()} statement")
            small.extend(stmt.body)
        for i, s in enumerate(small):
            if isinstance(s, cst.Expr) and isinstance(s.value, cst.SimpleString | cst.ConcatenatedString):
                continue
            if isinstance(s, cst.Return):
                if i != len(small) - 1 or s.value is None:
                    raise NotInline(f"{fn.name.value} returns early or returns nothing")
                return self.expr(s.value, env)
            if isinstance(s, cst.Assign) and len(s.targets) == 1:
                self._bind(s.targets[0].target, self.expr(s.value, env), env)
            elif isinstance(s, cst.AnnAssign) and s.value is not None:
                self._bind(s.target, self.expr(s.value, env), env)
            elif isinstance(s, cst.AugAssign) and isinstance(s.target, cst.Name):
                value = self.combine(self.expr(s.target, env), self.expr(s.value, env), s)
                self._bind(s.target, value, env)
            else:
                raise NotInline(f"{fn.name.value} has the statement `{code(s).strip()}`")
        raise NotInline(f"{fn.name.value} does not end in a return")

    def _bind(self, target: cst.BaseExpression, value: Value, env: dict[str, Value]) -> None:
        if isinstance(target, cst.Name):
            env[target.value] = value
            return
        items = value.items
        if (
            isinstance(target, cst.Tuple | cst.List)
            and items is not None
            and len(target.elements) == len(items)
        ):
            for e, v in zip(target.elements, items, strict=True):
                self._bind(e.value, v, env)
            return
        raise NotInline(f"`{code(target)} = ...` unpacks what the checker cannot follow")

    def expr(self, node: cst.BaseExpression, env: dict[str, Value]) -> Value:
        if isinstance(node, cst.Integer | cst.Float | cst.Imaginary):
            return Value(False, 0)
        if isinstance(node, cst.Name):
            return self._name(node, env)
        if isinstance(node, cst.UnaryOperation) and not isinstance(node.operator, cst.Not):
            return _array(self.expr(node.expression, env), node)
        if isinstance(node, cst.BinaryOperation):
            left, right = self.expr(node.left, env), self.expr(node.right, env)
            if isinstance(node.operator, cst.MatrixMultiply):
                return self._matmul(left, right, node)
            return self.combine(left, right, node)
        if isinstance(node, cst.Comparison) and len(node.comparisons) == 1:
            compare = (
                cst.LessThan,
                cst.LessThanEqual,
                cst.GreaterThan,
                cst.GreaterThanEqual,
                cst.Equal,
                cst.NotEqual,
            )
            if isinstance(node.comparisons[0].operator, compare):
                other = self.expr(node.comparisons[0].comparator, env)
                return self.combine(self.expr(node.left, env), other, node)
        if isinstance(node, cst.Tuple | cst.List):
            if any(isinstance(e, cst.StarredElement) for e in node.elements):
                raise NotInline(f"`{code(node)}` unpacks with *")
            items = tuple(self.expr(e.value, env) for e in node.elements)
            return Value(bool(items) and all(v.mapped for v in items), items=items)
        if isinstance(node, cst.Dict):
            fields = []
            for e in node.elements:
                if not isinstance(e, cst.DictElement) or not isinstance(e.key, cst.SimpleString):
                    raise NotInline(f"`{code(node)}` is a dict the checker cannot follow")
                fields.append((str(e.key.evaluated_value), self.expr(e.value, env)))
            return Value(bool(fields) and all(v.mapped for _, v in fields), fields=tuple(fields))
        if isinstance(node, cst.Subscript):
            return self._subscript(node, env)
        if isinstance(node, cst.Call):
            return self._call(node, env)
        if isinstance(node, cst.Attribute):
            raise NotInline(
                f"`{code(node)}` reads an attribute, which may be the array's shape or layout "
                "(pmap's body saw the slice, shard_map's sees the block)"
            )
        raise NotInline(f"`{code(node)}`: the checker knows only elementwise array code")

    def _name(self, node: cst.Name, env: dict[str, Value]) -> Value:
        if node.value in env:
            return env[node.value]
        if node.value in ("True", "False"):
            return Value(False, 0)
        value = bound_value(self.ctx, node)
        if value is not None and is_number(value):
            return Value(False, 0)
        return Value(False, None)  # a value from outside: the same on every device, of unknown rank

    def combine(self, a: Value, b: Value, node: cst.CSTNode) -> Value:
        """An elementwise operation of two values, with NumPy broadcasting."""
        a, b = _array(a, node), _array(b, node)
        rank = None if a.rank is None or b.rank is None else max(a.rank, b.rank)
        if a.mapped == b.mapped:
            return Value(a.mapped, rank)
        mapped, other = (a, b) if a.mapped else (b, a)
        if other.rank == 0 or (
            other.rank is not None and mapped.rank is not None and other.rank <= mapped.rank
        ):
            return Value(True, rank)
        raise RankUnknown(
            f"`{code(node).strip()}` broadcasts a replicated value whose rank is not known to be at most "
            "the mapped one's, so it may line up against the block's extra axis"
        )

    @staticmethod
    def _matmul(a: Value, b: Value, node: cst.CSTNode) -> Value:
        a, b = _array(a, node), _array(b, node)
        if not a.mapped and not b.mapped:
            return Value(False, None)
        if a.mapped and not b.mapped and a.rank is not None and a.rank >= 1 and b.rank in (1, 2):
            return Value(True, a.rank if b.rank == 2 else a.rank - 1)
        raise (RankUnknown if a.mapped and not b.mapped else NotInline)(
            f"`{code(node).strip()}`: a matrix product is written inline only as mapped @ replicated with "
            "their ranks known (the block's extra axis would otherwise enter the product)"
        )

    @staticmethod
    def _dot(a: Value, b: Value, node: cst.CSTNode) -> Value:
        a, b = _array(a, node), _array(b, node)
        if not a.mapped and not b.mapped:
            return Value(False, None)
        if a.mapped and not b.mapped and a.rank is not None and a.rank >= 1:
            rank = None if b.rank is None else (a.rank if b.rank == 0 else a.rank - 1 + max(b.rank - 1, 0))
            return Value(True, rank)
        raise (RankUnknown if a.mapped and not b.mapped else NotInline)(
            f"`{code(node).strip()}`: jnp.dot is written inline only as dot(mapped, replicated) with the "
            "mapped rank known to be at least 1"
        )

    def _subscript(self, node: cst.Subscript, env: dict[str, Value]) -> Value:
        value = self.expr(node.value, env)
        index = node.slice[0].slice if len(node.slice) == 1 else None
        key = index.value if isinstance(index, cst.Index) else None
        if isinstance(key, cst.SimpleString) and value.items is None:  # no array is indexed by a string
            if value.fields is None:
                return Value(value.mapped, None)
            found = dict(value.fields).get(str(key.evaluated_value))
            if found is not None:
                return found
        if (
            isinstance(key, cst.Integer)
            and value.items is not None
            and int(key.evaluated_value) < len(value.items)
        ):
            return value.items[int(key.evaluated_value)]
        raise NotInline(
            f"`{code(node)}` indexes: pmap's body indexed the slice, shard_map's would index the block"
        )

    def _axis_matches(self, node: cst.BaseExpression) -> bool:
        if self.axis is None:
            return False
        if isinstance(node, cst.SimpleString) and isinstance(self.axis, cst.SimpleString):
            return node.evaluated_value == self.axis.evaluated_value
        return code(node) == code(self.axis)

    def _call(self, node: cst.Call, env: dict[str, Value]) -> Value:
        if any(a.star for a in node.args):
            raise NotInline(f"`{code(node)}` passes arguments with * or **")
        positional = [a.value for a in node.args if a.keyword is None]
        keywords = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
        name = dotted_name(self.ctx, node.func)
        method = node.func.attr.value if isinstance(node.func, cst.Attribute) else None
        if method == "astype" and not name.startswith("jax."):
            self._static(node.args, env, node)
            return _array(self.expr(node.func.value, env), node)
        if name in ELEMENTWISE:
            if not positional or (name == "jax.numpy.where" and len(positional) != 3):
                raise NotInline(f"`{code(node)}` is not elementwise with these arguments")
            # Keyword arguments are settings (a literal, a dtype) or arrays broadcast like the others.
            arrays = positional + [v for v in keywords.values() if not self._setting(v)]
            result = _array(self.expr(arrays[0], env), node)
            for p in arrays[1:]:
                result = self.combine(result, self.expr(p, env), node)
            return result
        if name in _REDUCE or name == "jax.lax.ppermute":
            return self._collective(node, name, positional, keywords, env)
        if name in ("jax.numpy.dot", "jax.numpy.matmul") and len(positional) == 2 and not keywords:
            a, b = (self.expr(p, env) for p in positional)
            return self._dot(a, b, node) if name.endswith("dot") else self._matmul(a, b, node)
        if name in _LAST_AXIS and len(positional) == 1:
            axis = keywords.pop("axis", None)
            if keywords or (axis is not None and negative_int(axis) != -1):
                raise NotInline(
                    f"`{code(node)}`: only the last axis is the same in pmap's slice and the block"
                )
            value = _array(self.expr(positional[0], env), node)
            if value.mapped and (value.rank is None or value.rank < 1):
                raise RankUnknown(f"`{code(node)}`: the mapped rank must be known to be at least 1")
            return value
        fn = self._local_def(node.func)
        if fn is not None and not keywords:
            return self.function(fn, [self.expr(p, env) for p in positional])
        raise NotInline(
            f"the body calls `{code(node.func)}`, which the checker does not know to be elementwise"
        )

    def _collective(self, node, name, positional, keywords, env) -> Value:
        short = name.rsplit(".", 1)[-1]
        axis = positional[1] if len(positional) > 1 else keywords.pop("axis_name", None)
        most = 2
        if short == "ppermute":
            most = 3
            perm = positional[2] if len(positional) > 2 else keywords.pop("perm", None)
            if perm is None:
                raise NotInline(f"`{code(node)}` has no perm")
            self._static([cst.Arg(perm)], env, node)
        if axis is None or not self._axis_matches(axis) or keywords or len(positional) > most:
            raise NotInline(f"`{code(node)}` is not a plain {short} over pmap's axis")
        value = self.expr(positional[0], env)
        if not value.mapped:
            raise NotInline(f"`{code(node)}` reduces a replicated value (pmap counted it once per device)")
        return value

    def _setting(self, node: cst.BaseExpression) -> bool:
        """A literal (``False``, ``2``, ``"tanh"``) or a dtype (``jnp.float32``): not an array."""
        if is_number(node) or isinstance(node, cst.SimpleString):
            return True
        if isinstance(node, cst.Name) and node.value in ("True", "False", "None"):
            return True
        return dotted_name(self.ctx, node) in _DTYPES

    def _static(self, args, env: dict[str, Value], node: cst.CSTNode) -> None:
        """Arguments that are settings, not arrays (a dtype, a permutation): they must not read mapped values."""
        mapped = {k for k, v in env.items() if v.mapped or v.container}
        reads: list[str] = []

        class _Reads(cst.CSTVisitor):
            def visit_Name(self, n: cst.Name) -> None:
                if n.value in mapped:
                    reads.append(n.value)

        for a in args:
            a.value.visit(_Reads())
        if reads:
            raise NotInline(f"`{code(node)}` passes a mapped value where it takes a setting")

    def _local_def(self, func: cst.BaseExpression) -> cst.FunctionDef | None:
        if not isinstance(func, cst.Name):
            return None
        target = self.ctx.binding(func)
        found = None if target is None else self.ctx.def_nodes.get(target)
        return found if found is not None and not found.decorators else None


def _array(value: Value, node: cst.CSTNode) -> Value:
    if value.container:
        raise NotInline(f"`{code(node).strip()}` computes on a tuple, list or dict")
    return value
