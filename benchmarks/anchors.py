"""Published pod runs compiled by meshkit for their own TPU slices, from this machine (issue 49).

Each anchor is a run someone else measured on a TPU pod: its model, its slice, its batch and layout. This
compiles meshkit's step of it with XLA:TPU (libtpu's compiler, abstract devices: no TPU needed) and
records what the compiler says per chip: the peak, whether it fits, the bytes each mesh axis moves
(meshkit's ledger of the TPU HLO). ``scripts/measurements.py`` sets them beside the planner's prediction
and the published MFU in docs/measurements.md ("Published pod runs, compiled").

    PYTHONPATH=src python benchmarks/anchors.py                 # every anchor (about 10 min on 2 cores)
    PYTHONPATH=src python benchmarks/anchors.py --only maxtext-32b-v5e-256

The anchors (shapes read from their sources; tests/corpus/published_runs.json's MaxText TPU rows have the
2024 Llama-2-style shapes, these the 2023 ones the tables were measured with):

- MaxText's v5e table (README.md @9bc243c9, 2023-10-27): 16B / 32B / 64B / 128B on one v5e-256, 61.10 /
  66.86 / 59.90 / 56.06% MFU; configs/largest_job/{16,32,64,128}b.sh: global_parameter_scale, per-device
  batch 6 / 4 / 2 / 1, remat full, fsdp 256 (the 128B fsdp 16 x tensor 16), sequence 2048.
- MaxText's v5p table (configs/v5p/README.md @76bd53b0, 2023-12-15): 32B on v5p-128 (64 chips), 71.47%;
  configs/v5p/32b.sh: per-device batch 8, remat minimal, fsdp 16 x tensor 4; FLOPs with attention halved.
- Llama 3.1 8B on v6e-256 (MaxText docs/reference/models/tiering.md; AI-Hypercomputer/tpu-recipes
  training/trillium/Llama3.1-8B-MaxText/v6e-256: 4.546 s a step, 417.397 TFLOP/s per chip, 45.46%):
  sequence 8192, 4 per chip, fsdp 256, remat custom with host offload.

The 2023 MaxText model is no family of meshkit's (``MAXTEXT_2023``): one RMS pre-norm feeding attention
and a ReLU MLP in parallel, heads of 256, tied embeddings, no positions. It compiles here as a user's loss
(``planner.compile.UserModel``) whose attention is meshkit's (causal splash on a TPU: the 2023 runs used
a non-causal flash kernel; the FLOPs the table compares are the published ones). The Llama 3.1 8B is
meshkit's own Llama.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "anchors.json"
sys.path.insert(0, str(ROOT / "src"))

from meshkit.planner.layout import Layout, ModelShape  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class Anchor:
    """A published run: what it trained, on which slice, under which layout, and what it measured."""

    name: str
    title: str
    source: str
    target: str
    """The slice as libtpu's topology (``meshkit.targets``)."""
    hardware: str
    shape: ModelShape
    layout: Layout
    per_chip_batch: int
    model: str
    """``llama`` (meshkit's family) or ``maxtext-2023`` (``MAXTEXT_2023``, compiled as a user's loss)."""
    published_mfu: float
    published_step_s: float
    tflop_per_chip: float
    """The published FLOPs of one step per chip, in the publisher's convention (``convention``)."""
    convention: str
    their_remat: str

    @property
    def chips(self) -> int:
        return self.layout.devices

    @property
    def global_batch(self) -> int:
        return self.per_chip_batch * self.chips


def maxtext_2023_shape(scale: int, *, name: str) -> ModelShape:
    """The 2023 MaxText model at ``global_parameter_scale`` (MaxText/pyconfig.py @9bc243c9: log2 scale =
    3 base + rem; heads and MLP x 2^(base + (rem > 0)), width x 2^(base + (rem > 1)), layers x 2^base, on
    base.yml's width 2560, 8 heads of 256, MLP 8192, 16 layers, vocabulary 32768, sequence 2048)."""
    base, rem = divmod(scale.bit_length() - 1, 3)
    return ModelShape(
        name=name,
        layers=16 * 2**base,
        width=2560 * 2 ** (base + (rem > 1)),
        heads=8 * 2 ** (base + (rem > 0)),
        head_dim=256,
        ffn=8192 * 2 ** (base + (rem > 0)),
        vocab=32768,
        seq=2048,
        tie_embeddings=True,
    )


