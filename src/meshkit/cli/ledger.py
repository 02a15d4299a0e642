"""``meshkit devices``, ``comm``, ``memory`` and ``budget``: the foundation's subcommands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from meshkit._errors import HloParseError, MeshkitError
from meshkit.cli._format import console, fmt_bytes, print_json, table

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
DevicesOpt = Annotated[
    int | None, typer.Option("--devices", "--simulate", help="Simulate N CPU devices (before JAX starts).")
]


def _simulate(n: int | None) -> None:
    """Set up devices before JAX starts: join the multi-process job when started as one (``meshkit
    launch``, ``mpirun``, ``srun``), simulating ``n`` CPU devices in all; else simulate ``n``."""
    from meshkit import distributed

    if distributed.is_multiprocess_env():
        spec = distributed.detect()
        per = spec.devices_per_process or (max(n // spec.process_count, 1) if n else None)
        distributed.initialize(devices_per_process=per)
    elif n is not None:
        from meshkit.devices import simulate_devices

        simulate_devices(n)


def devices(simulate: DevicesOpt = None, json: JsonOpt = False) -> None:
    """Show global and local devices: ids, platform, kind, owning process."""
    _simulate(simulate)
    from meshkit.devices import describe_devices

    report = describe_devices()
    if json:
        print_json(report.to_json())
        return
    console.print(
        f"platform [bold]{report.platform}[/] | process {report.process_index} of {report.process_count} | "
        f"{report.device_count} global device(s), {report.local_device_count} local"
    )
    rows = [[d.id, d.platform, d.kind, d.process_index, "yes" if d.local else "no"] for d in report.devices]
    console.print(table("Devices", ["id", "platform", "kind", "process", "local"], rows, justify_right=9))


def _compiled(target: str | None, hlo: Path | None, devices: int | None):
    if (target is None) == (hlo is None):
        raise MeshkitError("give exactly one of TARGET (module:function) or --hlo FILE")
    if hlo is not None:
        if not hlo.is_file():
            raise HloParseError(
                f"no HLO file {str(hlo)!r}: dump one with XLA_FLAGS=--xla_dump_to=DIR or compiled.as_text()"
            )
        try:
            return hlo.read_text()
        except UnicodeDecodeError:
            raise HloParseError(f"{str(hlo)!r} is not text: pass HLO text (an .hlo/.txt dump)") from None
    _simulate(devices)
    from meshkit.cli._target import load_target

    return load_target(target)


def comm(
    target: Annotated[str | None, typer.Argument(help="module:function returning (jitted, args).")] = None,
    hlo: Annotated[Path | None, typer.Option("--hlo", help="Read HLO text from FILE instead.")] = None,
    devices: Annotated[
        int | None,
        typer.Option(
            "--devices",
            "--simulate",
            help="With TARGET: simulate N CPU devices. With --hlo: the device count, where the module's "
            "header states neither replica_count nor num_partitions.",
        ),
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="List every collective, one line each.")] = False,
    json: JsonOpt = False,
) -> None:
    """Every collective the compiled program runs, its bytes and groups, beside the ring model."""
    from meshkit.analysis import communication

    ledger = communication(_compiled(target, hlo, devices), devices=devices if hlo is not None else None)
    if json:
        print_json(ledger.to_json())
        return
    from meshkit.cli._format import print_comm

    print_comm(ledger, every=all_)


def memory(
    target: Annotated[str, typer.Argument(help="module:function returning (jitted, args).")],
    devices: DevicesOpt = None,
    json: JsonOpt = False,
) -> None:
    """Per-device memory the compiler reserves: arguments, outputs, aliases, temporaries, code."""
    from meshkit.analysis import memory as read_memory

    ledger = read_memory(_compiled(target, None, devices))
    if json:
        print_json(ledger.to_json())
        return
    rows = [
        ["arguments", fmt_bytes(ledger.argument_bytes), ledger.argument_bytes],
        ["outputs", fmt_bytes(ledger.output_bytes), ledger.output_bytes],
        ["aliased (donated)", fmt_bytes(-ledger.alias_bytes), -ledger.alias_bytes],
        ["temporaries", fmt_bytes(ledger.temp_bytes), ledger.temp_bytes],
        ["generated code", fmt_bytes(ledger.generated_code_bytes), ledger.generated_code_bytes],
        ["total", fmt_bytes(ledger.total_bytes), ledger.total_bytes],
        [
            "peak: arguments + temporaries",
            fmt_bytes(ledger.argument_bytes + ledger.temp_bytes),
            ledger.argument_bytes + ledger.temp_bytes,
        ],
    ]
    if ledger.peak_bytes is not None:  # the compiler's live-buffer peak, where its backend reports one
        rows.append(["peak: live buffers (compiler)", fmt_bytes(ledger.peak_bytes), ledger.peak_bytes])
    console.print(table("Memory per device (compiled)", ["", "size", "bytes"], rows))


def budget(
    params: Annotated[float, typer.Option("--params", help="Parameter count, e.g. 7e9.")],
    devices: Annotated[int, typer.Option("--devices", help="Devices the model is spread over.")],
    convention: Annotated[
        str,
        typer.Option(
            help="Bytes per parameter: mixed-adam, fp32-adam, fp32-sgd-momentum, fp32-sgd, or P,G,O."
        ),
    ] = "mixed-adam",
    stages: Annotated[int | None, typer.Option(help="Pipeline stages p (for the bubble).")] = None,
    microbatches: Annotated[int | None, typer.Option(help="Micro-batches m (for the bubble).")] = None,
    json: JsonOpt = False,
) -> None:
    """Memory and communication per device for DP and the ZeRO stages, and the pipeline bubble."""
    from meshkit.analysis import bubble, zero_communication, zero_memory
    from meshkit.analysis import convention as get_convention
    from meshkit.spec import ZERO_STAGES

    conv = get_convention(convention)
    rows_json = []
    for stage in ZERO_STAGES:
        mem = zero_memory(params, devices, stage, conv)
        com = zero_communication(params, devices, stage, conv)
        rows_json.append(
            {**mem.to_json(), "traffic_bytes": com.traffic_bytes, "collectives": list(com.collectives)}
        )
    bub = None
    if (stages is None) != (microbatches is None):
        raise MeshkitError("give both --stages and --microbatches for the pipeline bubble, or neither")
    if stages is not None:
        bub = bubble(stages, microbatches)
    if json:
        print_json(
            {
                "params": params,
                "devices": devices,
                "convention": conv.name,
                "rows": rows_json,
                "bubble": None
                if bub is None
                else {"stages": stages, "microbatches": microbatches, "fraction": bub},
            }
        )
        return
    console.print(
        f"{params:,.0f} parameters over {devices} devices, convention [bold]{conv.name}[/]: "
        f"{conv.param:g} + {conv.grad:g} + {conv.optimizer:g} = {conv.total:g} bytes/parameter"
    )
    rows = [
        [
            r["stage"],
            *(
                fmt_bytes(r[k], decimal=True)
                for k in ("params", "grads", "optimizer", "total", "traffic_bytes")
            ),
            " + ".join(r["collectives"]),
        ]
        for r in rows_json
    ]
    cols = ["layout", "params", "grads", "optimizer", "total/device", "traffic/device/step", "collectives"]
    console.print(table("Per-device memory and ring-model traffic", cols, rows))
    if bub is not None:
        console.print(f"pipeline bubble (p-1)/(m+p-1) with p={stages}, m={microbatches}: [bold]{bub:.3f}[/]")


def register(app: typer.Typer) -> None:
    app.command()(devices)
    app.command()(comm)
    app.command()(memory)
    app.command()(budget)
