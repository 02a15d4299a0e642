"""One command that says how meshkit trains on the accelerator it runs on, as one table and one JSON.

Nothing of meshkit had been measured on a GPU or TPU. This trains a Llama (random tokens, AdamW,
fp32 master weights, the platform's precision: bf16 compute on GPUs and TPUs) under fsdp over every
device present and sets beside each other:

- meshkit's step (``meshkit.train.Trainer``, attention fused: ``plans.attention``) and a hand-written
  ``jax.jit`` step of the same model, loss and optax optimizer (no meshkit plan code: the Llama's
  pieces under ``lax.scan``, the parameters on every device and the batch split over them, which on
  one device is what fsdp over one computes): tokens/s, the ratio of their step times (the issue's
  bar: within 1.05x), and their first losses (equal);
- MFU: the model's FLOPs per token (``llama.flops_per_token``, attention included) x tokens/s over the
  devices' peak (``planner.hardware.peak_flops``: the table's figure at the run's precision; none on a CPU);
- peak memory per device: the compiled step's ``memory_analysis()`` (arguments + temporaries) and the
  device's own ``peak_bytes_in_use`` where it reports one, beside meshkit's peak model
  (``plans.peak.predict_peak``, the loss's activations compiled on the device);
- fused vs einsum attention (meshkit's step with ``attention="einsum"``): tokens/s and first losses;
- the profile's exposed-communication fraction (``Trainer.profile``, ``analysis.trace``): n/a where the
  trace cannot be taken or read (one device moves nothing: its fraction is 0).

The model is the largest of ``SIZES`` (or ``--size``) whose step a first-pass estimate (``_estimate``:
16 bytes a parameter and the activations; the planner's model of meshkit's step compiles a GPT layer
with its T x T scores, no fused kernel) puts within 90% of a device's memory, with the first batch
and remat policy of ``LAYOUTS`` that fits; a compile that still runs out of memory steps down to the
next. The target:
one TPU v5e (15.7 GiB): a 1 B Llama with fp32 AdamW (16 bytes a parameter) does not fit there.
``--size tiny`` runs on a CPU in seconds (``tests/test_device_check.py``, so that it cannot rot).

It imports only the model, the Trainer and what they need (jax, numpy, optax, rich), and runs
under Python 3.11 and JAX 0.10 (the TPU machine's) as well as the project's own. Run::

    python benchmarks/device_check.py --out device_check.json [--size auto] [--minutes 8]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from meshkit.models import llama
from meshkit.plans import use_attention
from meshkit.spec import PLATFORM_PRECISION, PRECISIONS

#: Llama shapes by name (vocab 32000 and 128-wide heads on the accelerator sizes; ``1.1b`` is TinyLlama's).
SIZES = {
    "tiny": {"vocab_size": 256, "layers": 2, "width": 64, "heads": 4, "kv_heads": 2, "ffn": 128},
    "0.25b": {"vocab_size": 32000, "layers": 16, "width": 1024, "heads": 8, "kv_heads": 4, "ffn": 2816},
    "0.5b": {"vocab_size": 32000, "layers": 16, "width": 1536, "heads": 12, "kv_heads": 4, "ffn": 4096},
    "0.7b": {"vocab_size": 32000, "layers": 12, "width": 2048, "heads": 16, "kv_heads": 8, "ffn": 5632},
    "0.9b": {"vocab_size": 32000, "layers": 16, "width": 2048, "heads": 16, "kv_heads": 8, "ffn": 5632},
    "1.1b": {"vocab_size": 32000, "layers": 22, "width": 2048, "heads": 32, "kv_heads": 4, "ffn": 5632},
}
#: (remat, sequences per device) in the order tried: the most tokens a step without recompute first
LAYOUTS = [("none", 8), ("none", 4), ("dots", 8), ("dots", 4), ("dots", 3), ("none", 2), ("dots", 2), ("layer", 4),
           ("layer", 2), ("none", 1), ("layer", 1)]  # fmt: skip
FIT = 0.9
"""The share of a device's memory the predicted peak may take."""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = _arguments(argv)
    if a.target is not None:
        return _compile_for_target(a)
    if a.sampler:  # issue 50's measurement on the chip, one prepared command (bench_sampler.py beside this)
        import bench_sampler

        out = bench_sampler.main(["--against", "hand", "--dtype", "bfloat16", "--json", a.out])
        print(f"wrote {a.out}")
        return out
    # issue 53's fused head: whole logits against pieces at a 128 k vocabulary (bench_loss_chunk.py)
    if a.loss_chunk:
        import bench_loss_chunk

        return bench_loss_chunk.main(["--run", "--shape", "16,1024,8,4,2816", "--chunks", "0,512", "--batches",
                                      "4,8", "--out", a.out])  # fmt: skip
    # issue 53's variants of the 0.7 B Llama's step at batch 3, side by side: bf16, int8, Muon, the head in pieces
    if a.variants:
        import bench_variants

        return bench_variants.main(["--out", a.out])
    # issue 53's int8 training: bf16 and int8 side by side at the 0.7 B Llama's batch 3 (bench_quantize.py),
    # then both trained 300 steps on text
    if a.quantize:
        import bench_quantize

        speed = bench_quantize.main(["--size", "0.7b", "--batch", "3", "--remat", "dots", "--out", a.out])
        converge = bench_quantize.main(["--size", "0.7b", "--seq", "512", "--batch", "8", "--remat", "dots",
                                        "--converge", "300", "--out", a.out.replace(".json", "-converge.json")])  # fmt: skip
        return {"speed": speed, "converge": converge}
    start = time.perf_counter()
    budget = a.minutes * 60
    platform, n = jax.default_backend(), jax.device_count()
    precision = a.precision or PLATFORM_PRECISION.get(platform, PLATFORM_PRECISION["cpu"])
    seq = a.seq or (64 if a.size == "tiny" else 2048)
    limit = _memory_limit()
    choices, candidates = _candidates(a, seq, n, precision, limit, platform)
    out: dict[str, Any] = {"platform": platform, "device_kind": jax.devices()[0].device_kind, "devices": n,
                           "jax": jax.__version__, "python": sys.version.split()[0], "precision": precision,
                           "seq": seq, "memory_limit_bytes": limit, "choices": choices, "plan": "fsdp"}  # fmt: skip
    for size, remat, per_device in candidates:
        cfg = _config(size, seq, precision)
        batch = per_device * n
        try:
            out |= _check(a, cfg, size, batch, remat, precision, start, budget)
            break
        except Exception as e:  # out of memory at compile or run: the next candidate
            if not _oom(e):
                raise
            print(f"{size} batch {batch} remat {remat}: out of memory ({_first_line(e)}); trying the next")
            gc.collect()
    else:
        raise SystemExit("no candidate fits on this device: give a smaller --size or --seq")
    out["elapsed_s"] = time.perf_counter() - start
    _print_table(out)
    Path(a.out).write_text(json.dumps(out, indent=2, default=float))
    print(f"wrote {a.out}")
    return out


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="meshkit on this accelerator: one table, one JSON.")
    p.add_argument("--out", default="device_check.json", help="where the JSON goes")
    p.add_argument("--size", default="auto", choices=["auto", *SIZES], help="auto: the largest that fits")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (2048; tiny: 64)")
    p.add_argument("--batch", type=int, default=None, help="sequences per device (default: chosen)")
    p.add_argument("--remat", default=None, help="remat policy (default: chosen)")
    p.add_argument("--precision", default=None, choices=list(PRECISIONS), help="default: by platform")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the compile")
    p.add_argument("--minutes", type=float, default=8.0, help="budget: later parts are skipped past it")
    p.add_argument(
        "--target", default=None, help="compile only, for this TPU topology (v5e:1x1) with libtpu here"
    )
    p.add_argument(
        "--sampler",
        action="store_true",
        help="only the sampler: meshkit's generate against a hand-written decode loop (bench_sampler.py), "
        "32 prompts x 128 tokens of a 1.1 B Llama in bf16",
    )
    p.add_argument(
        "--loss-chunk",
        action="store_true",
        help="only the head in pieces (bench_loss_chunk.py --run): a 0.25 B Llama with a 128 k vocabulary",
    )
    p.add_argument(
        "--quantize",
        action="store_true",
        help="only int8 training beside bf16 (bench_quantize.py): the 0.7 B Llama's speed at batch 3, then "
        "300 steps of each on text",
    )
    p.add_argument(
        "--variants",
        action="store_true",
        help="only the 0.7 B Llama's step at batch 3 in bf16, int8, with Muon and with the head in pieces, "
        "side by side (bench_variants.py)",
    )
    return p.parse_args(argv)


