"""Record what every plan's compiled GPT step does, to hold a refactor to "behaviour unchanged".

For the GPT under every plan (dp, zero1-3, tp, dp+tp, fsdp+tp, each pipeline plan with each
schedule, remat, micro-batches, the scanned form, bf16), the step ``meshkit train``'s Trainer
compiles: its collectives (kind, mesh axes, executions, bytes), ``memory_analysis()``, the bytes
XLA's cost analysis says it accesses, the communication model's rows and the peak model's
prediction; and the planner's memory prediction for a set of layouts (no compile).

    python tests/golden/record_steps.py > tests/golden/steps.json   # on the commit to hold to

``tests/test_golden_steps.py`` recomputes every record and compares. The file in the repository
was recorded on main at 481eb44, before the structure change of issue 21.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

#: (name, plan, mesh, options): the GPT's step under each. ``layers`` and ``scan`` pick the GPT.
CASES: list[tuple[str, str, str, dict]] = [
    ("dp", "dp", "data=8", {}),
    ("dp-acc2", "dp", "data=8", {"accumulate": 2}),
    ("zero1", "zero1", "data=8", {}),
    ("zero2-acc2", "zero2", "data=8", {"accumulate": 2}),
    ("zero3", "zero3", "data=8", {}),
    ("zero3-layer", "zero3", "data=8", {"remat": "layer"}),
    ("zero3-regather-acc2", "zero3", "data=8", {"remat": "regather", "accumulate": 2}),
    ("zero3-scan-dots", "zero3", "data=8", {"remat": "dots", "scan": True}),
    ("zero3-bf16", "zero3", "data=8", {"bf16": True}),
    ("tp", "tp", "model=8", {}),
    ("dp+tp", "dp+tp", "data=4,model=2", {}),
    ("fsdp+tp", "fsdp+tp", "data=4,model=2", {}),
    ("fsdp+tp-layer-scan", "fsdp+tp", "data=2,model=4", {"remat": "layer", "scan": True}),
]
PIPELINES = [
    ("pp", "stage=8"),
    ("dp+pp", "stage=2,data=4"),
    ("fsdp+pp", "stage=2,data=4"),
    ("tp+pp", "stage=4,model=2"),
    ("dp+tp+pp", "stage=2,data=2,model=2"),
    ("fsdp+tp+pp", "stage=2,data=2,model=2"),
]
for _plan, _mesh in PIPELINES:
    stages = int(_mesh.split(",")[0].split("=")[1])
    for _schedule in ("gpipe", "1f1b", "interleaved"):
        opts = {"schedule": _schedule, "microbatches": 2 * stages, "layers": 2 * stages}
        if _schedule == "interleaved":
            opts["virtual_stages"] = 2
        CASES.append((f"{_plan}-{_schedule}", _plan, _mesh, opts))
CASES.append(("dp+pp-1f1b-layer", "dp+pp", "stage=2,data=4", {"schedule": "1f1b", "microbatches": 4,
                                                                "layers": 4, "remat": "layer"}))  # fmt: skip

#: Planner layouts whose predicted memory is recorded (the GPT preset and a Llama shape).
PLANNER = [
    ("gpt-1.3b", 64, "dp=8,tp=8", {"zero": 3, "microbatch_size": 2, "remat": "layer"}),
    ("gpt-1.3b", 64, "dp=64", {"zero": 3, "microbatch_size": 1, "remat": "dots"}),
    ("gpt-1.3b", 64, "dp=16,tp=4", {"zero": 1, "microbatch_size": 4}),
    (
        "gpt-1.3b",
        64,
        "dp=8,tp=2,pp=4",
        {"microbatch_size": 1, "schedule": "interleaved", "virtual_stages": 2},
    ),
    ("gpt-1.3b", 64, "dp=16,pp=4", {"zero": 3, "microbatch_size": 2, "schedule": "gpipe", "remat": "layer"}),
    ("llama-7b", 64, "dp=8,tp=8", {"zero": 3, "microbatch_size": 1, "remat": "layer"}),
    ("llama-7b", 64, "dp=4,tp=4,pp=4", {"microbatch_size": 1, "schedule": "1f1b"}),
]


def _gpt(layers: int, scan: bool, stages: bool, bf16: bool):
    import jax
    import numpy as np

    from meshkit.models import gpt

    cfg = gpt.GPTConfig(vocab_size=64, seq_len=16, layers=layers, width=32, heads=8, scan_layers=scan or stages,
                        compute_dtype="bfloat16" if bf16 else None)  # fmt: skip
    params = gpt.init(jax.random.key(0), cfg)
    tokens = np.random.default_rng(0).integers(0, 64, size=(16, 17)).astype(np.int32)
    loss = gpt.stages(cfg) if stages else gpt.make_loss(cfg)
    return cfg, params, loss, (tokens[:, :-1], tokens[:, 1:])


def record_case(plan: str, mesh: str, opts: dict) -> dict:
    import optax

    from meshkit.analysis import communication, memory
    from meshkit.models import gpt
    from meshkit.plans.tp_rules import vocab_rules
    from meshkit.train import Trainer

    pipeline = "pp" in plan
    cfg, params, loss, batch = _gpt(
        opts.get("layers", 2), opts.get("scan", False), pipeline, opts.get("bf16", False)
    )
    names = {"accumulate": "accumulate", "remat": "remat", "schedule": "pipeline_schedule",
             "microbatches": "microbatches", "virtual_stages": "virtual_stages"}  # fmt: skip
    kwargs = {names[k]: v for k, v in opts.items() if k in names}
    trainer = Trainer(loss, params, optax.adamw(1e-3, weight_decay=0.01), plan=plan, mesh=mesh,
                      logical_axes=gpt.logical_axes(params), units={"heads": cfg.heads}, clip_norm=1.0,
                      grad_norm=True, tokens_per_example=cfg.seq_len, compute_dtype=cfg.compute_dtype,
                      rules=vocab_rules(pipeline), **kwargs)  # fmt: skip
    compiled = trainer.compiled(batch)
    ledger = communication(compiled, mesh=trainer.mesh)
    mem = memory(compiled)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    report = trainer.report(batch)
    collectives = sorted(
        [r.op, r.axes_label, int(r.executions), int(r.size_bytes), float(r.total_traffic_bytes or 0.0)]
        for r in ledger.records
    )
    return {
        "collectives": collectives,
        "memory": {
            "argument": mem.argument_bytes,
            "output": mem.output_bytes,
            "alias": mem.alias_bytes,
            "temp": mem.temp_bytes,
        },
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "model_rows": sorted(
            [r.op, r.axes, float(r.model_traffic_bytes or 0.0)] for r in report.communication
        ),
        "memory_rows": sorted([r.component, float(r.formula_bytes)] for r in report.memory),
        "peak_model": None if report.peak is None else float(report.peak["model_bytes"]),
    }


def record_planner(model: str, devices: int, layout: str, opts: dict) -> dict:
    from meshkit.planner import Cluster, Job, hardware, predict
    from meshkit.planner.layout import Layout
    from meshkit.planner.presets import preset

    shape = preset(model)
    lay = Layout.parse(layout, **opts)
    cluster = Cluster(hardware=hardware("h100"), devices=devices)
    out = {}
    for runtime in ("standard", "meshkit"):
        job = Job(global_batch=256, precision="bf16", runtime=runtime)
        p = predict(shape, lay, cluster, job)
        out[runtime] = {"peak": float(p.peak_bytes), "memory": {k: float(v) for k, v in sorted(p.memory.items())},
                        "step_time_s": float(p.step_time_s)}  # fmt: skip
    return out


def record_all() -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    steps = {name: record_case(plan, mesh, opts) for name, plan, mesh, opts in CASES}
    planner = {f"{m} {d} {lay} {sorted(o.items())}": record_planner(m, d, lay, o) for m, d, lay, o in PLANNER}
    return {"steps": steps, "planner": planner}


if __name__ == "__main__":
    json.dump(record_all(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
