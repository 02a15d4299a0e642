"""The Llama's layers of different kinds (``meshkit.models.llama``): which of its layers a window binds
in, which run a dense MLP among routed ones (``settle_dense``), and how layers of different kinds run.

A config gives a window (``LlamaConfig.window``: a query sees itself and the ``window - 1`` positions before
it) and the layers it binds in (``sliding``, one flag per layer; None: every layer). ``settle`` checks the
two and puts them in one form per model: ``sliding`` None where every layer slides, both None where none
does.

Layers of different windows (Qwen2's ``max_window_layers``) or MLPs (Qwen3-MoE's ``mlp_only_layers``) run
as runs of consecutive layers of one kind each (``runs``), every run through ``stack.run_layers``: the
window is static in each attention, so every implementation and context form (``plans.causal_attention``)
takes it. The scanned form is one ``lax.scan``, one block function: its config must hold one kind in
every layer.
"""

from __future__ import annotations

from typing import Any

from meshkit._errors import MeshkitError


def settle(
    window: Any, sliding: Any, layers: int, scan_layers: bool
) -> tuple[int | None, tuple[bool, ...] | None]:
    """``(window, sliding)`` of a config, checked: a whole window of at least 1; ``sliding`` one flag per
    layer, None where every layer slides, and the window None where none does (one config per model); one
    window in every layer when scanned."""
    w, s = window, sliding
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
        raise MeshkitError(
            f"window must be a whole number of tokens of at least 1 (None: no window), got {w!r}"
        )
    if s is None:
        return w, None
    s = tuple(s) if isinstance(s, list | tuple) else s
    if not isinstance(s, tuple) or len(s) != layers or not all(isinstance(f, bool) for f in s):
        raise MeshkitError(f"sliding must be {layers} booleans, one per layer (None: every layer), got {s!r}")
    if w is None:
        raise MeshkitError(f"sliding={s} names the layers of a window but window is None: give the window")
    if not any(s):
        return None, None
    if scan_layers and not all(s):
        raise MeshkitError(
            f"a Llama whose layers have different windows (sliding={s}) runs in the layers form only: give "
            f"scan_layers=False (no --scan-layers, and a plan without a pipeline)"
        )
    return w, None if all(s) else s


def settle_dense(dense: Any, layers: int, experts: int, scan_layers: bool) -> tuple[bool, ...] | None:
    """``dense_layers`` of a config, checked: one flag per layer of a mixture of experts, None where no
    layer is dense (one config per model), some layer routed; the layers form only."""
    if dense is None:
        return None
    d = tuple(dense) if isinstance(dense, list | tuple) else dense
    if not isinstance(d, tuple) or len(d) != layers or not all(isinstance(f, bool) for f in d):
        raise MeshkitError(f"dense_layers must be {layers} booleans, one per layer (None: none), got {d!r}")
    if not any(d):
        return None
    if not experts or all(d):
        raise MeshkitError(
            f"dense_layers={d} names dense MLPs among routed ones, but {'every layer is dense' if experts else 'experts is 0'}: "
            f"give experts=0 for a dense model"
        )
    if scan_layers:
        raise MeshkitError(
            "a Llama with dense layers between routed ones runs in the layers form only: give scan_layers=False "
            "(no --scan-layers, and a plan without a pipeline)"
        )
    return d


def runs(cfg: Any) -> list[tuple[int | None, bool, int, int]]:
    """``(window, dense, first, end)`` of each run of consecutive layers of one window and one MLP (one run
    when scanned: the config holds one kind in every layer of the scanned form)."""
    kinds = list(zip(cfg.layer_windows, cfg.dense_layers or (False,) * cfg.layers, strict=True))
    if cfg.scan_layers:
        return [(*kinds[0], 0, cfg.layers)]
    out: list[tuple[int | None, bool, int, int]] = []
    for i, kind in enumerate(kinds):
        if out and out[-1][:2] == kind:
            out[-1] = (*kind, out[-1][2], i + 1)
        else:
            out.append((*kind, i, i + 1))
    return out
