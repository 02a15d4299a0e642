"""The inline form of one pmap as written: a mesh statement and ``jax.jit(jax.shard_map(f, mesh=...,
in_specs=..., out_specs=...))`` in place of the pmap (``jax.jit`` over ``jax.shard_map(mesh=..., ...)``
for a decorator), and the finding's text that says why it holds.

``Plan`` carries what ``_inline.plan`` decided (the axis, which arguments are mapped, the devices,
the mesh's name and place); this module only spells it.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from meshkit.migrate._context import pmap_arguments
from meshkit.migrate._inline_calls import DEVICES


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

    def write(self, updated: cst.Call | cst.Decorator) -> cst.CSTNode:
        """The pmap at ``updated`` as ``jax.jit(jax.shard_map(f, mesh=..., ...))``, or as those two decorators."""
        if isinstance(updated, cst.Decorator):
            sharded = cst.parse_expression(f"jax.shard_map({self.keywords()})")
            return cst.FlattenSentinel(
                [
                    cst.Decorator(cst.parse_expression("jax.jit"), leading_lines=updated.leading_lines),
                    cst.Decorator(sharded, trailing_whitespace=updated.trailing_whitespace),
                ]
            )
        fun = pmap_arguments(updated, 0)["fun"].value
        sharded = cst.parse_expression(f"jax.shard_map(f, {self.keywords()})")
        sharded = sharded.with_changes(args=[sharded.args[0].with_changes(value=fun), *sharded.args[1:]])
        jitted = cst.parse_expression("jax.jit(f)")
        return jitted.with_changes(args=[cst.Arg(sharded)], lpar=updated.lpar, rpar=updated.rpar)