def _config(size: str, seq: int, precision: str) -> llama.LlamaConfig:
    return llama.LlamaConfig(
        **SIZES[size], seq_len=seq, compute_dtype=PRECISIONS[precision], scan_layers=True
    )


def _memory_limit() -> float | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return float(stats["bytes_limit"]) if stats.get("bytes_limit") else None


def _candidates(a, seq: int, n: int, precision: str, limit: float | None, platform: str) -> tuple[list, list]:
    """Every (size, remat, batch) with its estimated peak (``_estimate``), and those that fit, in the
    order to try: the largest size first, then ``LAYOUTS``' order; a layout asked for (``--remat`` and
    ``--batch``) is tried whatever the first-pass estimate says, the compile deciding."""
    sizes = [a.size] if a.size != "auto" else [s for s in reversed(SIZES) if s != "tiny"]
    layouts = [(r, b) for r, b in LAYOUTS if (a.remat in (None, r)) and (a.batch in (None, b))]
    if a.remat is not None and a.batch is not None:
        layouts = [(a.remat, a.batch)]
    choices, fits = [], []
    for size in sizes:
        cfg = _config(size, seq, precision)
        for remat, per_device in layouts:
            peak = _estimate(cfg, per_device * seq, remat, precision, platform in ("gpu", "tpu"))
            asked = a.remat is not None and a.batch is not None  # a layout asked for: its compile decides
            ok = limit is None or peak <= FIT * limit or asked
            choices.append({"size": size, "params": _params(cfg), "remat": remat, "batch_per_device": per_device,
                            "estimated_peak_bytes": peak, "fits": ok})  # fmt: skip
            if ok:
                fits.append((size, remat, per_device))
    return choices, fits


