"""MK015's inline form: a pmap written as ``jax.jit(jax.shard_map(f, mesh=..., in_specs=..., out_specs=...))``.

pmap and a direct ``jax.shard_map`` over a 1D mesh run the same SPMD program but show the body
different shapes: pmap's body sees each mapped argument without its mapped axis (a slice, ``x[i]``),
shard_map's sees the device's block, which keeps that axis with length 1 (``x[i:i+1]``). The two
agree exactly when nothing in the body depends on that axis: when the body is elementwise in its
mapped arguments, a row of the block gives what the slice gave, and the block of outputs is the
slice's output with the axis put back, which is how pmap stacks it. The mesh must also be the one
pmap builds at the call: the first ``n`` devices, ``n`` the mapped axis's length, which only the
calls tell.

So a pmap is written inline only where this module shows all of it (``plan``):

- the mapped function is a lambda or a def of this module whose body ``_Body`` proves elementwise
  in its mapped arguments: arithmetic and comparisons, elementwise ``jax.numpy``/``jax.nn``/
  ``jax.lax`` functions, ``jnp.dot`` and ``@`` with a replicated right side, ``psum``/``pmean``/
  ``pmax``/``pmin``/``ppermute`` over pmap's axis, dict entries, calls of such defs; a replicated
  (``in_axes=None``) value only where its rank is known and at most the mapped value's (NumPy
  broadcasting lines up trailing axes: a longer replicated value would meet the block's extra axis);
- every use of the pmapped function in the module is a call with positional arguments only, and
  the mapped arguments of each call have a length the module states (``jnp.arange(n)``,
  ``x.reshape(n, ...)``, ``jnp.ones((n, ...))``, ``jax.random.split(key, n)``, ``n`` an int or
  ``jax.device_count()``), the same for every call: the mesh is ``jax.devices()[:n]``, the devices
  pmap uses;
- the mesh, built just before the statement that applied pmap, starts JAX's backend no earlier than
  the program did: a statement before it already creates arrays, or the next ones do with nothing
  that could configure JAX in between.

Everything else keeps the helper (``rules_pmap.PMAP_HELPER``), which reproduces pmap's slices, mesh
size and keyword arguments at call time; the finding says why.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import libcst as cst
from libcst.metadata import PositionProvider, ScopeProvider

from meshkit.migrate._context import Context, ModuleIndex, PmapSite, code

DEVICES = "devices"  # a length: as many as jax.devices()
_DEVICE_COUNTS = frozenset({"jax.device_count", "jax.local_device_count"})
_DEVICE_LISTS = frozenset({"jax.devices", "jax.local_devices"})
_NP = ("jax.numpy.", "numpy.")
_FILLED = frozenset({"ones", "zeros", "empty", "full"})
_RANDOM_SHAPED = frozenset(f"jax.random.{n}" for n in ("normal", "uniform", "bernoulli", "truncated_normal"))
_REPLICATE = frozenset({"flax.jax_utils.replicate", "jax.device_put_replicated"})


def _qualified(module: str, names: str) -> set[str]:
    return {f"{module}.{n}" for n in names.split()}


_ELEMENTWISE = frozenset(
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
# jax.numpy functions that make no array (so do not start JAX's backend).
_NO_ARRAY = frozenset(
    _qualified("jax.numpy", "dtype finfo iinfo issubdtype promote_types result_type can_cast")
)
_REDUCE = frozenset(f"jax.lax.{n}" for n in ("psum", "pmean", "pmax", "pmin"))
_LAST_AXIS = frozenset({"jax.nn.softmax", "jax.nn.log_softmax"})
# Calls that build functions, not arrays: a statement of only these starts no backend.
_TRANSFORMS = frozenset(
    {
        "jax.jit",
        "jax.pmap",
        "jax.vmap",
        "jax.grad",
        "jax.value_and_grad",
        "jax.checkpoint",
        "jax.remat",
        "jax.shard_map",
        "functools.partial",
    }
)
_QUIET_IMPORTS = frozenset({"jax", "numpy", "functools", "typing", "math", "dataclasses", "collections"})
_MAX_DEPTH = 8


class NotInline(Exception):
    """Why a pmap keeps the helper (the message is the reason, for the finding)."""


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


@dataclass(frozen=True, slots=True)
class Shape:
    """What a call's argument expression says: its leading length (an int or DEVICES), rank, dict parts."""

    size: int | str | None = None
    rank: int | None = None
    fields: tuple[tuple[str, Shape], ...] | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    """The inline form of one pmap: its axis (source text), which positional arguments are mapped
    (None: all), the devices (DEVICES or the first n), the mesh's variable, how PartitionSpec is
    spelled, the statement the mesh goes before and the blank lines kept after it, and why it holds."""

    axis: str
    mapped: tuple[bool, ...] | None
    devices: int | str
    mesh: str
    spec: str
    statement: cst.CSTNode
    gap: int
    why: str

    def devices_code(self) -> str:
        return "jax.devices()" if self.devices == DEVICES else f"jax.devices()[:{self.devices}]"

    def mesh_statement(self) -> str:
        return f"{self.mesh} = jax.sharding.Mesh({self.devices_code()}, ({self.axis},))\n"

    def keywords(self) -> str:
        out = f"{self.spec}({self.axis})"
        ins = out
        if self.mapped is not None:
            each = [out if m else f"{self.spec}()" for m in self.mapped]
            ins = "(" + ", ".join(each) + ("," if len(each) == 1 else "") + ")"
        return f"mesh={self.mesh}, in_specs={ins}, out_specs={out}"

    def describe(self) -> str:
        return (
            f"written inline: jax.jit(jax.shard_map(f, {self.keywords()})), "
            f"{self.mesh} = jax.sharding.Mesh({self.devices_code()}, ({self.axis},)); {self.why}"
        )


