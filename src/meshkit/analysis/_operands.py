"""What a collective instruction moves, read from its HLO: its operands and results as arrays, the bytes in
and out, ``S`` of the ring formulas (``operand_arrays``), and a permute's device pairs
(``source_target_pairs``). The ledger (``analysis.communication``) records them."""

from __future__ import annotations

import re

from meshkit._errors import HloParseError
from meshkit.analysis._hlo import Array, Instruction, Module, leaves, parse_shape


def source_target_pairs(attrs: str) -> tuple[tuple[int, int], ...]:
    """A collective-permute's (or send's, recv's) ``source_target_pairs``, as (source, target) ids."""
    found = re.search(r"\bsource_target_pairs\s*=\s*\{", attrs)
    if not found:
        return ()
    body = attrs[found.end() - 1 :]
    depth = 0
    for i, ch in enumerate(body):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            body = body[: i + 1]
            break
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", body))


def operand_arrays(module: Module, inst: Instruction, op: str, start: bool, n: int) -> tuple:
    """Operand arrays (the data counted in S), result arrays, in/out bytes and S of a collective."""
    # ragged-all-to-all: (input, output, input_offsets, send_sizes, output_offsets, recv_sizes);
    # the in-place collective-permute (with slice_sizes=): (input, output, input_starts,
    # output_starts). S is the input. (A combined collective-permute's operands are all inputs.)
    in_place = op == "collective-permute" and "slice_sizes" in inst.attrs
    first = 1 if op == "ragged-all-to-all" or in_place else None
    ins = module.operand_types(inst, first)
    res = parse_shape(inst.type_text) if inst.type_text else None
    outs: tuple[Array, ...] | None
    if res is None:
        outs = None
    elif start and op != "all-reduce" and isinstance(res, tuple) and len(res) >= 2:
        # Async starts return (operands, results[, context]); all-reduce-start returns the results.
        outs = leaves(res[1])
        if ins is None:
            ins = leaves(res[0])
    elif op in ("recv", "send") and isinstance(res, tuple) and res:
        outs = leaves(res[0])  # (data, u32[] context, token[])
    else:
        outs = leaves(res)
    if ins is not None:
        ins = tuple(a for a in ins if a.dtype not in ("token", "opaque"))
    if ins is None and outs is None:
        raise HloParseError("its result type is not printed and its operands are not defined in the text")
    out_b = sum(a.nbytes for a in outs) if outs is not None else None
    in_b = sum(a.nbytes for a in ins) if ins is not None else None
    if in_b is None:
        in_b = out_b // n if op == "all-gather" else out_b * n if op == "reduce-scatter" else out_b
        if op == "recv":
            in_b = 0
    if out_b is None:
        out_b = in_b * n if op == "all-gather" else in_b // n if op == "reduce-scatter" else in_b
    if op == "send":
        out_b = in_b  # what it sends (its result repeats the data operand's type)
    size = out_b if op in ("all-gather", "recv") else in_b
    arrays = ins if ins else (outs or ())
    return arrays, in_b, out_b, size
