"""Attention on one device: which implementation runs, and the forms it chooses between.

The reference models attend through ``plans.causal_attention`` (``_context``), which splits the
sequence under context plans and comes here for each device's attention over whole sequences in
their natural order (``causal``). The choice is ``ParallelSpec.attention``
(``spec.ATTENTION_IMPLEMENTATIONS``), in force while a step's loss is traced: ``plans.assemble``
wraps every plan's loss in it (``assemble.attending``), so the peak model and the planner's compile check
trace what trains, and records the kernels the trace used (``Attention.used``, in report.json).

- einsum: scores and softmax written out in at least float32 (float64 stays float64), the T x T
  scores in memory, the key/value heads repeated to one per query head. The form the plans were
  first certified in, and the ring's blocks (``_context._ring``: see there why).
- fused: ``jax.nn.dot_product_attention`` with the key/value heads as they are (it groups the query
  heads, ``(B, T, K, G, h)``: grouped-query attention without a repeat). Its ``implementation=None``
  is XLA's on every platform in jax 0.12 (a TODO in its source), so the platform is chosen here: on
  a GPU, cuDNN's flash attention where it takes the shapes and dtypes (bf16 or fp16, a head width a
  multiple of 8 up to 128, 256 from Hopper on; it refuses the rest when traced, and XLA's runs);
  on a TPU, the Pallas splash kernel (``jax.experimental.pallas.ops.tpu.splash_attention``, where
  this jax has it) for sequences of whole 128-token blocks where no mesh axis is left to the
  partitioner (which cannot split a Pallas call) but a model axis the heads divide over (the kernel
  then runs per device on its heads: ``heads_split``), else XLA's; on a CPU, XLA's.
- auto: a flash kernel where the platform has one that takes the inputs (cuDNN, splash), else
  einsum. jax's XLA implementation is the same written-out attention, with more kept for the
  backward pass (its full-size mask and float32 scores: the planner's compiled GPT layer for the
  1.3 B ranking of ``docs/measurements.md`` came out at 12.20 GB a device beside einsum's 9.68), and
  it casts the scores to float32 before its softmax whatever the input
  (``_dot_product_attention_core``), so a float64 step through it agrees with float64 to float32's
  digits only (``tests/test_attention.py`` measures it). float64 always runs einsum under auto.

Masks: causal always; ``window``: the query at position p sees the keys at p - window + 1 .. p
(Mistral's and Gemma's sliding window; ``local_window_size=(window - 1, 0)``); ``segment_ids``:
``(B, T)`` integers, a query sees the keys of its own segment only (documents packed in one row).

Soft-capping (Gemma 2's ``attn_logit_softcapping``): ``softcap`` bounds each scaled score to
``(-softcap, softcap)`` by ``tanh(s / softcap) * softcap``, before the mask, as transformers' eager
attention does. ``jax.nn.dot_product_attention`` takes no cap (and cuDNN's flash attention none through
it), so a capped attention is written out (einsum) whatever is asked, and the record says so.

Sinks (GPT-OSS's ``sinks``): one learned logit per query head joins each query's softmax as a key with no
value (``softmax([s, sink])`` without its last column), so a query may attend to less than all of its keys.
No fused call takes one: an attention with sinks is written out too.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshkit.spec import ATTENTION_IMPLEMENTATIONS, MODEL, PlanError, one_of


@dataclass(frozen=True, kw_only=True, slots=True)
class Attention:
    """The implementation asked for while a loss traces, and the kernels its attention used (the
    record ``in_force`` holds)."""

    requested: str = "auto"
    platform: str | None = None
    """The platform the step is compiled for (its mesh's devices: a TPU target's from a CPU machine); None:
    JAX's default backend."""
    devices: int | None = None
    """The devices the step is compiled for (its mesh's: a TPU slice's from a CPU machine); None: JAX's."""
    used: set[str] = field(default_factory=set)
    """Kernels traced: 'einsum', 'xla', 'cudnn', 'splash' (the ring's blocks count as einsum)."""


_CHOICE: contextvars.ContextVar[Attention | None] = contextvars.ContextVar("meshkit_attention", default=None)


