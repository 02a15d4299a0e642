"""``meshkit verify``: a plan beside single-device and float64 runs, and its cost beside the model;
for a built-in model or the user's own (``--model mymodule:make``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Annotated

import typer

from meshkit.cli._format import console, fmt_bytes, print_json, table
from meshkit.cli.ledger import DevicesOpt, JsonOpt
from meshkit.models import registry
from meshkit.spec import ParallelSpec, describe_plans


def _spec_option(name: str) -> typer.models.OptionInfo:
    """The flag of a parallel spec's option, as its declaration gives it (``meshkit.spec.option``: the
    same help as ``meshkit train``'s)."""
    meta = {f.name: f for f in dataclasses.fields(ParallelSpec)}[name].metadata
    return typer.Option(*meta["flags"], help=meta["help"], show_default=meta["shown"] or True)


def verify(
    plan: Annotated[
        str,
        typer.Option(
            help=f"{describe_plans()} (expert plans: --model {' or '.join(registry.names())} with 8 experts per layer)."
        ),
    ] = "dp",
    model: Annotated[
        str,
        typer.Option(
            help=f"linear, mlp, {', '.join(registry.names())} (each also as NAME-scan: its blocks stacked under "
            "lax.scan), or your own as module:function (or path/to/file.py:function) returning a dict with loss, params and batch "
            "(optionally optimizer, logical_axes, rules, units, state, rng, has_aux, tokens_per_example)."
        ),
    ] = "mlp",
    mesh: Annotated[str | None, _spec_option("mesh")] = None,
    steps: Annotated[int, typer.Option(help="Optimizer steps to compare.")] = 20,
    accumulate: Annotated[int, _spec_option("accumulate")] = 1,
    remat: Annotated[str, _spec_option("remat")] = "none",
    sequence_parallel: Annotated[bool, _spec_option("sequence_parallel")] = False,
    pipeline_schedule: Annotated[str | None, _spec_option("pipeline_schedule")] = None,
    microbatches: Annotated[int | None, _spec_option("microbatches")] = None,
    virtual_stages: Annotated[int, _spec_option("virtual_stages")] = 1,
    context_attention: Annotated[str, _spec_option("context_attention")] = "ring",
    deterministic: Annotated[
        bool,
        typer.Option(
            "--deterministic",
            help="Deterministic mode (8 micro-shards in one fixed sum tree): also train on every data axis "
            "that divides the devices and check the bits are the plan's (the 'bitwise across meshes' check); "
            "under meshkit launch on each process's own devices, beside the plan's run on all processes.",
        ),
    ] = False,
    devices: DevicesOpt = 8,
    json: JsonOpt = False,
) -> None:
    """Certify a plan: parameters vs one device in float64, the float32 first step within rounding,
    measured cost vs model. Exit 1 if a check fails."""
    from meshkit.cli.ledger import _simulate

    if deterministic:
        from meshkit.devices import prepare_deterministic

        prepare_deterministic()  # before the backend starts (a launched rank's join starts it)
    _simulate(devices)
    from meshkit import verify as V

    options = dict(
        mesh=mesh,
        steps=steps,
        accumulate=accumulate,
        remat=remat,
        sequence_parallel=sequence_parallel,
        microbatches=microbatches,
        pipeline_schedule=pipeline_schedule,
        virtual_stages=virtual_stages,
        context_attention=context_attention,
        deterministic=deterministic or None,
    )
    if ":" in model:
        cert = V.verify_model(**_user_model(model), plan=plan, **options)
    else:
        cert = V.verify(plan, model, **options)
    if json:
        print_json(cert.to_json())
    else:
        _print(cert)
    if not cert.ok:
        raise typer.Exit(1)


#: What ``make()`` may return beside the loss, parameters and batch: ``verify_model``'s arguments.
_OPTIONAL = ("optimizer", "logical_axes", "rules", "units", "state", "rng", "has_aux", "tokens_per_example")


def _user_model(target: str) -> dict:
    """``verify_model``'s arguments from ``module:function``: the function returns a dict with
    ``loss``, ``params`` and ``batch`` and any of ``_OPTIONAL``."""
    from meshkit._errors import TargetError
    from meshkit.cli._target import call, resolve

    fn = resolve(target, what="model", example="mymodule:make")
    made = call(target, fn) if callable(fn) else fn
    if not isinstance(made, Mapping):
        raise TargetError(
            f"{target} returned {type(made).__name__}: return a dict with loss, params and batch "
            f"(and optionally {', '.join(_OPTIONAL)})"
        )
    missing = [k for k in ("loss", "params", "batch") if k not in made]
    unknown = sorted(set(made) - {"loss", "params", "batch", *_OPTIONAL})
    if missing or unknown:
        what = f"lacks {', '.join(missing)}" if missing else f"has unknown key(s) {', '.join(unknown)}"
        raise TargetError(
            f"{target}'s dict {what}: give loss, params and batch, and any of {', '.join(_OPTIONAL)}"
        )
    if not callable(made["loss"]):
        raise TargetError(
            f"{target}'s loss is {type(made['loss']).__name__}, not a function (params, batch) -> loss"
        )
    out = {k: v for k, v in made.items() if k != "loss"}
    return {"loss_fn": made["loss"], "name": target, **out}


def _num(x: float | None, fmt: str = ".2e") -> str:
    return "-" if x is None else format(x, fmt)