def _line(ctx: Context, node: cst.CSTNode) -> int:
    return ctx.get_metadata(PositionProvider, node).start.line


def _literal_int(node: cst.BaseExpression) -> int | None:
    if isinstance(node, cst.Integer):
        return int(node.evaluated_value)
    if isinstance(node, cst.Float) and float(node.evaluated_value).is_integer():
        return int(node.evaluated_value)
    return None


def _negative_int(node: cst.BaseExpression) -> int | None:
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
        n = _literal_int(node.expression)
        return None if n is None else -n
    return None


def _number(node: cst.BaseExpression) -> bool:
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus | cst.Plus):
        node = node.expression
    return isinstance(node, cst.Integer | cst.Float)


def _function(ctx: Context, func: cst.BaseExpression) -> str:
    """The dotted name a call's function refers to; empty for a method of a computed value
    (libcst names ``jnp.arange(8).reshape`` ``jax.numpy.arange.reshape``)."""
    base = func
    while isinstance(base, cst.Attribute):
        base = base.value
    return (ctx.qname(func) or "") if isinstance(base, cst.Name) else ""


def _bound_value(ctx: Context, name: cst.Name) -> cst.BaseExpression | None:
    """The value ``name`` was given where one plain assignment (``n = ...``) binds every use of it."""
    target = ctx.binding(name)
    return None if target is None else ctx.assigned.get(target)


# ---- what the calls say of their arguments ------------------------------------------------------