def check_implementation(name: str) -> None:
    if name not in ATTENTION_IMPLEMENTATIONS:
        raise PlanError(f"unknown attention {name!r}: choose {one_of(ATTENTION_IMPLEMENTATIONS)}")


@contextlib.contextmanager
def use_attention(name: str) -> Iterator[Attention]:
    """Attention traced inside the block runs as ``name``; the record says which kernels it used."""
    check_implementation(name)
    with in_force(Attention(requested=name)) as record:
        yield record


@contextlib.contextmanager
def in_force(record: Attention) -> Iterator[Attention]:
    """``record`` (its choice, and where the kernels traced are noted) in force inside the block."""
    token = _CHOICE.set(record)
    try:
        yield record
    finally:
        _CHOICE.reset(token)


def _record() -> Attention:
    return _CHOICE.get() or Attention()


def note(kernel: str) -> None:
    """Record that attention traced through ``kernel`` (report.json's ``attention_kernels``)."""
    _record().used.add(kernel)


def _wanted(dtype: Any) -> tuple[bool, bool]:
    """Under the choice in force, for inputs of ``dtype``: (try the fused call, fall back to XLA's
    implementation of it where no flash kernel takes the inputs; else to the written-out form)."""
    name = _record().requested
    if name == "auto":
        return jnp.dtype(dtype) != jnp.float64, False
    return name == "fused", True


def check_softcap(softcap: Any) -> None:
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, int | float) or not 0 < softcap < math.inf
    ):
        raise PlanError(f"softcap must be a number above 0 (or None: no cap), got {softcap!r}")


def check_window(window: Any) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise PlanError(
            f"window must be a whole number of tokens of at least 1 (or None: the whole causal past), got {window!r}"
        )


def allowed(q_pos: Any, k_pos: Any, window: int | None = None) -> jax.Array:
    """``(1, 1, t, s)``: which keys (global positions ``k_pos``) each query (``q_pos``) sees: its past and
    itself, the last ``window`` of them where given."""
    q, k = jnp.asarray(q_pos)[:, None], jnp.asarray(k_pos)[None, :]
    ok = q >= k
    if window is not None:
        ok = ok & (q - k < window)
    return ok[None, None]


def same_segment(segment_ids: jax.Array) -> jax.Array:
    """``(B, 1, T, T)``: query and key in the same segment."""
    return segment_ids[:, None, :, None] == segment_ids[:, None, None, :]