def _print(cert) -> None:
    r = cert.report
    mesh = ",".join(f"{k}={v}" for k, v in r.mesh.items())
    console.print(
        f"plan [bold]{cert.plan}[/] on {cert.model}, mesh {mesh}, {cert.steps} optimizer steps, "
        f"accumulate {cert.accumulate}; final loss {cert.final_loss:.6f}",
        highlight=False,
    )
    console.print(table("Equivalence", ["check", "measured", "required"], _equivalence(cert)))
    if cert.float64_twin is not None:
        console.print(f"no float64 twin: {cert.float64_twin}", soft_wrap=True, highlight=False)
    if cert.first_step_bound is None:
        console.print(f"float32 first step {cert.first_step_vs}", soft_wrap=True, highlight=False)
    cols = ["op", "axes", "instr. runs", "measured traffic/device", "model", "ratio", ""]
    console.print(table("Communication per step (ring model, scalars aside)", cols, _communication(r)))
    console.print(table("Per-device memory", ["component", "measured", "formula", "ratio", ""], _memory(r)))
    if r.pipeline is not None:
        console.print(r.pipeline.table())
    _notes(r)
    verdict = (
        "[bold green]ok[/]"
        if cert.ok
        else "[bold red]FAILED[/]: " + ", ".join(k for k, v in cert.checks.items() if not v)
    )
    console.print(verdict)


def _equivalence(cert) -> list[list]:
    """The certificate's equivalence checks: measured beside what each requires."""
    from meshkit.verify import TAIL, TOL_EXACT, TOL_FLOAT64

    checked = cert.first_step_bound is not None
    state = cert.state_exact_vs_single_device
    rows = [
        ["float64: plan vs one device after K steps", _num(cert.exact_vs_single_device), f"<= {TOL_EXACT:g}"],
        [
            "float64: state (batch statistics, ...) vs one device",
            _num(state),
            f"<= {TOL_EXACT:g}" if state is not None else "(no state)",
        ],
        [
            f"float32: first step vs {cert.first_step_vs if checked else 'one device'}",
            _num(cert.first_step),
            f"<= {_num(cert.first_step_bound)}" if checked else "(not checked: see below)",
        ],
        [
            "  one device's own (largest of its batch orders)",
            _num(cert.first_step_noise),
            f"x {TAIL:g} sqrt(1 + ({cert.partial_sums} partial sums - 1) / log2({cert.examples} examples))",
        ],
        ["float32: plan vs NumPy float64 after K steps", _num(cert.vs_float64), f"<= {TOL_FLOAT64:g}"],
        ["float32: plan vs one device after K steps", _num(cert.vs_single_device), "(informational)"],
        ["  one device vs itself, batch reordered", _num(cert.float32_spread), "(informational)"],
        ["  one device vs float64", _num(cert.float32_noise), "(informational)"],
        ["bitwise reproducible run to run", cert.reproducible, "True"],
    ]
    if cert.bitwise_across_meshes is not None:
        same = ", ".join(f"{m}: {ok}" for m, ok in cert.bitwise_across_meshes.items())
        rows.append(["bitwise across meshes (deterministic)", same, "all True"])
    return rows


def _communication(r) -> list[list]:
    """Each collective of the step: measured beside the ring model."""
    ratio = lambda c: "-" if c.ratio is None else f"{c.ratio:.4f}"  # noqa: E731
    return [
        [
            c.op,
            c.axes,
            c.measured_runs,
            fmt_bytes(c.measured_traffic_bytes),
            fmt_bytes(c.model_traffic_bytes),
            ratio(c),
            "ok" if c.ok else "FAIL",
        ]
        for c in r.communication
    ]


def _memory(r) -> list[list]:
    """Each component of the per-device memory beside its formula; the compiled step's, and its peak
    beside the peak model (``meshkit.plans.peak``)."""
    rows = [
        [
            m.component,
            fmt_bytes(m.measured_bytes),
            fmt_bytes(m.formula_bytes),
            "-" if m.ratio is None else f"{m.ratio:.4f}",
            "ok" if m.ok else "FAIL",
        ]
        for m in r.memory
    ]
    cm = r.compiled_memory
    rows.append(["compiled: arguments", fmt_bytes(cm.argument_bytes), "", "", ""])
    rows.append(["compiled: temporaries", fmt_bytes(cm.temp_bytes), "", "", ""])
    if (pk := r.peak) is not None:
        rows.append(
            [
                "peak (arguments + temporaries)",
                fmt_bytes(pk["measured_bytes"]),
                fmt_bytes(pk["model_bytes"]),
                f"{pk['ratio']:.4f}",
                "ok" if pk["ok"] else "see below",
            ]
        )
    return rows


def _notes(r) -> None:
    """The peak model's layers and remat, why it is off where it is, and the leaves kept whole on data."""
    if r.peak is not None:
        console.print(f"layers: {r.peak['layers']}; remat {r.peak['remat']}", soft_wrap=True, highlight=False)
        if "explanation" in r.peak:
            console.print(
                f"peak beyond 10% of the model: {r.peak['explanation']}", soft_wrap=True, highlight=False
            )
    reasons: dict[str, list[str]] = {}
    for path, why in r.replicated:
        reasons.setdefault(why, []).append(path)
    for why, paths in reasons.items():
        console.print(f"kept whole on the data axis ({why}): {len(paths)} leaves: {', '.join(paths)}")


def register(app: typer.Typer) -> None:
    app.command()(verify)