class _Shapes:
    """Leading lengths and ranks of call arguments, from the expressions that make them."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def size(self, node: cst.BaseExpression, depth: int = 0) -> int | str | None:
        if depth > _MAX_DEPTH:
            return None
        n = _literal_int(node)
        if n is not None:
            return n if n > 0 else None
        if isinstance(node, cst.Name):
            value = _bound_value(self.ctx, node)
            return None if value is None else self.size(value, depth + 1)
        if not isinstance(node, cst.Call):
            return None
        name = self.ctx.qname(node.func)
        if not node.args:
            return DEVICES if name in _DEVICE_COUNTS else None
        if name == "len" and len(node.args) == 1:
            inner = node.args[0].value
            if isinstance(inner, cst.Call) and not inner.args and self.ctx.qname(inner.func) in _DEVICE_LISTS:
                return DEVICES
        return None

    def _shape_arg(self, node: cst.BaseExpression | None, depth: int) -> Shape:
        """A shape argument: ``n`` or ``(n, ...)``/``[n, ...]``."""
        if node is None:
            return Shape()
        if isinstance(node, cst.Tuple | cst.List):
            if not node.elements or any(isinstance(e, cst.StarredElement) for e in node.elements):
                return Shape()
            return Shape(self.size(node.elements[0].value, depth + 1), len(node.elements))
        return Shape(self.size(node, depth + 1), 1)

    def shape(self, node: cst.BaseExpression, depth: int = 0) -> Shape:
        if depth > _MAX_DEPTH:
            return Shape()
        if _number(node):
            return Shape(rank=0)
        if isinstance(node, cst.Name):
            value = _bound_value(self.ctx, node)
            return Shape() if value is None else self.shape(value, depth + 1)
        if isinstance(node, cst.UnaryOperation) and not isinstance(node.operator, cst.Not):
            return self.shape(node.expression, depth + 1)
        if isinstance(node, cst.BinaryOperation) and not isinstance(node.operator, cst.MatrixMultiply):
            # ``x - 5.0``, ``2 * x``: a number broadcasts, the array keeps its shape.
            if _number(node.right):
                return self.shape(node.left, depth + 1)
            if _number(node.left):
                return self.shape(node.right, depth + 1)
            return Shape()
        if isinstance(node, cst.Dict):
            fields = []
            for e in node.elements:
                if not isinstance(e, cst.DictElement) or not isinstance(e.key, cst.SimpleString):
                    return Shape()
                fields.append((str(e.key.evaluated_value), self.shape(e.value, depth + 1)))
            sizes = {s.size for _, s in fields if s.size is not None}
            return Shape(size=sizes.pop() if len(sizes) == 1 else None, fields=tuple(fields))
        if isinstance(node, cst.Call) and not any(a.star for a in node.args):
            return self._call(node, depth)
        return Shape()

    def _call(self, node: cst.Call, depth: int) -> Shape:
        name = _function(self.ctx, node.func)
        positional = [a.value for a in node.args if a.keyword is None]
        keywords = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
        short = name.rsplit(".", 1)[-1]
        numpy = name.startswith(_NP)
        if numpy and short == "arange" and len(positional) == 1:
            return Shape(self.size(positional[0], depth + 1), 1)
        if numpy and short in _FILLED:
            return self._shape_arg(positional[0] if positional else keywords.get("shape"), depth)
        if numpy and short in ("array", "asarray") and positional:
            return _literal_array(positional[0])
        if numpy and short == "reshape" and len(positional) == 2:
            return self._shape_arg(positional[1], depth)
        if name in _RANDOM_SHAPED:
            return self._shape_arg(positional[1] if len(positional) > 1 else keywords.get("shape"), depth)
        if name == "jax.random.split":
            num = positional[1] if len(positional) > 1 else keywords.get("num")
            return Shape(None if num is None else self.size(num, depth + 1))
        if name in _REPLICATE:
            devices = positional[1] if len(positional) > 1 else keywords.get("devices")
            default = devices is None and name == "flax.jax_utils.replicate"
            listed = isinstance(devices, cst.Call) and not devices.args
            listed = listed and self.ctx.qname(devices.func) in _DEVICE_LISTS
            return Shape(DEVICES) if default or listed else Shape()
        if name == "jax.device_put" and positional:
            return self.shape(positional[0], depth + 1)
        if isinstance(node.func, cst.Attribute) and not name.startswith(("jax.", "numpy.")):
            method = node.func.attr.value
            if method == "reshape" and len(positional) == 1:
                return self._shape_arg(positional[0], depth)
            if method == "reshape" and positional:
                return Shape(self.size(positional[0], depth + 1), len(positional))
            if method == "astype":
                return self.shape(node.func.value, depth + 1)
        return Shape()


def _literal_array(node: cst.BaseExpression) -> Shape:
    """``jnp.array([2.0, 5.0, 1.0])``: a list of numbers has its length and rank 1."""
    if not isinstance(node, cst.List | cst.Tuple) or not node.elements:
        return Shape()
    numbers = all(isinstance(e, cst.Element) and _number(e.value) for e in node.elements)
    return Shape(len(node.elements), 1) if numbers else Shape()


# ---- the body: elementwise in its mapped arguments ----------------------------------------------


class _Body:
    """Checks that a function gives on shard_map's block what pmap's body gave on the slice, with the
    block's axis kept; raises NotInline with the first thing that may not."""

    def __init__(self, ctx: Context, axis: cst.BaseExpression | None) -> None:
        self.ctx = ctx
        self.axis = axis
        self.stack: list[int] = []

    def function(self, fn: cst.FunctionDef | cst.Lambda, args: list[Value]) -> Value:
        if id(fn) in self.stack or len(self.stack) > _MAX_DEPTH:
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
                value = self._combine(self.expr(s.target, env), self.expr(s.value, env), s)
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
            return self._combine(left, right, node)
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
                return self._combine(self.expr(node.left, env), other, node)
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
        value = _bound_value(self.ctx, node)
        if value is not None and _number(value):
            return Value(False, 0)
        return Value(False, None)  # a value from outside: the same on every device, of unknown rank

    def _combine(self, a: Value, b: Value, node: cst.CSTNode) -> Value:
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
        name = _function(self.ctx, node.func)
        method = node.func.attr.value if isinstance(node.func, cst.Attribute) else None
        if method == "astype" and not name.startswith("jax."):
            self._static(node.args, env, node)
            return _array(self.expr(node.func.value, env), node)
        if name in _ELEMENTWISE:
            if not positional or (name == "jax.numpy.where" and len(positional) != 3):
                raise NotInline(f"`{code(node)}` is not elementwise with these arguments")
            # Keyword arguments are settings (a literal, a dtype) or arrays broadcast like the others.
            arrays = positional + [v for v in keywords.values() if not self._setting(v)]
            result = _array(self.expr(arrays[0], env), node)
            for p in arrays[1:]:
                result = self._combine(result, self.expr(p, env), node)
            return result
        if name in _REDUCE or name == "jax.lax.ppermute":
            return self._collective(node, name, positional, keywords, env)
        if name in ("jax.numpy.dot", "jax.numpy.matmul") and len(positional) == 2 and not keywords:
            a, b = (self.expr(p, env) for p in positional)
            return self._dot(a, b, node) if name.endswith("dot") else self._matmul(a, b, node)
        if name in _LAST_AXIS and len(positional) == 1:
            axis = keywords.pop("axis", None)
            if keywords or (axis is not None and _negative_int(axis) != -1):
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
        if _number(node) or isinstance(node, cst.SimpleString):
            return True
        if isinstance(node, cst.Name) and node.value in ("True", "False", "None"):
            return True
        return _function(self.ctx, node) in _DTYPES

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


