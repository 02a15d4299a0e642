"""Peak per-device memory of a training step under each plan, remat setting and GPT form.

The issue-14 GPT (width 256, 4 heads, vocab 256, seq 64, global batch 16, adamw) on data=8, with
4, 8, 16 and 32 layers: for dp, zero1, zero2 and zero3, in the Python-loop form (blocks marked with
``meshkit.layer``) and the scanned form (``lax.scan`` over stacked blocks), with remat none and
layer (zero3 also dots and regather), plus a hand-written ``jax.jit`` step with parameters sharded on
data (XLA's own collectives); each compiled ahead of time from shapes (nothing allocated).

Printed per row: measured peak (``memory_analysis()`` arguments + temporaries), the model's
prediction (``meshkit.plans.peak.predict_peak``) and their ratio, the ratio to dp's measured peak
at the same depth and form, and all-gather / reduce-scatter bytes per step (S of the ring formulas,
read from the compiled HLO) over the model's fp32 bytes. Then the per-layer slope of the peak
(8 -> 16 -> 32 layers) measured beside predicted.

Run (slow: about 70 compiles; 32-layer loop forms take longest)::

    .venv/bin/python benchmarks/bench_memory.py [--layers 4,8,16,32] [--plans dp,zero1,zero2,zero3]
                                                [--forms loop,scan] [--remats none,layer,dots,regather]
                                                [--json out.json] [--merge earlier.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import jax
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding

import meshkit

meshkit.simulate_devices(8)

from meshkit.analysis import communication  # noqa: E402
from meshkit.models import gpt  # noqa: E402
from meshkit.plans.peak import abstract_step, nbytes  # noqa: E402

MiB = 2**20
BATCH = 16


def config(layers: int, scan: bool) -> gpt.GPTConfig:
    return gpt.GPTConfig(vocab_size=256, seq_len=64, layers=layers, width=256, heads=4, scan_layers=scan)


def shapes(cfg):
    params = jax.eval_shape(lambda: gpt.init(jax.random.key(0), cfg))
    tok = jax.ShapeDtypeStruct((BATCH, cfg.seq_len), np.int32)
    return params, (tok, tok)


def traffic(compiled, mesh) -> dict[str, float]:
    """All-gather and reduce-scatter bytes per step (S: gathered output, scattered input), scalars aside."""
    out = {"all-gather": 0.0, "reduce-scatter": 0.0}
    for r in communication(compiled, mesh=mesh).records:
        if r.op in out and not all(s == () for s in r.shapes):
            out[r.op] += r.size_bytes * r.executions
    return out


def hand_peak(cfg) -> float:
    """jax.jit of value_and_grad + adamw, parameters and state sharded on data like zero3 (XLA's collectives)."""
    params, batch = shapes(cfg)
    step = abstract_step(gpt.make_loss(cfg), params, batch, optax.adamw(1e-3), plan="zero3", mesh="data=8")
    layout = step.per_layer.placement
    mesh = layout.mesh
    sh = layout.tree(lambda leaf: NamedSharding(mesh, leaf.spec(data=True)))
    opt = optax.adamw(1e-3)
    opt_shapes = jax.eval_shape(opt.init, params)
    from meshkit.plans import state_shardings

    opt_sh = state_shardings(opt, params, layout)
    bsh = NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    loss_fn = gpt.make_loss(cfg)

    def train(p, s, b):
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        g = lax.with_sharding_constraint(g, sh)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    att = lambda t, h: jax.tree.map(lambda x, y: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=y), t, h)  # noqa: E731
    c = (
        jax.jit(train, out_shardings=(sh, opt_sh, None), donate_argnums=(0, 1))
        .lower(att(params, sh), att(opt_shapes, opt_sh), jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=bsh), batch))
        .compile()
    )  # fmt: skip
    m = c.memory_analysis()
    return float(m.argument_size_in_bytes + m.temp_size_in_bytes)