def _estimate(cfg, tokens: int, remat: str, precision: str, flash: bool) -> float:
    """A first-pass peak per device, to choose what to compile: 16 bytes a parameter (fp32 parameters,
    gradients and AdamW's two moments) and the activations one device's ``tokens`` keep (per layer
    and token, in the compute dtype: ``none`` the norms' and matmuls' inputs, Q/K/V/out and the
    gated MLP's three; ``dots`` the matmul outputs; ``layer`` the layer's input, and one layer's full
    set again for its recompute; the T x T scores unless a flash kernel runs), and the float32 logits
    three times (value, exponentials, gradient). The compiled peak model (``plans.peak``) is
    reported for the chosen one, beside what was measured."""
    e = 4 if PRECISIONS[precision] is None else 2
    d, f, q, kv = cfg.width, cfg.ffn, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    full = e * (4 * d + 2 * q + 2 * kv + 3 * f) + (0 if flash else 2 * 4 * cfg.heads * cfg.seq_len)
    kept = {"none": full, "dots": e * (d + 2 * q + 2 * kv + 2 * f), "layer": e * d}[remat]
    working = full if remat != "none" else 0
    return 16 * _params(cfg) + tokens * (cfg.layers * kept + working + 3 * 4 * cfg.vocab_size)


def _params(cfg) -> int:
    return sum(
        math.prod(x.shape) for x in jax.tree.leaves(jax.eval_shape(llama.init, jax.random.key(0), cfg))
    )