# ---- the calls, the statement, the backend -------------------------------------------------------


def _uses(site: PmapSite, ctx: Context) -> list[cst.Call]:
    """The calls of the function ``site`` makes; NotInline where it is used otherwise, or not at all."""
    called = ctx.call_of.get(id(site.anchor))
    if not site.decorator and called is not None and called.func is site.anchor:
        return [called]
    if site.member or site.target is None or site.name is None:
        raise NotInline(
            "the pmapped function is passed on or bound to an attribute, so its calls cannot be followed"
        )
    if site.decorator and len(site.fn.decorators) != 1:
        raise NotInline("other decorators wrap the def besides pmap")
    scope = ctx.get_metadata(ScopeProvider, site.target, None)
    if scope is None:
        raise NotInline(f"the scope of {site.name} is unknown")
    uses = [
        access.node
        for assignment in scope.assignments[site.name]
        if getattr(assignment, "node", None) is site.target
        for access in assignment.references
    ]
    # A use that certainly reads another binding of the name (``f`` before ``f = jax.pmap(...)``) is not one.
    uses = [u for u in uses if not isinstance(u, cst.Name) or ctx.binding(u) in (None, id(site.target))]
    if not uses:
        raise NotInline(
            f"nothing in this module calls {site.name}, so the length of its mapped axis (the mesh's size) "
            "is unknown"
        )
    calls = []
    for use in sorted(uses, key=lambda u: _line(ctx, u)):
        call = ctx.call_of.get(id(use))
        if call is None or call.func is not use:
            raise NotInline(f"{site.name} is used at line {_line(ctx, use)} other than by a call")
        calls.append(call)
    index = ctx.index()
    if _exported(site, index) and not any(_at_top_level(u, index) for u in uses):
        raise NotInline(
            f"{site.name} is a module-level name other modules may call with another number of rows, and "
            "this module calls it only from functions (a script would call it when it runs)"
        )
    return calls


