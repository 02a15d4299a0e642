"""LoRA: low-rank adapters on chosen matrices of a model, trained while the model stays frozen.

A target matrix ``W`` (``d_in x d_out``, or ``L x d_in x d_out`` stacked) gets ``W_lora_a`` (``d_in x
r``, uniform in ``+-1/sqrt(d_in)`` as PEFT draws it) and ``W_lora_b`` (``r x d_out``, zeros) beside it
in its dict, so the adapters live where their weight lives (a pipeline's stage holds its layers'
adapters). The model reads ``W + (alpha / r) A @ B``: ``wrap`` hands the family's loss a view of the
parameters (``Merged``) whose target entries merge when the family reads them, inside the layer
that reads them (a scan's body, a ``meshkit.layer`` block), so the family's code is unchanged, a
full-size merged temporary lives one layer at a time, and ZeRO-3 gathers ``W``, ``A`` and ``B`` per
layer like any weight. ``trainable`` names the adapters (``Trainer(trainable=...)``: the base is
frozen), ``logical_axes`` derives theirs from the base weight's (``A``: ``W``'s input axis and the
replicated rank, ``placement.ADAPTER_RANK``; ``B``: the rank and ``W``'s output axis), so tensor parallelism and ZeRO split them
as their weight. ``merge`` folds them in for export: the family's own parameters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from meshkit._errors import MeshkitError
from meshkit.spec import ADAPTER_PAIR, ADAPTER_RANK

DEFAULT_TARGETS: tuple[str, ...] = ("wq", "wk", "wv", "wo")
"""The attention projections: the matrices LoRA adapts unless told otherwise."""
A, B = ADAPTER_PAIR
"""The adapters' keys: the target's own key with these suffixes."""


class LoraError(MeshkitError):
    """A LoRA setting that cannot apply to the model."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraConfig:
    """LoRA's settings (the train config's ``lora_rank``, ``lora_alpha``, ``lora_targets``)."""

    rank: int = 8
    """``r``: the adapters' inner dimension."""
    alpha: float = 16.0
    """The update's scale is ``alpha / rank``."""
    targets: tuple[str, ...] = DEFAULT_TARGETS
    """Keys of the matrices to adapt (``wq``, ``w_up``...), wherever they occur in the parameters."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise LoraError(f"LoRA rank must be a positive integer, got {self.rank!r}: pass --lora-rank 8")
        if not self.targets:
            raise LoraError(f"LoRA needs target matrices: pass --lora-targets {','.join(DEFAULT_TARGETS)}")
        if not (math.isfinite(self.alpha) and self.alpha != 0):  # a zero scale trains nothing
            raise LoraError(f"LoRA alpha must be finite and not 0, got {self.alpha!r}: pass --lora-alpha 16")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _dicts(tree: Any) -> Iterator[dict]:
    """Every dict in a tree of dicts and lists (parameters), outermost first."""
    if isinstance(tree, Mapping):
        yield tree
        for v in tree.values():
            yield from _dicts(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _dicts(v)


def _rebuild(tree: Any, fn: Callable[[dict], Any]) -> Any:
    """``tree`` with every dict ``d`` (innermost first) replaced by ``fn(d)``."""
    if isinstance(tree, Mapping):
        return fn({k: _rebuild(v, fn) for k, v in tree.items()})
    if isinstance(tree, list | tuple):
        return type(tree)(_rebuild(v, fn) for v in tree)
    return tree


def add(key: jax.Array, params: Any, cfg: LoraConfig) -> Any:
    """``params`` with adapters beside every target matrix (a refused target names the matrices there are)."""
    matrices = sorted({k for d in _dicts(params) for k, v in d.items() if getattr(v, "ndim", 0) >= 2})
    if missing := [t for t in cfg.targets if t not in matrices]:
        raise LoraError(
            f"LoRA target(s) {missing} match no matrix of the model; its matrices are {matrices}: "
            f"pass --lora-targets with some of them"
        )
    counter = iter(range(1 << 30))

    def adapt(d: dict) -> dict:
        out = dict(d)
        for name in cfg.targets:
            w = d.get(name)
            if getattr(w, "ndim", 0) < 2:
                continue
            *lead, d_in, d_out = w.shape
            bound = 1.0 / math.sqrt(d_in)
            k = jax.random.fold_in(key, next(counter))
            out[name + A] = jax.random.uniform(k, (*lead, d_in, cfg.rank), w.dtype, -bound, bound)
            out[name + B] = jnp.zeros((*lead, cfg.rank, d_out), w.dtype)
        return out

    return _rebuild(params, adapt)


def trainable(path: str) -> bool:
    """Whether a leaf (by its path ``a/b/c``) is an adapter: the ``trainable=`` of a LoRA run."""
    return path.endswith(A) or path.endswith(B)


def base(params: Any) -> Any:
    """``params`` without their adapters (the family's structure)."""
    return _rebuild(params, lambda d: {k: v for k, v in d.items() if not trainable(k)})


def logical_axes(params: Any, family_axes: Callable[[Any], Any]) -> Any:
    """Logical axes of adapted ``params``: the family's (``family_axes`` of the base parameters) and the
    adapters' from their weight's: ``A`` (input axes, rank), ``B`` (rank, output axis); a stacked
    weight's leading axes lead both."""
    axes = family_axes(base(params))

    def fill(d_axes: Any, d: Any) -> Any:
        if isinstance(d, Mapping):
            out = {k: fill(d_axes[k], v) for k, v in d.items() if not trainable(k)}
            for k in d:
                if k.endswith(A):
                    out[k] = (*d_axes[k[: -len(A)]][:-1], ADAPTER_RANK)
                elif k.endswith(B):
                    w = d_axes[k[: -len(B)]]
                    out[k] = (*w[:-2], ADAPTER_RANK, w[-1])
            return out
        if isinstance(d, list | tuple):
            return type(d)(fill(a, v) for a, v in zip(d_axes, d, strict=True))
        return d_axes

    return fill(axes, params)


def _merged(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    return w + (scale * jnp.matmul(a, b)).astype(w.dtype)


@jax.tree_util.register_pytree_with_keys_class
class Merged(Mapping):
    """A parameter dict as the family reads it: ``d[name]`` of an adapted matrix is ``W + scale A @ B``,
    computed where it is read; its leaves (for ``jax.tree``, scans and per-layer gathers) are the raw
    ``W``, ``A`` and ``B``."""

    def __init__(self, raw: dict, scale: float) -> None:
        self.raw, self.scale = raw, scale

    def __getitem__(self, name: str) -> Any:
        if trainable(name):
            raise KeyError(name)
        if name + A in self.raw:
            return _merged(self.raw[name], self.raw[name + A], self.raw[name + B], self.scale)
        return self.raw[name]

    def __iter__(self) -> Iterator[str]:
        return (k for k in self.raw if not trainable(k))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def tree_flatten_with_keys(self) -> tuple:
        keys = sorted(self.raw)
        return [(jax.tree_util.DictKey(k), self.raw[k]) for k in keys], (tuple(keys), self.scale)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: Any) -> Merged:
        return cls(dict(zip(aux[0], children, strict=True)), aux[1])


def view(params: Any, cfg: LoraConfig) -> Any:
    """``params`` as the family reads them: each dict holding adapters a ``Merged``."""
    return _rebuild(params, lambda d: Merged(d, cfg.scale) if any(trainable(k) for k in d) else d)


def merge(params: Any, cfg: LoraConfig) -> Any:
    """The family's parameters with the adapters folded in (``W + scale A @ B``): what an export writes."""

    def fold(d: dict) -> dict:
        if not any(trainable(k) for k in d):
            return d
        return {k: Merged(d, cfg.scale)[k] for k in d if not trainable(k)}

    return _rebuild(params, fold)


def wrap(loss_fn: Any, cfg: LoraConfig) -> Any:
    """The family's loss (or ``Stages``) over adapted parameters: each function that reads parameters
    reads them through ``view``."""
    from meshkit.plans import Stages

    if isinstance(loss_fn, Stages):
        on = lambda f: lambda p, *a: f(view(p, cfg), *a)  # noqa: E731
        return dataclasses.replace(
            loss_fn, embed=on(loss_fn.embed), block=on(loss_fn.block), head=on(loss_fn.head)
        )
    return lambda params, *args: loss_fn(view(params, cfg), *args)