def _host_params(cfg) -> Any:
    """Initial parameters as host arrays (made on the CPU: the devices then hold one copy per variant)."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        params = llama.init(jax.random.key(0), cfg)
    return jax.tree.map(np.asarray, params)


def _tokens(cfg, batch: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(batch, cfg.seq_len + 1), dtype=np.int32)
    return ids[:, :-1], ids[:, 1:]


def _check(a, cfg, size: str, batch: int, remat: str, precision: str, start: float, budget: float) -> dict:
    """Every variant on one model and batch; later ones skipped once ``budget`` seconds have passed."""
    params, tokens = _host_params(cfg), _tokens(cfg, batch)
    optimizer = optax.adamw(1e-4)
    flops = llama.flops_per_token(cfg, cfg.seq_len)
    peak_flops, peak_source = _peak_flops(precision)
    runs: dict[str, Any] = {}
    try:
        runs["meshkit_fused"], memory, profile = _meshkit(
            a, cfg, params, tokens, optimizer, remat, precision, "fused"
        )
    except Exception as e:
        if _oom(e):
            raise  # the candidate does not fit: the caller tries the next
        runs["meshkit_fused"], memory, profile = {"error": _error(e)}, {}, {}
    gc.collect()  # each variant's arrays freed before the next is placed
    left = lambda: budget - (time.perf_counter() - start)  # noqa: E731
    runs["hand_fused"] = (
        _guarded(_hand, a, cfg, params, tokens, optimizer, remat) if left() > 0 else _skipped()
    )
    gc.collect()
    einsum = lambda *x: _meshkit(*x)[0]  # noqa: E731
    runs["meshkit_einsum"] = (
        _guarded(einsum, a, cfg, params, tokens, optimizer, remat, precision, "einsum")
        if left() > 0
        else _skipped()
    )
    n = jax.device_count()
    pair = (runs["meshkit_fused"], runs["meshkit_einsum"])
    if _oom_error(runs["meshkit_einsum"]) and left() > 0 and batch > n:
        # einsum keeps the T x T scores: compare the two attentions at one sequence per device instead
        small = tuple(x[:n] for x in tokens)
        pair = tuple(_guarded(einsum, a, cfg, params, small, optimizer, remat, precision, kind)
                     for kind in ("fused", "einsum"))  # fmt: skip
        runs["meshkit_fused_small"], runs["meshkit_einsum_small"] = pair
    for r in runs.values():
        if "tokens_per_s" in r:
            r["mfu"] = None if peak_flops is None else r["tokens_per_s"] * flops / (n * peak_flops)
    fused, hand = runs["meshkit_fused"], runs["hand_fused"]
    return {
        "size": size, "params": _params(cfg), "model": {k: getattr(cfg, k) for k in SIZES[size]},
        "batch": batch, "remat": remat, "mesh": {"data": n}, "model_flops_per_token": flops,
        "peak_flops_per_device": peak_flops, "peak_source": peak_source, "mfu": fused.get("mfu"), "runs": runs,
        "meshkit_over_hand_step_time": _ratio(fused, hand), "einsum_over_fused_step_time": _ratio(pair[1], pair[0]),
        "attention_compared_at_batch": len(tokens[0]) if pair[0] is fused else n,
        "loss_meshkit_vs_hand": _loss_gap(fused, hand), "loss_fused_vs_einsum": _loss_gap(*pair),
        "memory": memory, "exposed_communication_fraction": profile.get("fraction"),
        "exposed_communication_note": profile.get("note"),
    }  # fmt: skip


def _peak_flops(precision: str) -> tuple[float | None, str]:
    from meshkit.planner.hardware import peak_flops

    return peak_flops(jax.devices()[0].device_kind, precision)


def _meshkit(a, cfg, params, tokens, optimizer, remat, precision, attention) -> tuple[dict, dict, dict]:
    """meshkit's fsdp step: timed, its memory beside the peak model, and (fused) its profile."""
    from meshkit.train.trainer import Trainer

    loss_fn = llama.make_loss(cfg)
    t = Trainer(loss_fn, params, optimizer, plan="fsdp", mesh=f"data={jax.device_count()}", remat=remat,
                compute_dtype=PRECISIONS[precision], attention=attention, logical_axes=llama.logical_axes(params),
                units=llama.units(cfg), tokens_per_example=cfg.seq_len)  # fmt: skip
    placed = t.put_batch(tokens)
    begin = time.perf_counter()
    compiled = t.compiled(placed)
    compile_s = time.perf_counter() - begin
    run = _timed(lambda: t.step(placed)["loss"], lambda: t.params, a.warmup, a.steps, cfg, len(tokens[0]))
    run |= {"compile_s": compile_s, "attention": attention, "kernels": sorted(t.assembled.attention.used)}
    memory, profile = (
        ({}, {}) if attention != "fused" else (_memory(t, compiled, params, tokens), _profile(t, placed))
    )
    return run, memory, profile  # (the caller collects the trainer's arrays before the next variant)


def _hand_loss(cfg, remat: str) -> Any:
    """The Llama's loss written out from its pieces: embedding, a ``lax.scan`` over the stacked blocks
    (each under ``jax.checkpoint`` with remat's policy, as meshkit's remat does per layer), head,
    cross-entropy."""
    pieces = llama.stages(cfg)
    block = pieces.block
    if remat != "none":
        policy = (
            jax.checkpoint_policies.dots_saveable
            if remat == "dots"
            else jax.checkpoint_policies.nothing_saveable
        )
        block = jax.checkpoint(block, policy=policy, prevent_cse=False)

    def loss(params, batch):
        top = {k: v for k, v in params.items() if k != "blocks"}
        x = jax.lax.scan(lambda h, p: (block(p, h), None), pieces.embed(top, batch), params["blocks"])[0]
        return pieces.loss(pieces.head(top, x), batch)

    return loss


