"""The expert axis (plans ``ep``, ``dp+ep``, ``fsdp+ep``, ``tp+ep``...): a mixture of experts' experts
split over it, and the batch's rows too.

The technique is ``plans._experts`` (routing, capacity, the all_to_alls). From its row
(``AxisRule.splits = "rows"``, ``logical = "expert"``) follow the leaves' expert dims split over the
axis, the batch's rows split over it, and each dense leaf's gradient summed over it (an expert leaf's is
already whole per device). Here: the expert split in force while the step traces the loss (it records
each MoE layer's dispatched rows for the ledger), and the ledger's rows: the all_to_alls and, under
tensor parallelism, the experts' own Megatron all-reduces.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from meshkit.analysis.cost import ring_traffic
from meshkit.plans import _experts
from meshkit.plans.axes._base import Add, AxisPlan, Flow, LedgerInputs, divisors
from meshkit.plans.memory import experts_beyond_device
from meshkit.plans.placement import Placement
from meshkit.spec import EXPERT, MODEL


class ExpertAxis(AxisPlan):
    axis = EXPERT

    @contextlib.contextmanager
    def tracing(self, placement: Placement, per: Any, form: str) -> Iterator[None]:
        with _experts.split_experts(self.size(placement)) as split:
            yield
        # the ledger's: the last MoE layer's rows (bytes per device), whether dropless, its top-k
        per.experts = (split.rows[-1], bool(split.dropless), split.k[-1]) if split.rows else ()

    def ledger(self, add: Add, inputs: LedgerInputs) -> None:
        """Per MoE layer and micro-batch with E devices on the expert axis: 2 all_to_alls forward
        (dispatch, combine) and their 2 transposes backward (the forward's again under remat), each
        ``(E-1)/E x S`` per device with ``S = B_local x experts x capacity x width`` elements (the
        chapter's rearranging collectives); dropless, one all-gather of the group's tokens and one
        reduce-scatter of their outputs forward, and their transposes backward, each of
        ``S = E x B_local x T x width``. Under tensor parallelism the experts' matmuls on their ``S``
        rows (each device's E/N experts, N B_local C rows each) add the Megatron all-reduces over model:
        a row-parallel expert matrix its output's partial sums forward, a column-parallel one its input
        gradient's backward, each ``S`` bytes. MoE layers: those whose leaves hold experts (a dense MLP's
        layer among them, Qwen3-MoE's ``mlp_only_layers``, dispatches nothing)."""
        placement, per_layer, accumulate = inputs.placement, inputs.per_layer, inputs.accumulate
        e, m = self.size(placement), placement.model_size
        if per_layer is None or not per_layer.experts:
            return
        layers = _moe_layers(per_layer.found, placement)
        rows, dropless = per_layer.experts[0], per_layer.experts[1]
        forward = 1 if per_layer.remat == "none" else 2
        if e > 1 and dropless:  # the group's tokens gathered, the outputs reduce-scattered back: remat redoes
            # the gather, not the scatter, whose output only joins the residual sum (``_fsdp.tp_matrices``)
            count = (forward + 1) * layers * accumulate
            add("all-gather", EXPERT, count, e * rows, e, "MoE tokens of the expert group (dropless)")
            add(
                "reduce-scatter",
                EXPERT,
                2 * layers * accumulate,
                e * rows,
                e,
                "MoE outputs back to their tokens (dropless)",
            )
        elif e > 1:
            add(
                "all-to-all",
                EXPERT,
                2 * (forward + 1) * layers * accumulate,
                rows,
                e,
                "MoE rows to their experts and back (forward and backward)",
            )
        if m <= 1:
            return
        if dropless:  # the experts multiply every gathered token's k slots
            rows = e * rows * per_layer.experts[2]
        for x in placement.flat():
            if EXPERT in x.model_spec and len(x.shape) >= 3 and MODEL in x.model_spec[-2:]:
                row = x.model_spec[-2] == MODEL  # (E, F, D) with F on model: the MLP's output matrix
                uses = x.shape[0] if "layers" in x.names else 1
                add(
                    "all-reduce",
                    MODEL,
                    accumulate * uses,
                    rows,
                    m,
                    f"{x.path}: expert {'forward output' if row else 'backward input-gradient'} partial sums",
                )

    def flows(self, step: Any) -> list[Flow]:
        """One step's expert-parallel traffic on one device, exposed: per MoE layer, the tokens dispatched
        to their experts and combined back (``k x capacity_factor`` copies of each token's activation,
        ``(ep - 1) / ep`` of them leaving the device), forward, their gradients backward, again per
        recomputed forward; dropless (``capacity_factor`` 0) the group's tokens gathered and the outputs
        reduce-scattered (the same bytes in a ring), as often."""
        s, ep = step, step.layout.ep
        if ep == 1:
            return []
        split = s.job.sequence_split(s.layout)  # the tokens a tensor-parallel rank dispatches
        count = (
            2 * (2 + s.recompute) * s.per_stage * s.m
        )  # dispatch and combine: forward, backward, recomputed
        tokens = s.tokens_mb * s.shape.width * s.job.act_bytes / split
        if s.shape.capacity_factor:
            op, size = "all-to-all", tokens * s.shape.routed * s.shape.capacity_factor
        else:  # dropless: the expert group's tokens gathered, the outputs reduce-scattered back (``_experts``)
            op, size = "all-gather", tokens * ep
        return [Flow(axis=EXPERT, op=op, nbytes=count * ring_traffic(op, size, ep), count=count,
                     stride=s.inner(EXPERT), size=ep)]  # fmt: skip

    def search_degrees(self, shape: Any, cluster: Any, job: Any, devices: int) -> list[int]:
        """ep dividing a mixture of experts' experts (1 for a dense model)."""
        return [p for p in divisors(devices) if p == 1 or (shape.experts and not shape.experts % p)]

    def check_layout(self, shape: Any, layout: Any, job: Any) -> str | None:
        ep = layout.ep
        if ep > 1 and not shape.experts:
            return f"ep={ep}: {shape.name} has no experts (a dense MLP)"
        if ep > 1 and shape.experts % ep:
            return f"ep={ep} does not divide experts={shape.experts}"
        return None

    def held_beyond_device(self, placement: Placement, sizes: list[float], per: Any, *, zero3: bool) -> float:
        """The experts beyond a device's own whose gradients the one-device compile holds
        (``memory.experts_beyond_device``): one layer's, or every layer's under zero3, whose per-layer
        barriers keep them all alive there. None for a dropless mixture, which ``plans.peak`` compiles on
        the expert axis's devices, each with its own experts."""
        found = per.found
        if found is None or not found.per_layer or per.experts[1:2] == (True,):
            return 0.0
        experts = sum(
            size for size, leaf in zip(sizes, placement.flat(), strict=True) if EXPERT in leaf.model_spec
        )
        held = found.layers if zero3 else 1
        return held * experts_beyond_device(experts / found.layers, self.size(placement))


PLAN = ExpertAxis()


def _moe_layers(found: Any, placement: Placement) -> int:
    """Layer applications per forward pass that route tokens to experts: every scan iteration, or each
    marked layer whose leaves hold an expert dim (1 where the loss has no layers meshkit can find)."""
    if found is None or not found.per_layer:
        return 1
    if found.mode == "scan":
        return found.layers
    flat = placement.flat()
    return sum(any(_experts.EXPERT_DIM in flat[i].names for i in group) for group in found.groups)
