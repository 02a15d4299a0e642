"""How a Llama-family ``config.json`` (``meshkit.models.llama_hf``) says sliding windows, both ways: a row's kind
of window (``WINDOWS``), read as transformers runs it (``window``) and written (``window_fields``)."""

from __future__ import annotations

from typing import Any

from meshkit.models.family import InteropError, flag, whole

WINDOWS = {
    "none": ("sliding_window",),
    "every": ("sliding_window",),
    "qwen": ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
    "gated": ("use_sliding_window", "sliding_window", "max_window_layers"),
    "layers": ("sliding_window", "layer_types"),
}
"""How a row reads a window, and the fields it reads for it: none (Llama's: ``sliding_window`` null
only, which transformers' Llama would ignore); ``sliding_window`` in every layer
(Mistral's); gated by ``use_sliding_window``, per layer (Qwen2's, Qwen3's); gated, in every layer
(Qwen3-MoE's: ``max_window_layers`` read and left aside, as its transformers class does); in the layers
``layer_types`` names, by default every other one from the first (GPT-OSS's, ungated)."""


def layer_types(data: dict, where: str, layers: int) -> list | None:
    """Qwen's ``layer_types``, checked: one kind per layer, full or sliding attention."""
    kinds = data.get("layer_types")
    if kinds is not None and (
        not isinstance(kinds, list)
        or not all(isinstance(kind, str) for kind in kinds)
        or set(kinds) - {"full_attention", "sliding_attention"}
        or len(kinds) != layers
    ):
        raise InteropError(
            f"{where}: layer_types={kinds!r} is not what meshkit's Llama computes: give {layers} layers, each "
            f"full_attention or sliding_attention"
        )
    return kinds


def window(
    data: dict, where: str, row: Any, layers: int, positions: int
) -> tuple[int | None, tuple[bool, ...] | None]:
    """``(window, sliding)`` of the config as transformers runs it (the module docstring); an omitted
    ``sliding_window`` is the type's default (``_Type.default_window``), not none."""
    kinds = layer_types(data, where, layers) if row.window in ("qwen", "layers") else None
    if row.window == "layers" and kinds is None:  # GPT-OSS's default: the even layers slide
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    window = data.get("sliding_window", row.default_window)
    if row.window in ("qwen", "gated") and not flag(data, "use_sliding_window", where, False):
        window = None
    if window is not None and not row.slides:
        raise InteropError(
            f"{where}: use_sliding_window=true in a {row.architecture} config, whose window transformers 4.57 and "
            f"5.x read differently (every layer, or those layer_types names): give use_sliding_window false"
        )
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise InteropError(
            f"{where}: sliding_window={window!r} is not a whole number of tokens: give one, or null"
        )
    if window is not None and row.window == "none":
        raise InteropError(
            f"{where}: sliding_window={window} in a {row.architecture} config, whose transformers class attends to "
            f"every earlier position: give null, or the model_type that slides (mistral)"
        )
    if window is None or window >= positions:
        return None, None
    if row.window not in ("qwen", "layers"):
        return window, None
    if kinds is not None:
        return window, tuple(kind == "sliding_attention" for kind in kinds)
    first = whole(data, "max_window_layers", where, 28, least=0)
    return window, tuple(i >= first for i in range(layers))


def window_fields(cfg: Any, row: Any) -> dict[str, Any]:
    """The row's window fields for ``cfg``'s window."""
    if row.window == "every":
        return {"sliding_window": cfg.window}
    if row.window == "none":
        return {}
    if row.window == "layers":
        return {"sliding_window": cfg.window, "layer_types": _kinds(cfg)}
    on = {"use_sliding_window": cfg.window is not None, "sliding_window": cfg.window}
    if row.window == "gated":
        return on
    windows = cfg.layer_windows
    first = next((i for i, w in enumerate(windows) if w is not None), cfg.layers)
    return (
        on | {"max_window_layers": first} | ({"layer_types": _kinds(cfg)} if cfg.window is not None else {})
    )


def _kinds(cfg: Any) -> list[str]:
    """``layer_types`` of ``cfg``'s windows."""
    return ["full_attention" if w is None else "sliding_attention" for w in cfg.layer_windows]