def _hand(a, cfg, params, tokens, optimizer, remat) -> dict:
    """The same model, loss and optimizer in a plain ``jax.jit`` step: the parameters on every device,
    the batch split over them (on one device, what fsdp over one computes)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    loss_fn = _hand_loss(cfg, remat)

    def step(p, s, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    state = {"p": jax.device_put(params, NamedSharding(mesh, P()))}
    state["s"] = jax.jit(optimizer.init)(state["p"])
    batch = jax.device_put(tokens, NamedSharding(mesh, P("data")))
    begin = time.perf_counter()
    with use_attention("fused") as record:  # as meshkit's fused run: the platform's kernel
        step = jax.jit(step, donate_argnums=(0, 1)).lower(state["p"], state["s"], batch).compile()
    compile_s = time.perf_counter() - begin

    def one():
        state["p"], state["s"], loss = step(state["p"], state["s"], batch)
        return loss

    run = _timed(one, lambda: state["p"], a.warmup, a.steps, cfg, len(tokens[0]))
    return run | {"compile_s": compile_s, "kernels": sorted(record.used)}


def _timed(step, params, warmup: int, steps: int, cfg, batch: int) -> dict:
    """The first loss, ``warmup`` untimed steps, then ``steps`` timed ones (``block_until_ready``)."""
    first = float(step())
    for _ in range(warmup):
        step()
    jax.block_until_ready(params())
    begin = time.perf_counter()
    for _ in range(steps):
        last = step()
    jax.block_until_ready((last, params()))
    seconds = (time.perf_counter() - begin) / steps
    return {"first_loss": first, "last_loss": float(last), "step_s": seconds,
            "tokens_per_s": batch * cfg.seq_len / seconds, "steps": steps}  # fmt: skip


def _memory(t, compiled, params, tokens) -> dict:
    """Per device: compiled (arguments + temporaries), the device's peak where it reports one, and the
    peak model's prediction."""
    from meshkit.plans.peak import predict_peak

    m = compiled.memory_analysis()
    measured = int(m.argument_size_in_bytes + m.temp_size_in_bytes)
    figures = _compiled_figures(compiled)
    stats = jax.local_devices()[0].memory_stats() or {}
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tokens)
    try:
        predicted = float(predict_peak(t.assembled, shapes, batch).total)
    except Exception as e:
        print(f"peak model: {_first_line(e)}")
        predicted = None
    device = stats.get("peak_bytes_in_use")
    return {**figures, "compiled_bytes": measured, "device_peak_bytes": device, "predicted_bytes": predicted,
            "compiled_over_predicted": measured / predicted if predicted else None,
            "device_over_predicted": device / predicted if predicted and device else None}  # fmt: skip


def _compiled_figures(compiled) -> dict:
    """What the compiler says of a step, to set a compile for a target from another machine beside the
    device's own: memory_analysis's parts (``meshkit.analysis.memory``) and XLA's bytes accessed."""
    from meshkit.analysis import memory

    m = memory(compiled)
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list | tuple) else cost) or {}
    return {"argument_bytes": m.argument_bytes, "temp_bytes": m.temp_bytes, "output_bytes": m.output_bytes,
            "alias_bytes": m.alias_bytes, "xla_peak_bytes": m.peak_bytes or 0,
            "bytes_accessed": float(cost.get("bytes accessed", 0.0))}  # fmt: skip