def _exported(site: PmapSite, index: ModuleIndex) -> bool:
    """Whether the pmapped function is a public module-level name (which other modules may call)."""
    if site.target is None or not site.name or site.name.startswith("_"):
        return False
    return isinstance(index.parent(index.statement(site.target)), cst.Module)


def _at_top_level(node: cst.CSTNode, index: ModuleIndex) -> bool:
    """Whether ``node`` runs when the module runs: outside every def, lambda and class."""
    while (node := index.parent(node)) is not None:
        if isinstance(node, cst.FunctionDef | cst.Lambda | cst.ClassDef):
            return False
    return True


def _argument_values(
    calls: list[cst.Call], mapped: tuple[bool, ...], ctx: Context
) -> tuple[list[Value], list[tuple[int, set[int | str]]]]:
    """The body's view of each parameter, from every call, and each call's line and mapped lengths."""
    shapes = _Shapes(ctx)
    per_param: list[list[Shape]] = [[] for _ in mapped]
    lengths = []
    for call in calls:
        line = _line(ctx, call)
        if any(a.star or a.keyword is not None for a in call.args):
            raise NotInline(
                f"the call at line {line} passes keyword or * arguments (pmap maps keywords, shard_map takes none)"
            )
        if len(call.args) != len(mapped):
            raise NotInline(
                f"the call at line {line} passes {len(call.args)} arguments for {len(mapped)} parameters"
            )
        found = [shapes.shape(a.value) for a in call.args]
        lengths.append(
            (line, {s.size for s, m in zip(found, mapped, strict=True) if m and s.size is not None})
        )
        for i, s in enumerate(found):
            per_param[i].append(s)
    return [_merge(s, m) for s, m in zip(per_param, mapped, strict=True)], lengths


def _length(lengths: list[tuple[int, set[int | str]]]) -> int | str:
    """The one length every call maps; NotInline where a call's is unknown or they differ."""
    for line, known in lengths:
        if len(known) != 1:
            raise NotInline(
                f"the length of the mapped axis at the call at line {line} is not known here (the mesh needs it)"
            )
    sizes = {n for _, known in lengths for n in known}
    if len(sizes) != 1:
        raise NotInline("the calls map axes of different lengths: one mesh cannot serve them")
    return sizes.pop()


def _merge(shapes: list[Shape], mapped: bool) -> Value:
    """A parameter's value in the body: mapped or not, with the rank and dict keys every call agrees on."""
    ranks = {s.rank for s in shapes}
    rank = ranks.pop() if len(ranks) == 1 else None
    if mapped and rank is not None:
        rank = rank - 1 if rank >= 1 else None
    fields = None
    keys = {None if s.fields is None else tuple(k for k, _ in s.fields) for s in shapes}
    if len(keys) == 1 and (only := keys.pop()) is not None:
        fields = tuple((k, _merge([dict(s.fields)[k] for s in shapes], mapped)) for k in only)
    return Value(mapped, rank, fields=fields)


def _calls_in(node: cst.CSTNode) -> list[cst.Call]:
    found: list[cst.Call] = []

    class _Calls(cst.CSTVisitor):
        def visit_Call(self, call: cst.Call) -> None:
            found.append(call)

        def visit_Lambda(self, lam: cst.Lambda) -> bool:
            return False

    node.visit(_Calls())
    return found