def causal(
    q_bthk: jax.Array,
    k_bskh: jax.Array,
    v_bskh: jax.Array,
    *,
    window: int | None = None,
    segment_ids: jax.Array | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal attention ``(B, T, H, h)`` over whole sequences in their natural order, ``H / K`` query heads
    per key/value head, by the implementation in force (the module docstring); with ``softcap`` or
    ``sinks`` ``(H,)``, written out (the fused call takes neither)."""
    check_window(window)
    check_softcap(softcap)
    t = q_bthk.shape[1]
    if segment_ids is not None and segment_ids.shape != q_bthk.shape[:2]:
        raise PlanError(
            f"segment_ids must be (batch, sequence) = {q_bthk.shape[:2]}, one id per token, got {segment_ids.shape}"
        )
    fused, xla = _wanted(q_bthk.dtype)
    fused = fused and softcap is None and sinks is None
    out, kernel = _fused(q_bthk, k_bskh, v_bskh, window, segment_ids, xla) if fused else (None, None)
    if out is None:
        mask = allowed(np.arange(t), np.arange(k_bskh.shape[1]), window)
        if segment_ids is not None:
            mask = mask & same_segment(segment_ids)
        out, kernel = einsum_attention(q_bthk, k_bskh, v_bskh, mask, softcap, sinks), "einsum"
    note(kernel)
    return out


def wide(dtype: Any) -> jnp.dtype:
    return jnp.promote_types(dtype, jnp.float32)


def repeat_kv(x_bskh: jax.Array, heads: int) -> jax.Array:
    """Grouped key/value heads repeated to ``heads`` (kv head j serves query heads ``j g .. j g + g - 1``,
    as ``jax.nn.dot_product_attention`` groups them)."""
    groups = heads // x_bskh.shape[2]
    return x_bskh if groups == 1 else jnp.repeat(x_bskh, groups, axis=2)


def capped_scores(q_bthk: jax.Array, k_bshk: jax.Array, softcap: float | None = None) -> jax.Array:
    """``(B, H, T, S)`` scaled scores in at least float32 (key heads one per query head), capped to
    ``(-softcap, softcap)`` where given: the einsum form's and the ring's blocks'."""
    w = wide(q_bthk.dtype)
    s = jnp.einsum("bthk,bshk->bhts", q_bthk, k_bshk, preferred_element_type=w) / math.sqrt(q_bthk.shape[-1])
    return s if softcap is None else jnp.tanh(s / softcap) * softcap


def einsum_attention(
    q_bthk: jax.Array,
    k_bskh: jax.Array,
    v_bskh: jax.Array,
    mask: jax.Array,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention written out where ``mask`` (broadcast to ``(B, H, T, S)``) allows: scores (``softcap``
    applied) and softmax in at least float32, the probabilities and the result in q's dtype; ``sinks``
    ``(H,)``: each head's logit in every softmax, with no value (``sink_softmax``)."""
    heads = q_bthk.shape[2]
    k, v = repeat_kv(k_bskh, heads), repeat_kv(v_bskh, heads)
    w = wide(q_bthk.dtype)
    s = jnp.where(mask, capped_scores(q_bthk, k, softcap), jnp.finfo(w).min)
    probs = sink_softmax(s, None if sinks is None else sinks[:, None]).astype(q_bthk.dtype)
    return jnp.einsum("bhts,bshk->bthk", probs, v)


def sink_softmax(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """The softmax over the last axis of ``scores``, or with ``sinks`` (broadcasting against ``scores`` less
    its last axis) of ``[scores, sink]`` less the sink's column, as GPT-OSS's eager attention computes it."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    sink = jnp.broadcast_to(sinks.astype(scores.dtype), scores.shape[:-1])[..., None]
    return jax.nn.softmax(jnp.concatenate([scores, sink], -1), axis=-1)[..., :-1]


def _fused(q, k, v, window, segment_ids, xla: bool) -> tuple[jax.Array | None, str | None]:
    """The platform's fused attention and the kernel's name (the module docstring says which); where
    no flash kernel takes the inputs, XLA's implementation if ``xla``, else ``(None, None)``."""
    platform = _record().platform or jax.default_backend()
    if platform == "tpu":
        out = splash(q, k, v, window=window, segment_ids=segment_ids)
        if out is not None:
            return out, "splash"
    mask = None if segment_ids is None else same_segment(segment_ids)
    local = None if window is None else (window - 1, 0)
    call = functools.partial(
        jax.nn.dot_product_attention, q, k, v, mask=mask, is_causal=True, local_window_size=local
    )
    if platform == "gpu":
        try:
            return call(implementation="cudnn"), "cudnn"
        except (NotImplementedError, RuntimeError, ValueError, TypeError):
            pass  # shapes, dtypes or a GPU cuDNN's flash attention does not take
    return (call(implementation="xla"), "xla") if xla else (None, None)


def _splash_module() -> Any:
    """jax's splash attention (Pallas, TPU), or None where this jax lacks it."""
    try:
        from jax.experimental.pallas.ops.tpu import splash_attention
    except ImportError:
        return None
    return splash_attention


def splash_block(t: int) -> int | None:
    """The splash kernel's block for a sequence of ``t`` tokens: the largest of 512, 256, 128 dividing it."""
    return next((b for b in (512, 256, 128) if t % b == 0), None)


def _partitioned() -> bool:
    """Whether a mesh axis of more than one device is left to the partitioner where attention traces (or
    several devices and no mesh in force): a Pallas call then cannot be split, XLA's attention can."""
    try:
        from jax.sharding import AxisType, get_abstract_mesh

        mesh = get_abstract_mesh()
        if mesh.empty:  # the step's own devices (a target slice's), else this process's
            devices = _record().devices
            return (jax.device_count() if devices is None else devices) > 1
        kinds = zip(mesh.axis_sizes, mesh.axis_types, strict=True)
        return any(size > 1 and kind != AxisType.Manual for size, kind in kinds)
    except (ImportError, AttributeError):  # an older jax: not known, so not split by hand
        return True


def heads_split(heads: int, kv_heads: int) -> int | None:
    """How a Pallas kernel's heads are split where attention traces: 1 where no mesh axis is left to the
    partitioner; the model axis's size where it is the only one left and both head counts divide over
    it (the kernel then runs in a ``shard_map`` over that axis, each device on the heads tensor
    parallelism gave it, as MaxText runs its flash kernels); None otherwise (the partitioner cannot
    split a Pallas call)."""
    if not _partitioned():
        return 1
    from jax.sharding import AxisType, get_abstract_mesh

    mesh = get_abstract_mesh()
    left = {
        name: size
        for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types, strict=True)
        if size > 1 and kind != AxisType.Manual
    }
    m = left.get(MODEL)
    if mesh.empty or set(left) != {MODEL} or heads % m or kv_heads % m:
        return None
    return m


def splash(q, k, v, *, window=None, segment_ids=None, interpret: bool = False) -> jax.Array | None:
    """Splash attention (queries scaled first: the kernel does not scale), or None where it does not
    apply: no kernel in this jax, query and key lengths differ, a sequence not in whole 128-token
    blocks, or a mesh axis left to the partitioner that is not a model axis the heads divide over
    (``heads_split``; ``interpret``: the kernel run by the Pallas interpreter, on any platform, for the
    tests, whole where no mesh says how to split it)."""
    t = q.shape[1]
    block = splash_block(t)
    split = heads_split(q.shape[2], k.shape[2])
    split = 1 if split is None and interpret else split
    if _splash_module() is None or block is None or k.shape[1] != t or split is None:
        return None
    run = functools.partial(_splash, window=window, block=block, interpret=interpret)
    if split == 1:
        return run(q, k, v, segment_ids)
    from jax.sharding import PartitionSpec as P

    heads, whole = P(None, None, MODEL, None), P()
    ids = () if segment_ids is None else (segment_ids,)
    local = jax.shard_map(
        lambda q, k, v, *ids: run(q, k, v, ids[0] if ids else None),
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(heads, heads, heads, *(whole,) * len(ids)),
        out_specs=heads,
        axis_names={MODEL},
        check_vma=False,
    )
    return local(q, k, v, *ids)


def _splash(q, k, v, segment_ids, *, window, block, interpret) -> jax.Array:
    """The splash kernel on whole heads of ``q, k, v`` ``(B, T, H, h)``."""
    mod = _splash_module()
    t, heads = q.shape[1], q.shape[2]
    kernel = _splash_kernel(heads, t, window, block, interpret)
    scale = 1.0 / math.sqrt(q.shape[-1])
    qh, kh, vh = ((q * scale).astype(q.dtype).swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2))
    if segment_ids is None:
        out = jax.vmap(kernel)(qh, kh, vh)
    else:
        ids = segment_ids.astype(jnp.int32)
        out = jax.vmap(lambda a, b, c, s: kernel(a, b, c, segment_ids=mod.SegmentIds(q=s, kv=s)))(
            qh, kh, vh, ids
        )
    return out.swapaxes(1, 2)


@functools.lru_cache(maxsize=32)
def _splash_kernel(heads: int, t: int, window: int | None, block: int, interpret: bool) -> Any:
    """One splash kernel per (heads, sequence, window, block): the causal or local mask, per query head.
    Cached across traces, so its mask arrays are made outside any (a kernel made inside a jit trace
    holds that trace's tracers: the next trace's compiled step then asks for arguments it is not given)."""
    mod = _splash_module()
    shape = (t, t)
    one = (
        mod.CausalMask(shape)
        if window is None
        else mod.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    )
    sizes = mod.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    extra = {"interpret": True} if interpret else {}
    # concrete mask arrays, not the tracers of the trace that asked first
    with jax.ensure_compile_time_eval():
        return mod.make_splash_mha(
            mod.MultiHeadMask([one] * heads), block_sizes=sizes, head_shards=1, q_seq_shards=1, **extra
        )
