"""The context axis (plans ``cp``, ``dp+cp``, ``fsdp+cp``, ``tp+cp``...): every sequence split over it.

The technique is ``plans._context`` (the sequence split, ring and all-to-all attention, the balanced
order). Here is what a plan does with it: the split in force while the step traces the loss (on each
device's own heads where tensor parallelism splits them), the batch put in the balanced order before
the step's region, the attention's collectives in the ledger's model, and the checks of a run's
sequence length and heads. The gradient sums over the axis follow from its row
(``AxisRule.splits = "sequence"``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from meshkit.analysis.cost import ring_traffic
from meshkit.plans import _context
from meshkit.plans._experts import check_whole_sequences
from meshkit.plans.axes._base import Add, AxisPlan, Flow, LedgerInputs, divisors
from meshkit.plans.placement import LeafPlacement, Placement
from meshkit.spec import CONTEXT, MODEL

CONTEXT_MIN_TOKENS = 4096
"""Shortest sequence chunk per device the planner's search splits a sequence into (Llama 3's 131k-token
phase ran 8192 a device): below it the ring's K/V passes outgrow the attention that hides them (both
grow with the chunk, the attention with its square) and sequences that short fit without cp."""


class ContextAxis(AxisPlan):
    axis = CONTEXT

    @contextlib.contextmanager
    def tracing(self, placement: Placement, per: Any, form: str) -> Iterator[None]:
        """The sequence split in force (attention in ``form``); a loss that never attended through
        ``_context`` is refused after the trace."""
        with _context.split_sequence(self.size(placement), form, heads_axis=heads_axis(placement)) as split:
            yield
        _context.check_attended(split)

    def arrange(self, batch: Any, placement: Placement) -> Any:
        return _context.to_balanced(batch, self.size(placement))

    def ledger(self, add: Add, inputs: LedgerInputs) -> None:
        """Per layer and micro-batch, with C devices on the context axis and ``tokens`` per data shard
        (``T/C`` of each sequence on a device), ring: ``2 (C-1)`` K/V ppermutes forward (again under
        remat) and as many of their gradients backward, each ``tokens/C x kv width``; or all-to-all: 4
        forward (q, k, v, out) and 4 backward, each ``tokens/C x heads x head_dim`` (k and v ``tokens/C x
        kv width`` where the kv heads divide over C, ``_exchanged_kv_width``)."""
        placement, c = inputs.placement, self.size(inputs.placement)
        if c == 1:
            return
        per_layer = inputs.per_layer
        local = inputs.tokens_per_device // c * inputs.activation_bytes
        forward = 2 if per_layer is not None and per_layer.remat != "none" else 1
        for layers, q_width, kv_width, *splits in _attention_widths(placement):
            if inputs.form == "ring":
                count = inputs.accumulate * layers * 2 * (c - 1) * (forward + 1)
                add(
                    "collective-permute",
                    CONTEXT,
                    count,
                    local * kv_width,
                    c,
                    "K/V blocks round the ring (forward) and their gradients back (backward)",
                )
            else:
                kv = _exchanged_kv_width(placement, q_width, kv_width, c, tuple(splits))
                add(
                    "all-to-all",
                    CONTEXT,
                    inputs.accumulate * layers * 4 * (forward + 1),
                    local * (q_width + kv) // 2,  # the mean of q, k, v and out
                    c,
                    "q, k, v to a head split and the output back; the same backward",
                )
        if inputs.segment_bytes:  # packed documents: the keys' segment ids, once per micro-batch (forward)
            ids = inputs.tokens_per_device // c * inputs.segment_bytes
            if inputs.form == "ring":
                add(
                    "collective-permute",
                    CONTEXT,
                    inputs.accumulate * (c - 1),
                    ids,
                    c,
                    "segment ids round the ring, once for every layer",
                )
            else:
                add(
                    "all-gather",
                    CONTEXT,
                    inputs.accumulate,
                    c * ids,
                    c,
                    "segment ids of the whole sequences, once for every layer",
                )

    def flows(self, step: Any) -> list[Flow]:
        """One step's context-parallel traffic on one device. Ring: every layer passes its K/V block
        ``cp - 1`` times forward (``collective-permute``) and K/V with their gradients backward (twice),
        again per recomputed forward; each pass hides behind the attention it feeds (scores and values,
        ``4 S D_q`` FLOPs a token), less the overlap tax. All-to-all: Q, K and V to a head split, the
        output back, ``(cp - 1) / cp`` of each, forward and twice backward, exposed."""
        s, lay, cp, e = step, step.layout, step.layout.cp, step.job.act_bytes
        if cp == 1:
            return []
        q, kv = s.shape.heads * s.shape.head_dim, s.shape.kv_heads * s.shape.head_dim
        kv_local = max(
            kv / lay.tp, s.shape.head_dim
        )  # kv heads split over tp (whole heads: repeated below one)
        passes = (3 + s.recompute) * s.per_stage * s.m
        if s.job.context_attention == "all-to-all":
            size = s.tokens_mb * (2 * q / lay.tp + 2 * kv_local) * e
            return [Flow(axis=CONTEXT, op="all-to-all", nbytes=passes * ring_traffic("all-to-all", size, cp),
                         count=4 * passes, stride=s.inner(CONTEXT), size=cp)]  # fmt: skip
        block = s.tokens_mb * 2 * kv_local * e  # K and V of this device's chunk
        attention = passes * 4 * s.shape.seq * q * s.tokens_mb / lay.tp / s.flops_per_s
        return [Flow(axis=CONTEXT, op="collective-permute", count=passes * (cp - 1), stride=s.inner(CONTEXT),
                     nbytes=passes * (cp - 1) * ring_traffic("collective-permute", block, cp), size=cp,
                     window=attention, edge=0.0, one_nic=True)]  # fmt: skip

    def search_degrees(self, shape: Any, cluster: Any, job: Any, devices: int) -> list[int]:
        """cp where ``2 cp`` divides the sequence into chunks of at least ``CONTEXT_MIN_TOKENS`` a device."""
        seq = shape.seq
        return [
            c for c in divisors(devices) if c == 1 or (not seq % (2 * c) and seq // c >= CONTEXT_MIN_TOKENS)
        ]

    def check_layout(self, shape: Any, layout: Any, job: Any) -> str | None:
        cp, tp = layout.cp, layout.tp
        if cp > 1 and shape.seq % (2 * cp):
            return f"cp={cp}: seq {shape.seq} does not split into 2*cp balanced chunks"
        if cp > 1 and job.context_attention == "all-to-all" and shape.heads % (cp * tp):
            return f"cp={cp} all-to-all: heads={shape.heads} do not divide over cp*tp={cp * tp}"
        return None

    def check_run(self, size: int, *, seq_len: int, heads: int, experts: int, form: str) -> None:
        _context.check_context(seq_len, heads, size, form)
        if experts:
            check_whole_sequences(size)


def heads_axis(placement: Placement) -> str | None:
    """The model axis where the tensor-parallel rules split attention heads, or None
    (``_context._on_own_heads``)."""
    split = any(
        a == MODEL and n == "heads"
        for x in placement.flat()
        for n, a in zip(x.names, x.model_spec, strict=False)
    )
    return MODEL if split else None


def _attention_widths(placement: Placement) -> list[tuple[int, int, int, int, int]]:
    """(layers, query width, key/value width, query split, key/value split) per attention projection
    pair of the reference models (leaves ``.../wq`` and ``.../wk``; a scanned model's stacked leaf
    counts its layers), each width a device's: its heads' where tensor parallelism splits them
    (tp+cp; the split is the model axis's size there, else 1)."""
    leaves = {x.path: x for x in placement.flat()}
    m = placement.model_size

    def split(x: LeafPlacement) -> int:
        return m if x.model_spec[-1] == MODEL else 1

    out = []
    for path, wq in leaves.items():
        if path.endswith("wq") and (wk := leaves.get(path[:-2] + "wk")) is not None:
            layers = wq.shape[0] if "layers" in wq.names else 1
            out.append((layers, wq.shape[-1] // split(wq), wk.shape[-1] // split(wk), split(wq), split(wk)))
    return out


def _exchanged_kv_width(
    placement: Placement, q_width: int, kv_width: int, c: int, splits: tuple[int, int]
) -> int:
    """Key/value width all-to-all attention moves (``_context.exchanged_kv_heads``): their own where the
    placement knows the heads (``units``) and a device's kv heads divide over context, else the query
    width (``splits``: how many devices the query and the kv heads are split over by tensor parallelism)."""
    heads, kv_heads = placement.units.get("heads"), placement.units.get("kv_heads")
    if heads is None or kv_heads is None:
        return q_width
    heads, kv_heads = heads // splits[0], kv_heads // splits[1]
    if kv_width * heads != q_width * kv_heads:
        return q_width
    return kv_width * _context.exchanged_kv_heads(heads, kv_heads, c) // kv_heads


PLAN = ContextAxis()
