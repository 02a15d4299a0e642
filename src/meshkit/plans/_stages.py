"""A model as pipeline stages see it (``Stages``), and how its stacked layers are laid over the
``stage`` axis: whole layers per stage, and for the interleaved schedule the chunks' order (the
stored order gives each device a contiguous slice; the schedule wants virtual stages ``c p + d``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from meshkit.plans import _schedule
from meshkit.plans.placement import LeafPlacement, Placement
from meshkit.spec import STAGE, PlanError


@dataclass(frozen=True, kw_only=True, slots=True)
class Stages:
    """A model as embedding -> L identical blocks (or L layers in identical blocks of ``period``) -> head
    -> loss, the shape a pipeline splits.

    ``params`` is a dict; ``params[blocks]`` holds the blocks' parameters stacked with a leading
    layer axis (every leaf ``(L, ...)``), the other entries (the "top") belong to the embedding and
    the head. Calling a ``Stages`` is its loss on a batch, so it is a ``loss_fn`` for every plan.
    """

    embed: Callable[[Any, Any], jax.Array]
    """``(top, batch) -> x``: the first block's input, one array (e.g. ``(B, T, D)``)."""
    block: Callable[[Any, jax.Array], jax.Array]
    """``(layer_params, x) -> x`` for one layer (its slice of the stacked parameters)."""
    head: Callable[[Any, jax.Array], Any]
    """``(top, x) -> outputs`` (e.g. logits)."""
    loss: Callable[[Any, Any], jax.Array]
    """``(outputs, batch) -> scalar``: the mean over the batch's examples."""
    blocks: str = "blocks"
    """The key of ``params`` holding the stacked blocks."""
    period: int = 1
    """Layers per block: ``block`` takes ``period`` consecutive layers at once (each leaf ``(period, ...)``),
    for a model whose layers differ in a pattern that repeats (Gemma's local and global attention). The
    scan runs over whole periods, so every stage (every chunk of layers) holds whole periods."""

    def split(self, params: Any) -> tuple[dict, Any]:
        if not isinstance(params, dict) or self.blocks not in params:
            raise PlanError(f"Stages parameters must be a dict with the stacked blocks under {self.blocks!r}")
        return {k: v for k, v in params.items() if k != self.blocks}, params[self.blocks]

    def layers(self, params: Any) -> int:
        blocks = self.split(params)[1]
        if isinstance(blocks, list | tuple):
            raise PlanError(
                f"params[{self.blocks!r}] is a list of layers: stack them with a leading layer axis "
                f"(for the GPT: gpt.to_scanned(params), or GPTConfig(scan_layers=True))"
            )
        shapes = {np.shape(a)[0] if np.ndim(a) else None for a in jax.tree.leaves(blocks)}
        if len(shapes) != 1 or None in shapes:
            raise PlanError(
                f"every leaf of params[{self.blocks!r}] needs the same leading layer dim, got {sorted(map(str, shapes))}"
            )
        return int(shapes.pop())

    def run_blocks(self, blocks: Any, x: jax.Array, policy: Any = None) -> jax.Array:
        """The blocks in order, a ``lax.scan`` over the layer axis (over whole periods of ``period``
        layers); with ``policy`` (a ``jax.checkpoint`` policy) each block rematerialized under it."""
        block = self.block if policy is None else jax.checkpoint(self.block, policy=policy, prevent_cse=False)
        if self.period > 1:
            layers = jax.tree.leaves(blocks)[0].shape[0]
            if layers % self.period:
                raise PlanError(
                    f"{layers} layers are not whole periods of {self.period} (the model's layers repeat every "
                    f"{self.period}): give each scan or stage a multiple of {self.period} layers"
                )
            blocks = jax.tree.map(
                lambda a: a.reshape(layers // self.period, self.period, *a.shape[1:]), blocks
            )
        return lax.scan(lambda h, p: (block(p, h), None), x, blocks)[0]

    def __call__(self, params: Any, batch: Any) -> jax.Array:
        top, blocks = self.split(params)
        return self.loss(self.head(top, self.run_blocks(blocks, self.embed(top, batch))), batch)


def check_sizes(stages: Stages, params: Any, p: int, m: int, v: int, schedule: str) -> None:
    """Raise PlanError naming the fix when layers, stages, micro-batches and schedule do not fit."""
    _schedule.check(schedule, p, m, v)
    layers = stages.layers(params)
    if layers % (p * v):
        fits = [d for d in range(1, layers + 1) if layers % (d * v) == 0]
        raise PlanError(
            f"{layers} layers do not divide over stage={p} x virtual_stages={v}: each stage needs whole "
            f"layers; use a stage axis of {', '.join(map(str, fits))}, or a layer count divisible by {p * v}"
        )
    if layers // (p * v) % stages.period:
        fits = [d for d in range(1, layers + 1) if layers % (d * v * stages.period) == 0]
        raise PlanError(
            f"{layers} layers over stage={p} x virtual_stages={v} give each stage {layers // (p * v)}, not whole "
            f"periods of {stages.period} (the model's layers repeat every {stages.period}): use a stage axis of "
            f"{', '.join(map(str, fits)) or 'none: the layers are not whole periods'}"
        )


def stage_placement(placement: Placement, stages: Stages) -> Placement:
    """The placement with every stacked block leaf split on its layer dim over the stage axis."""

    n = placement.data_size

    def split(leaf: LeafPlacement) -> LeafPlacement:
        if not leaf.path.startswith(stages.blocks + "/") and leaf.path != stages.blocks:
            return leaf
        spec = (STAGE, *leaf.model_spec[1:])
        dim, why = leaf.data_dim, leaf.why_replicated
        if dim == 0:  # ZeRO-3 picked the layer dim, which the stages split: another dim, or whole
            dims = sorted(
                (d for d in range(1, len(leaf.shape)) if leaf.shape[d] % n == 0), key=lambda d: -leaf.shape[d]
            )
            dim, why = (
                (dims[0], None)
                if dims
                else (None, f"no dim of {leaf.shape} but the layer dim divides over data={n}")
            )
        return LeafPlacement(
            path=leaf.path,
            shape=leaf.shape,
            nbytes=leaf.nbytes,
            model_spec=spec,
            data_dim=dim,
            why_replicated=why,
            names=leaf.names,
        )

    return Placement(plan=placement.plan, mesh=placement.mesh, leaves=placement.tree(split))


def relayout_moves(p: int, v: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Interleaved: the stored order gives device e virtual stages ``e v .. e v + v - 1`` (its slice of
    the layer axis), the schedule wants ``c p + d`` as chunk c of device d. Per (stored chunk i,
    wanted chunk c), the (source, destination) device pairs: a partial permutation (one ppermute),
    with pairs whose source is the destination kept local."""
    out = []
    for c in range(v):
        for i in range(v):
            pairs = [(e, d) for e in range(p) for d in range(p) if e * v + i == c * p + d]
            if pairs:
                out.append((i, c, pairs))
    return out


def relayout(tree: Any, p: int, v: int, d: jax.Array, back: bool) -> Any:
    """Chunks from the stored order to the schedule's (or ``back``), by ppermutes over the stage axis;
    each chunk that changes device costs one collective-permute of its bytes."""
    k = jax.tree.leaves(tree)[0].shape[0] // v
    get = lambda a, i: lax.slice_in_dim(a, i * k, (i + 1) * k)  # noqa: E731
    parts = [jax.tree.map(lambda a: jnp.zeros_like(get(a, 0)), tree) for _ in range(v)]
    for i, c, pairs in relayout_moves(p, v):
        src_i, dst_c = (c, i) if back else (i, c)
        pairs = [(b, a) for a, b in pairs] if back else pairs
        moving = [(a, b) for a, b in pairs if a != b]
        here = np.zeros(p, bool)
        here[[a for a, b in pairs if a == b]] = True
        src = jax.tree.map(lambda a, i=src_i: get(a, i), tree)
        keep = jnp.asarray(here)[d]
        add = jax.tree.map(lambda x, keep=keep: jnp.where(keep, x, jnp.zeros_like(x)), src)
        if moving:
            add = jax.tree.map(jnp.add, add, lax.ppermute(src, STAGE, moving))
        parts[dst_c] = jax.tree.map(jnp.add, parts[dst_c], add)
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


def relayout_count(p: int, v: int) -> int:
    """Collective-permutes of one chunk per relayout (one way)."""
    return sum(any(a != b for a, b in pairs) for _, _, pairs in relayout_moves(p, v))


def stages_join(stages: Stages, top: dict, blocks: Any) -> dict:
    return {**top, stages.blocks: blocks}


def whole_loss(stages: Stages, params: Any, batch: Any, policy: Any) -> jax.Array:
    """The loss of ``stages`` on a batch, its blocks under the remat ``policy``, at least float32."""
    top, blocks = stages.split(params)
    return split_loss(stages, top, top, blocks, batch, policy)


def split_loss(
    stages: Stages, embed_top: Any, head_top: Any, blocks: Any, batch: Any, policy: Any
) -> jax.Array:
    """``whole_loss`` with the embedding's and the head's parameters as two arguments, so that their
    gradients come apart (deterministic mode on one stage: a tied embedding's two halves)."""
    x = stages.run_blocks(blocks, stages.embed(embed_top, batch), policy)
    return jnp.asarray(stages.loss(stages.head(head_top, x), batch), jnp.promote_types(x.dtype, jnp.float32))