def _starts_backend(stmt: cst.CSTNode, ctx: Context) -> bool:
    """Whether a simple statement certainly creates arrays or asks for devices (which starts JAX's backend)."""
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    for call in _calls_in(stmt):
        name = _function(ctx, call.func)
        if name in _NO_ARRAY:
            continue
        if name in _DEVICE_COUNTS or name in _DEVICE_LISTS or name.startswith(("jax.numpy.", "jax.random.")):
            return True
        if name.startswith("jax.device_put"):
            return True
    return False


def _quiet(stmt: cst.CSTNode, ctx: Context) -> bool:
    """Whether a statement certainly neither configures JAX nor runs code that could: a def whose
    decorators are JAX's transforms, imports of jax and numpy, assignments of literals and transforms.
    (A class body runs when it is defined, a decorator is a call: neither counts.)"""
    if isinstance(stmt, cst.FunctionDef):
        return all(_transform(d.decorator, ctx) for d in stmt.decorators)
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    for s in stmt.body:
        if isinstance(s, cst.Pass):
            continue
        if isinstance(s, cst.Expr) and isinstance(s.value, cst.SimpleString | cst.ConcatenatedString):
            continue
        if isinstance(s, cst.Import) and all(code(a.name).split(".")[0] in _QUIET_IMPORTS for a in s.names):
            continue
        quiet_from = isinstance(s, cst.ImportFrom) and not s.relative and s.module is not None
        if quiet_from and code(s.module).split(".")[0] in _QUIET_IMPORTS:
            continue
        if isinstance(s, cst.Assign | cst.AnnAssign) and s.value is not None and _quiet_expr(s.value, ctx):
            continue
        return False
    return True


def _quiet_expr(node: cst.CSTNode, ctx: Context) -> bool:
    return all(ctx.callee(c)[0] in _TRANSFORMS for c in _calls_in(node))


def _transform(decorator: cst.BaseExpression, ctx: Context) -> bool:
    """``@jax.jit``, ``@partial(jax.pmap, axis_name="i")``: a decorator that only wraps the function."""
    if isinstance(decorator, cst.Call):
        return ctx.callee(decorator)[0] in _TRANSFORMS and _quiet_expr(decorator, ctx)
    return _function(ctx, decorator) in _TRANSFORMS or ctx.callee(cst.Call(decorator))[0] in _TRANSFORMS


def _backend_started(stmt: cst.CSTNode, ctx: Context, index: ModuleIndex) -> bool:
    """Whether a mesh built just before ``stmt`` starts JAX's backend no earlier than the program does.

    It does if a statement that runs before ``stmt`` (earlier in its block, or in the blocks around
    it up to the enclosing def) creates arrays, or if ``stmt`` or a later one of its block does with
    only quiet statements (defs, imports of jax and numpy, function transforms) in between.
    """
    node = stmt
    while True:
        body, at, holder = index.suite(node)
        if any(_starts_backend(s, ctx) for s in body[:at]):
            return True
        owner = index.parent(holder) if isinstance(holder, cst.IndentedBlock) else None
        while owner is not None and not isinstance(owner, cst.BaseStatement):
            owner = index.parent(owner)  # an else/except clause: up to its statement
        if owner is None or isinstance(owner, cst.FunctionDef | cst.ClassDef):
            break
        node = owner
    body, at, _ = index.suite(stmt)
    for s in body[at:]:
        if _starts_backend(s, ctx):
            return True
        if not _quiet(s, ctx):
            return False
    return False


def _in_axes(args: dict[str, cst.Arg], count: int) -> tuple[bool, ...]:
    """Per positional parameter, whether it is mapped; NotInline for axes other than 0 and None."""
    arg = args.get("in_axes")
    value = None if arg is None else arg.value
    if value is None or (isinstance(value, cst.Integer) and value.evaluated_value == 0):
        return (True,) * count
    other = NotInline(
        "in_axes maps an axis other than 0: shard_map's block keeps it where pmap's slice dropped it"
    )
    if not isinstance(value, cst.Tuple | cst.List):
        raise other
    mapped = []
    for e in value.elements:
        if isinstance(e.value, cst.Integer) and e.value.evaluated_value == 0:
            mapped.append(True)
        elif isinstance(e.value, cst.Name) and e.value.value == "None":
            mapped.append(False)
        else:
            raise other
    if len(mapped) != count:
        raise NotInline(f"in_axes has {len(mapped)} entries for {count} parameters")
    return tuple(mapped)