def _maxtext(scale: int, batch: int, mfu: float, step_s: float, tflop: float, layout: Layout) -> Anchor:
    return Anchor(
        name=f"maxtext-{scale}b-v5e-256",
        title=f"MaxText {scale}B (2023), 1x v5e-256",
        source=f"google/maxtext README.md @9bc243c9; configs/largest_job/{scale}b.sh",
        target="v5e:16x16",
        hardware="tpu-v5e",
        shape=maxtext_2023_shape(scale, name=f"maxtext-2023-{scale}b"),
        layout=layout,
        per_chip_batch=batch,
        model="maxtext-2023",
        published_mfu=mfu,
        published_step_s=step_s,
        tflop_per_chip=tflop,
        convention="6 N T + 12 L H h T^2 per sequence (attention non-causal), N every parameter",
        their_remat="full",
    )


def fsdp(chips: int, per_chip: int, *, tp: int = 1, remat: str = "layer") -> Layout:
    """Their layout: ZeRO-3 over ``chips / tp``, the whole per-chip batch in one pass (no accumulation)."""
    return Layout(dp=chips // tp, tp=tp, zero=3, remat=remat, microbatch_size=per_chip * tp)


LLAMA_31_8B = ModelShape(
    name="llama3.1-8b", family="llama", layers=32, width=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336,
    gated=True, vocab=128256, seq=8192, rope_theta=500000.0,
)  # fmt: skip
"""Llama 3.1 8B (meta-llama's config.json) at the recipe's sequence of 8192."""

ANCHORS: tuple[Anchor, ...] = (
    # Step time = TFLOP per chip per step / (MFU x 197 TFLOP/s): 1279.0 / 120.4 = 10.63 s, ...
    _maxtext(16, 6, 0.6110, 10.63, 1279.0, fsdp(256, 6)),
    _maxtext(32, 4, 0.6686, 12.55, 1652.6, fsdp(256, 4)),
    _maxtext(64, 2, 0.5990, 13.93, 1644.3, fsdp(256, 2)),
    _maxtext(128, 1, 0.5606, 14.85, 1640.2, fsdp(256, 1, tp=16)),
    Anchor(
        name="maxtext-32b-v5p-128",
        title="MaxText 32B (2023), 1x v5p-128 (64 chips)",
        source="google/maxtext configs/v5p/README.md @76bd53b0; configs/v5p/32b.sh",
        target="v5p:4x4x4",
        hardware="tpu-v5p",
        shape=maxtext_2023_shape(32, name="maxtext-2023-32b"),
        layout=fsdp(64, 8, tp=4, remat="dots"),
        per_chip_batch=8,
        model="maxtext-2023",
        published_mfu=0.7147,
        published_step_s=9.91,
        tflop_per_chip=3252.4,
        convention="6 N T + 6 L H h T^2 per sequence (attention halved for causality)",
        their_remat="minimal (dots without batch dimensions)",
    ),
    Anchor(
        name="llama3.1-8b-v6e-256",
        title="Llama 3.1 8B, 1x v6e-256",
        source="MaxText docs/reference/models/tiering.md; AI-Hypercomputer/tpu-recipes Llama3.1-8B-MaxText/v6e-256",
        target="v6e:16x16",
        hardware="tpu-v6e",
        shape=LLAMA_31_8B,
        layout=fsdp(256, 4),
        per_chip_batch=4,
        model="llama",
        published_mfu=0.4546,
        published_step_s=4.546,
        tflop_per_chip=1897.7,
        convention="6 x matmul parameters x T + 12 L H h T^2 per sequence (attention non-causal; meshkit's)",
        their_remat="custom: layer inputs kept, q/k/v/out projections offloaded to host",
    ),
)


def maxtext_2023(shape: ModelShape):
    """The 2023 MaxText block as a user's model (``planner.compile.UserModel``), abstract: parameters in
    float32, compute in bfloat16, layers stacked and scanned (meshkit's plans gather and rematerialize
    them per layer), the one-hot embedding as a lookup, logits ``y E^T / sqrt(d)`` in float32."""
    import jax
    import jax.numpy as jnp

    from meshkit.planner.compile import UserModel
    from meshkit.plans import causal_attention

    d, h, hd, f, n, v = shape.width, shape.heads, shape.head_dim, shape.ffn, shape.layers, shape.vocab
    f32, bf = jnp.float32, jnp.bfloat16
    leaf = jax.ShapeDtypeStruct
    params = {
        "embed": leaf((v, d), f32),
        "final_norm": leaf((d,), f32),
        "blocks": {
            "norm": leaf((n, d), f32),
            "wq": leaf((n, d, h * hd), f32),
            "wk": leaf((n, d, h * hd), f32),
            "wv": leaf((n, d, h * hd), f32),
            "wo": leaf((n, h * hd, d), f32),
            "wi": leaf((n, d, f), f32),
            "wo_mlp": leaf((n, f, d), f32),
        },
    }
    axes = {
        "embed": ("vocab", "embed"),
        "final_norm": ("embed",),
        "blocks": {
            "norm": ("layers", "embed"),
            "wq": ("layers", "embed", "heads"),
            "wk": ("layers", "embed", "heads"),
            "wv": ("layers", "embed", "heads"),
            "wo": ("layers", "heads", "embed"),
            "wi": ("layers", "embed", "mlp"),
            "wo_mlp": ("layers", "mlp", "embed"),
        },
    }

    def norm(x, scale):
        x32 = x.astype(f32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(bf) * scale.astype(
            bf
        )

    def block(x, p):
        b, t, _ = x.shape
        y = norm(x, p["norm"])
        q, k, val = (jnp.dot(y, p[w].astype(bf)).reshape(b, t, h, hd) for w in ("wq", "wk", "wv"))
        att = causal_attention(q, k, val).reshape(b, t, h * hd)
        mlp = jnp.dot(jax.nn.relu(jnp.dot(y, p["wi"].astype(bf))), p["wo_mlp"].astype(bf))
        return x + jnp.dot(att, p["wo"].astype(bf)) + mlp, None

    def loss(p, batch):
        tokens, targets = batch[0], batch[1]
        x = p["embed"].astype(bf)[tokens]
        x, _ = jax.lax.scan(block, x, p["blocks"])
        logits = jnp.dot(norm(x, p["final_norm"]).astype(f32), p["embed"].T) / jnp.sqrt(d)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

    return UserModel(loss=loss, params=params, logical_axes=axes, units={"heads": h})


def best_job(anchor: Anchor):
    """The job the planner's best layout is chosen and priced for: meshkit's runtime, bf16."""
    from meshkit.planner.cluster import Job

    return Job(global_batch=anchor.global_batch, precision="bf16", runtime="meshkit")


def best_layout(anchor: Anchor) -> Layout | None:
    """The planner's top-ranked layout for the anchor's model, slice and batch that meshkit has a plan
    for (a pipeline only for meshkit's own Llama: a plain loss is no ``Stages``), priced as meshkit's
    runtime runs it (``meshkit plan --runtime meshkit``'s ranking: sequence parallelism under tp, splash
    on each device's heads; seconds), or None where none of those fits."""
    from meshkit.planner.cluster import Cluster
    from meshkit.planner.hardware import hardware
    from meshkit.planner.search import search

    cluster = Cluster(hardware=hardware(anchor.hardware), devices=anchor.chips)
    ranked = search(anchor.shape, cluster, best_job(anchor)).ranked
    # a pipeline takes the model as Stages: meshkit's Llama does, a plain loss does not
    stages = anchor.model == "llama"
    runnable = [
        p.layout
        for p in ranked
        if p.meshkit_plan() and p.layout.cp == 1 and p.layout.ep == 1 and (stages or p.layout.pp == 1)
    ]
    return runnable[0] if runnable else None


def compile_anchor(anchor: Anchor, layout: Layout) -> dict:
    """The anchor's step under ``layout`` compiled for its slice: ``Measured.to_json()`` with the
    compile's versions."""
    import jax

    from meshkit.planner.cluster import Job
    from meshkit.planner.compile import compile_layout

    model = maxtext_2023(anchor.shape) if anchor.model == "maxtext-2023" else None
    job = Job(global_batch=anchor.global_batch, precision="bf16")
    measured = compile_layout(anchor.shape, layout, job, target=anchor.target, model=model)
    try:
        from importlib.metadata import version

        libtpu = version("libtpu")
    except Exception:  # recorded as unknown
        libtpu = "unknown"
    return {
        **measured.to_json(),
        "jax": jax.__version__,
        "libtpu": libtpu,
        "machine": f"{platform.machine()}, {platform.python_version()}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", action="append", choices=[a.name for a in ANCHORS], help="anchors to compile"
    )
    parser.add_argument(
        "--out", type=Path, default=OUT, help="JSON to update (default benchmarks/anchors.json)"
    )
    args = parser.parse_args(argv)
    from meshkit.targets import quiet_libtpu

    quiet_libtpu()
    chosen = [a for a in ANCHORS if not args.only or a.name in args.only]
    recorded = json.loads(args.out.read_text()) if args.out.exists() else {}
    for anchor in chosen:
        row = {}
        for which, layout in (("own", anchor.layout), ("best", best_layout(anchor))):
            if layout is None:
                continue
            start = time.perf_counter()
            print(f"{anchor.name}, {which}: {layout.label()} on {anchor.target} ...", flush=True)
            row[which] = compile_anchor(anchor, layout)
            state = "fits" if row[which]["ok"] else row[which]["error"]
            peak = row[which]["peak_bytes"] / 2**30
            print(f"  {state}; peak {peak:.2f} GiB per chip; {time.perf_counter() - start:.0f} s", flush=True)
        recorded[anchor.name] = row
        tmp = args.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")
        tmp.replace(args.out)  # after each anchor: a later one failing keeps the earlier ones
    return 0


if __name__ == "__main__":
    sys.exit(main())