def _compile_for_target(a) -> dict[str, Any]:
    """meshkit's fsdp step of the run's model, batch and remat (as ``_meshkit`` builds it through the
    Trainer) compiled for ``a.target``'s abstract TPU chips with this machine's libtpu: no TPU needed.
    Its figures (``_compiled_figures``) are the device run's ``memory`` ones when the two compilers agree."""
    from meshkit.plans import assemble
    from meshkit.spec import ParallelSpec
    from meshkit.targets import target_devices

    devices = target_devices(a.target)  # libtpu here; quiet where no TPU is present
    precision = a.precision or PLATFORM_PRECISION["tpu"]
    size = "0.7b" if a.size == "auto" else a.size
    cfg = _config(size, a.seq or 2048, precision)
    n, remat = len(devices), a.remat or "dots"
    batch = (a.batch or 2) * n
    spec = ParallelSpec.of(
        None, plan="fsdp", mesh=f"data={n}", remat=remat, precision=precision, attention="fused"
    )
    params = jax.eval_shape(llama.init, jax.random.key(0), cfg)
    tokens = (jax.ShapeDtypeStruct((batch, cfg.seq_len), np.int32),) * 2
    step = assemble(llama.make_loss(cfg), params, optax.adamw(1e-4), spec, devices=devices,
                    logical_axes=llama.logical_axes(params), units=llama.units(cfg))  # fmt: skip
    begin = time.perf_counter()
    compiled = step.lower(params, tokens).compile()
    out = {"target": a.target, "device_kind": devices[0].device_kind, "devices": n, "jax": jax.__version__,
           "python": sys.version.split()[0], "size": size, "batch": batch, "remat": remat, "precision": precision,
           "kernels": sorted(step.attention.used), "compile_s": time.perf_counter() - begin,
           "memory": _compiled_figures(compiled)}  # fmt: skip
    Path(a.out).write_text(json.dumps(out, indent=2, default=float))
    print(json.dumps(out, indent=2, default=float))
    return out


def _profile(t, placed) -> dict:
    """The exposed-communication fraction of two traced steps, or why there is none."""
    try:
        with tempfile.TemporaryDirectory() as where:
            summary = t.profile([placed, placed], where).summary
        fraction = summary.exposed_fraction
        note = "one device: no collectives" if jax.device_count() == 1 else "traced steps"
        return {"fraction": fraction, "note": note}
    except Exception as e:
        return {"fraction": None, "note": f"n/a ({type(e).__name__}: {_first_line(e)})"}


def _guarded(fn, *args) -> dict:
    """``fn(*args)``, or its error as one line (a failed comparison never costs the rest)."""
    try:
        return fn(*args)
    except Exception as e:
        gc.collect()
        return {"error": _error(e)}


def _oom_error(run: dict) -> bool:
    """Whether a run's recorded error is running out of memory."""
    return "RESOURCE_EXHAUSTED" in run.get("error", "") or "out of memory" in run.get("error", "").lower()


def _oom(e: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {_first_line(e)}"


def _skipped() -> dict:
    return {"note": "skipped: past the time budget (--minutes)"}


def _ratio(a: dict, b: dict) -> float | None:
    return a["step_s"] / b["step_s"] if "step_s" in a and "step_s" in b else None


def _loss_gap(a: dict, b: dict) -> float | None:
    if "first_loss" not in a or "first_loss" not in b:
        return None
    return abs(a["first_loss"] - b["first_loss"]) / abs(b["first_loss"])


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def _print_table(out: dict) -> None:
    gib = 2**30
    mem = out["memory"]
    rows = [("device", f"{out['devices']} x {out['device_kind']} ({out['platform']}), jax {out['jax']}"),
            ("model", f"Llama {out['size']}: {out['params'] / 1e9:.2f} B params, seq {out['seq']}, batch {out['batch']}, "
                      f"remat {out['remat']}, {out['precision']}, fsdp")]  # fmt: skip
    for name, r in out["runs"].items():
        if "tokens_per_s" in r:
            mfu = "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
            rows.append((name, f"{r['tokens_per_s']:,.0f} tok/s, {1e3 * r['step_s']:.1f} ms/step, MFU {mfu}, "
                               f"loss {r['first_loss']:.4f}, compile {r['compile_s']:.1f} s"))  # fmt: skip
        else:
            rows.append((name, r.get("error") or r.get("note", "")))
    rows += [("meshkit / hand step time", _num(out["meshkit_over_hand_step_time"], "{:.3f}x")),
             (f"einsum / fused step time (batch {out['attention_compared_at_batch']})",
              _num(out["einsum_over_fused_step_time"], "{:.3f}x")),
             ("peak memory", f"compiled {_num(mem.get('compiled_bytes'), '{:.2f}', gib)} GiB, device "
                             f"{_num(mem.get('device_peak_bytes'), '{:.2f}', gib)} GiB, peak model "
                             f"{_num(mem.get('predicted_bytes'), '{:.2f}', gib)} GiB"),
             ("exposed communication", f"{_num(out['exposed_communication_fraction'], '{:.3f}')} "
                                       f"({out['exposed_communication_note']})")]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))


def _num(x: float | None, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if x is None else fmt.format(x / scale)


if __name__ == "__main__":
    main()