def _mapped_function(
    site: PmapSite, args: dict[str, cst.Arg], ctx: Context
) -> cst.FunctionDef | cst.Lambda | str:
    """What pmap maps: a def or lambda of this module, or the name of an elementwise function (jnp.add)."""
    if site.decorator:
        return site.fn
    fun = args.get("fun")
    value = None if fun is None or site.offset else fun.value
    if isinstance(value, cst.Lambda):
        return value
    if isinstance(value, cst.Name):
        bound = ctx.binding(value)
        found = ctx.def_nodes.get(bound)
        if found is not None and not found.decorators:
            return found
        if isinstance(ctx.assigned.get(bound), cst.Lambda):
            return ctx.assigned[bound]
    if value is not None and _function(ctx, value) in _ELEMENTWISE:
        return _function(ctx, value)
    if isinstance(value, cst.Name | cst.Attribute) and _function(ctx, value).startswith(("jax.", "numpy.")):
        raise NotInline(f"pmap maps `{code(value)}`, which the checker does not know to be elementwise")
    raise NotInline(
        "the mapped function is not a lambda or def of this module, so its body cannot be checked"
    )


def plan(site: PmapSite, args: dict[str, cst.Arg], ctx: Context) -> Plan:
    """How to write ``site`` inline; NotInline (its message the reason) where the helper must stay."""
    if "donate_argnums" in args:
        raise NotInline("donate_argnums: the helper donates what pmap donated")
    fn = _mapped_function(site, args, ctx)
    axis_arg = args.get("axis_name")
    axis = None if axis_arg is None else axis_arg.value
    if axis is not None and not isinstance(axis, cst.SimpleString | cst.Name | cst.Attribute):
        raise NotInline("axis_name is neither a string nor a name")
    body = _Body(ctx, axis)
    if not isinstance(fn, str):
        mapped = _in_axes(args, len(fn.params.posonly_params) + len(fn.params.params))
        with contextlib.suppress(RankUnknown):  # first without ranks: what the calls cannot settle
            body.function(fn, [Value(m) for m in mapped])
    calls = _uses(site, ctx)
    if isinstance(fn, str):
        mapped = _in_axes(args, len(calls[0].args))
    if not any(mapped):
        raise NotInline("no argument is mapped")
    values, lengths = _argument_values(calls, mapped, ctx)
    if isinstance(fn, str):  # an elementwise function applied to the arguments
        out = values[0]
        for v in values[1:]:
            out = body._combine(out, v, site.anchor)
    else:
        out = body.function(fn, values)
    if not out.mapped:
        raise NotInline(
            "an output is not computed from the mapped arguments: pmap stacks a copy per device where "
            "shard_map would split it"
        )
    size = _length(lengths)
    index = ctx.index()
    stmt = index.statement(site.anchor)
    if not _backend_started(stmt, ctx, index):
        raise NotInline(
            "the mesh would be built before the program first creates an array (at import, or before it "
            "may configure JAX); the helper builds it at the first call"
        )
    bound = ctx.module_names.get("P")
    ours = isinstance(bound, cst.ImportFrom) and "PartitionSpec as P" in code(bound)
    _, _, holder = index.suite(stmt)
    gap = 0
    if isinstance(stmt, cst.FunctionDef | cst.ClassDef):
        gap = 2 if isinstance(holder, cst.Module) else 1
    devices = "all the devices" if size == DEVICES else f"{size} devices"
    seen = " (calls from other modules are not seen)" if _exported(site, index) else ""
    return Plan(
        axis=code(axis) if axis is not None else '"i"',
        mapped=None if all(mapped) else mapped,
        devices=size,
        mesh=index.mesh_name(site.anchor),
        spec="P" if ours or "P" not in index.names else "jax.sharding.PartitionSpec",
        statement=stmt,
        gap=gap,
        why=(
            "the body is elementwise in its mapped arguments, so shard_map's block of one row gives pmap's "
            f"slice with its axis kept, and every call in this module maps {devices}{seen}"
        ),
    )