def save(path: str | None, rows: list) -> None:
    """Write the rows so far (a long run killed midway keeps what it measured)."""
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="4,8,16,32")
    ap.add_argument("--plans", default="dp,zero1,zero2,zero3")
    ap.add_argument("--forms", default="loop,scan")
    ap.add_argument("--remats", default="none,layer,dots,regather", help="zero3's; the others run none,layer")
    ap.add_argument("--json", default=None)
    ap.add_argument("--merge", default=None, help="JSON rows of an earlier run (other depths) for the slopes")
    args = ap.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",") if x]  # --layers "" --merge rows.json: summary only
    rows = []
    print(f"{'L':>3} {'form':5} {'plan':6} {'remat':8} {'peak MiB':>9} {'model':>9} {'meas/mod':>8} {'/dp':>6} "
          f"{'AG/model':>8} {'RS/model':>8} {'s':>4}")  # fmt: skip
    for n_layers in layers:
        for form in args.forms.split(","):
            cfg = config(n_layers, form == "scan")
            params, batch = shapes(cfg)
            model_bytes = nbytes(params)
            dp_peak = None
            for plan in args.plans.split(","):
                for remat in args.remats.split(",") if plan == "zero3" else ("none", "layer"):
                    t0 = time.time()
                    st = abstract_step(gpt.make_loss(cfg), params, batch, optax.adamw(1e-3), plan=plan,
                                       mesh="data=8", remat=remat, logical_axes=gpt.logical_axes(params))  # fmt: skip
                    peak = st.measured_peak
                    pred = st.predict().total
                    tr = traffic(st.compiled, st.per_layer.placement.mesh)
                    if plan == "dp" and remat == "none":
                        dp_peak = peak
                    row = dict(layers=n_layers, form=form, plan=plan, remat=remat, peak=peak, model=pred,
                               ratio=peak / pred, vs_dp=peak / dp_peak if dp_peak else None,
                               all_gather=tr["all-gather"] / model_bytes, reduce_scatter=tr["reduce-scatter"] / model_bytes)  # fmt: skip
                    rows.append(row)
                    save(args.json, rows)
                    print(f"{n_layers:>3} {form:5} {plan:6} {remat:8} {peak / MiB:9.1f} {pred / MiB:9.1f} {row['ratio']:8.2f} "
                          f"{row['vs_dp'] or 0:6.3f} {row['all_gather']:8.2f} {row['reduce_scatter']:8.2f} {time.time() - t0:4.0f}", flush=True)  # fmt: skip
            hp = hand_peak(cfg)
            rows.append(dict(layers=n_layers, form=form, plan="hand-jit", remat="none", peak=hp))
            save(args.json, rows)
            print(f"{n_layers:>3} {form:5} {'hand':6} {'none':8} {hp / MiB:9.1f} {'':>9} {'':>8} {hp / dp_peak if dp_peak else 0:6.3f}", flush=True)  # fmt: skip
    if args.merge:  # rows of earlier runs (other depths) for the slopes and the check below
        with open(args.merge) as f:
            seen = {(r["layers"], r["form"], r["plan"], r["remat"]) for r in rows}
            rows += [r for r in json.load(f) if (r["layers"], r["form"], r["plan"], r["remat"]) not in seen]
    print("\nper-layer slope of the peak (MiB per layer added), measured vs model:")
    ok = True
    for form in args.forms.split(","):
        for plan, remat in [("dp", "none"), ("zero3", "none"), ("zero3", "layer"), ("zero3", "regather")]:
            pts = sorted((r["layers"], r["peak"], r["model"]) for r in rows
                         if r["form"] == form and r["plan"] == plan and r["remat"] == remat and "model" in r)  # fmt: skip
            for (l0, p0, m0), (l1, p1, m1) in itertools.pairwise(pts):
                print(f"  {form:5} {plan:6} {remat:8} {l0:>2}->{l1:<2} measured {(p1 - p0) / (l1 - l0) / MiB:7.3f}  "
                      f"model {(m1 - m0) / (l1 - l0) / MiB:7.3f}")  # fmt: skip
    print("\nzero3 layer remat per layer added, beside dp's and one layer's own bytes (MiB): sharded parameters +"
          " Adam state (3 P_1/N), its gradient shard (P_1/N), the saved layer input (B/N x seq x width fp32)")  # fmt: skip
    for form in args.forms.split(","):
        cfg = config(1, False)
        one = nbytes(shapes(cfg)[0]["blocks"][0])  # one block's parameter bytes (P_1)
        state, shard = 3 * one / 8, one / 8
        saved = BATCH // 8 * cfg.seq_len * cfg.width * 4
        peak = {
            (r["layers"], r["plan"], r["remat"]): (r["peak"], r.get("model"))
            for r in rows
            if r["form"] == form
        }
        depths = sorted({d for d, p, m in peak if p == "zero3" and m == "layer"})
        for l0, l1 in itertools.pairwise(depths):
            z0, z1, d0, d1 = (peak.get((d, p, "none" if p == "dp" else "layer"), (None, None))
                              for p in ("zero3", "dp") for d in (l0, l1))  # fmt: skip
            if None in (z0[0], z1[0], d0[0], d1[0]):
                continue
            per = lambda a, b, k=l1 - l0: (b - a) / k / MiB  # noqa: E731
            print(f"  {form:5} {l0:>2}->{l1:<2} zero3 layer measured {per(z0[0], z1[0]):6.3f} model "
                  f"{per(z0[1], z1[1]):6.3f} | dp {per(d0[0], d1[0]):7.3f} | state {state / MiB:.3f} + saved input "
                  f"{saved / MiB:.3f} = {(state + saved) / MiB:.3f} (+ gradient shard {shard / MiB:.3f})")  # fmt: skip
        for d in depths:
            if (d, "dp", "none") in peak:
                z, dp = peak[(d, "zero3", "layer")][0], peak[(d, "dp", "none")][0]
                print(f"  {form:5} {d:>2} layers: zero3 layer peak / dp peak = {z / dp:.3f}")
    for r in rows:
        if "ratio" in r and not 0.9 <= r["ratio"] <= 1.1:
            ok = False
    print("all measured/model within 0.90-1.10" if ok else "SOME measured/model OUTSIDE 0.90-1.10")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
