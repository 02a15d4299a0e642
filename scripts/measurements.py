"""Regenerate the generated sections of docs/measurements.md (issue 35).

Each generated section sits between ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->``
and is rebuilt from what is cheap and deterministic: the Makefile's ``make run`` recipe with the
training config's defaults (no training is run: its timings stay a recorded run with its date),
``meshkit plan`` rankings, which are analytical (a few CPU seconds), and the planner beside the
published runs of ``tests/corpus/published_runs.json`` (``planner.calibrate``: arithmetic, well under
a second).

    PYTHONPATH=src python scripts/measurements.py          # rewrite the page
    PYTHONPATH=src python scripts/measurements.py --check  # exit 1 (naming the sections) if stale
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "measurements.md"
MAKEFILE = ROOT / "Makefile"
PLAN_1_3B = ("--model gpt-1.3b --seq 1024 --vocab 32000 --devices 64 --devices-per-host 8 --global-batch 64 "
             "--runtime meshkit --no-flash-attention")  # fmt: skip
"""The compile check at scale: the 1.3 B GPT on 64 h100 (the ranking ``--compile 3`` compiles the top of)."""
RECORDED_RUN = (
    "Recorded run (2026-12-01, commit f5c4497, the README's figures; not re-run by the generator): the "
    "loss fell from 6.97 to 2.72 nats/token, held out 3.73 nats/token = 1.81 bits per byte, in 2 min 4 s "
    "on 2 cores shared with a test run."
)


def _recipe(target: str) -> list[list[str]]:
    """The commands of a Makefile target's recipe, each split into words (``$(BIN)/`` dropped, the
    Makefile's other variables expanded)."""
    lines = MAKEFILE.read_text().splitlines()
    names = dict(m.groups() for line in lines if (m := re.match(r"([A-Z_]+) :?= (.*)$", line)))
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    out = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        command = line.strip().lstrip("@").split("||")[-1].replace("$(BIN)/", "")  # the venv's meshkit
        for name, value in names.items():
            command = command.replace(f"$({name})", value)
        out.append(shlex.split(command))
    return out


def _option(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


def make_run() -> str:
    """What ``make run`` does, read from the Makefile and the training config's defaults."""
    import jax

    from meshkit.models import num_params, registry
    from meshkit.train import config as C
    from meshkit.train.job import model_config

    commands = _recipe("run")
    prepare = next(c for c in commands if c[:3] == ["meshkit", "data", "prepare"])
    train = next(c for c in commands if c[:2] == ["meshkit", "train"])
    vocab = int(_option(prepare, "--vocab-size"))
    fields = {"model": _option(train, "--model"), "steps": int(_option(train, "--steps"))}
    cfg = C.default().replace(**{k: v for k, v in fields.items() if v is not None})
    family = registry.family(cfg.model.model)
    model = model_config(cfg, family, vocab)
    shapes = jax.eval_shape(lambda: family.module.init(jax.random.key(0), model))
    return _wrap(
        f"Command: `make run` (`{shlex.join(prepare)}` once, then `{shlex.join(train)}`). From the Makefile "
        f"and the training config's defaults: a byte-level BPE of {vocab:,} ids prepared from the embedded "
        f"text (Python's reference docs) into `{_option(prepare, '--out')}`; the {cfg.model.model} model of "
        f"{cfg.model.layers} layers, width {cfg.model.width}, {cfg.model.heads} heads, {num_params(shapes):,} "
        f"parameters; {cfg.run.steps} steps of batch {cfg.data.batch_size} x {cfg.data.seq_len} tokens, plan "
        f"{cfg.parallel.plan} on 8 "
        f"simulated CPU devices; held-out loss in nats/token and bits per byte.\n\n{RECORDED_RUN}"
    )


def plan_1_3b() -> str:
    """The top of ``meshkit plan``'s ranking for the 1.3 B GPT on 64 h100, and how many layouts it ranks."""
    argv = [
        sys.executable,
        "-c",
        "import sys; from meshkit.cli import main; sys.exit(main())",
        "plan",
        *PLAN_1_3B.split(),
        "--top",
        "3",
        "--json",
    ]
    out = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT).stdout)
    rows = [
        f"| {i} | {p['label']} | {p['meshkit_plan']} | {p['peak_bytes'] / 1e9:.2f} GB | "
        f"{p['step_time_s'] * 1e3:.1f} ms | {p['tokens_per_s']:,.0f} |"
        for i, p in enumerate(out["layouts"], 1)
    ]
    return "\n".join([
        _wrap(f"Command: `meshkit plan {PLAN_1_3B}` (analytical, a few CPU seconds): it ranks "
              f"{out['considered']:,} layouts, {out['fitting']:,} fit; its top 3 (what `--compile 3` compiles):"),
        "",
        "| # | layout | plan | peak predicted | step | tokens/s |",
        "|---|---|---|---|---|---|",
        *rows,
    ])  # fmt: skip


PUBLISHED_RUNS = ROOT / "tests" / "corpus" / "published_runs.json"
BEFORE = {
    "BLOOM-176B (tr11-176B-ml) main run, GBS 2048": 0.91,
    "torchtitan Llama 3 8B, FSDP2 on 64x A100-80GB (selective layer AC)": 1.09,
    "torchtitan Llama 3 70B, FSDP2 on 64x A100-80GB (full AC)": 0.89,
    "torchtitan Llama 2 13B, FSDP2 on 64x A100-80GB (no AC)": 0.99,
    "MaxText 32B, v5p-128 (64 chips), 1 slice": 1.00,
    "MaxText 128B, v5p-256 (128 chips), 1 slice": 0.99,
    "MaxText 32B, v5e-256 (256 chips), 1 slice": 0.87,
    "MaxText 22B, v4-128 (64 chips), 1 slice": 1.01,
    "MaxText 52B, v4-384 (192 chips), 1 slice": 1.05,
    "Megatron-LM paper, ZeRO-3 (DeepSpeed) GPT-3 175B, 384x A100-80GB": 1.32,
    "Megatron-LM paper, ZeRO-3 (DeepSpeed) GPT-3 175B, 768x A100-80GB": 1.59,
    "Megatron-LM paper, ZeRO-3 (DeepSpeed) GPT-3 175B, 1536x A100-80GB": 1.59,
    "Megatron-LM paper, PTD-P GPT-3 175B, 384x A100-80GB": 1.03,
    "Megatron-LM paper, PTD-P GPT-3 175B, 768x A100-80GB": 1.04,
    "Megatron-LM paper, PTD-P GPT-3 175B, 1536x A100-80GB": 1.06,
    "fms-fsdp Llama 2 7B, HSDP on 128x A100-80GB": 0.34,
    "fms-fsdp Llama 2 34B, FSDP on 128x A100-80GB": 0.83,
    "fms-fsdp Llama 2 70B, FSDP on 128x A100-80GB": 0.84,
    "fms-fsdp Llama 2 7B, HSDP on 96x H100 (PyTorch blog)": 0.34,
    "fms-fsdp Llama 2 34B, FSDP on 96x H100 (PyTorch blog)": 0.33,
    "MaxText Llama 2 7B, 1x A3 (8x H100), FSDP 8": 1.23,
    "MaxText Llama 2 70B BF16, 64x H100 (DGX Cloud benchmark), FSDP 64": 0.86,
    "NeMo Megatron GPT-3 175B BF16, 128x H100 (DGX Cloud benchmark)": 0.97,
    "NeMo Megatron GPT-3 175B BF16, 256x H100 (DGX Cloud benchmark)": 0.98,
    "NeMo Megatron GPT-3 175B BF16, 512x H100 (DGX Cloud benchmark)": 0.98,
    "NeMo Megatron GPT-3 175B BF16, 1024x H100 (DGX Cloud benchmark)": 0.98,
    "NeMo Megatron GPT-3 175B BF16, 2048x H100 (DGX Cloud benchmark)": 0.98,
    "Megatron-Core GPT 1.7B weak-scaling, 48x H100": 1.09,
    "Megatron-Core GPT 7.1B weak-scaling, 96x H100": 0.98,
    "Megatron-Core GPT 16B weak-scaling, 192x H100": 0.94,
    "Megatron-Core GPT 32B weak-scaling, 384x H100": 0.97,
    "Megatron-Core GPT 70B weak-scaling, 768x H100": 1.09,
    "Megatron-Core GPT 119B weak-scaling, 1536x H100": 1.08,
    "Megatron-Core GPT 177B weak-scaling, 2304x H100": 1.06,
    "Megatron-Core GPT 314B weak-scaling, 3072x H100": 0.99,
    "Megatron-Core GPT 462B weak-scaling, 6144x H100": 1.00,
    "Llama 3 405B pre-training stage, 8192 H100, seq 8192": 0.97,
    "Llama 3 405B pre-training stage, 16384 H100, seq 8192": 0.86,
    "PaLM 540B pre-training, 6144 TPU v4 (2 pods)": 1.10,
    "Megatron-Turing NLG 530B, 2240 A100-80GB (280 DGX nodes)": 1.14,
    "Megatron-LM paper, ZeRO-3 (DeepSpeed) GPT-3 530B, 640x A100-80GB": 1.38,
    "Megatron-LM paper, ZeRO-3 (DeepSpeed) GPT-3 530B, 1120x A100-80GB": 1.41,
    "Megatron-LM paper, ZeRO-3 (DeepSpeed) GPT-3 530B, 2240x A100-80GB": 1.44,
    "Megatron-LM paper, PTD-P GPT-3 530B, 560x A100-80GB": 0.95,
    "Megatron-LM paper, PTD-P GPT-3 530B, 1120x A100-80GB": 0.96,
    "Megatron-LM paper, PTD-P GPT-3 530B, 2240x A100-80GB": 0.98,
    "fms-fsdp Llama 2 13B, HSDP on 128x A100-80GB": 0.19,
    "fms-fsdp Llama 2 13B, HSDP on 96x H100 (PyTorch blog)": 0.35,
    "fms-fsdp Llama 2 70B, FSDP on 96x H100 (PyTorch blog)": 0.31,
    "MaxText Llama 2 70B BF16, 128x H100 (DGX Cloud benchmark), FSDP 128": 0.86,
    "MaxText Llama 2 70B BF16, 256x H100 (DGX Cloud benchmark), FSDP 256": 0.87,
    "MaxText Llama 2 70B BF16, 512x H100 (DGX Cloud benchmark), FSDP 128": 0.86,
    "MaxText Llama 2 70B BF16, 1024x H100 (DGX Cloud benchmark), FSDP 128": 0.86,
    "MaxText Llama 2 70B BF16, 2048x H100 (DGX Cloud benchmark), FSDP 128": 0.85,
}
"""Predicted / published tokens/s per run by the planner before the cost of scale and the stacks
(recorded at commit e14413b; that model is gone, so these are not recomputed). A run it did not
price (context parallelism) or one added since has none: "-"."""
BEFORE_SETS = {"calibrate": "0.33-1.59, rms log 0.397", "check": "0.19-1.44, rms log 0.460"}
"""The same model over each set, as recorded then (its rms from unrounded ratios)."""


def _spread(ratios: list[float]) -> tuple[str, str]:
    """(``lo-hi``, the rms of the logs) of predicted / published ratios."""
    rms = math.sqrt(sum(math.log(r) ** 2 for r in ratios) / len(ratios))
    return f"{min(ratios):.2f}-{max(ratios):.2f}", f"{rms:.3f}"


def planner_runs() -> str:
    """The planner's prediction of every calibrate and check run beside its published tokens/s."""
    from meshkit.planner.calibrate import load

    runs = load(PUBLISHED_RUNS)[0]
    sets = {split: [r for r in runs if r.split == split] for split in ("calibrate", "check")}
    summary = ["| set | predicted / published | typical error (rms of log) | before |", "|---|---|---|---|"]
    tables = []
    for split, mine in sets.items():
        ratios, rows = [], []
        for r in mine:
            p = r.predict()
            ratios.append(p.tokens_per_s / r.published_tokens_per_s)
            before = f"{BEFORE[r.name]:.2f}" if r.name in BEFORE else "-"
            rows.append(f"| {r.name} | {r.job.stack} | {p.layout.label()} | {r.published_tokens_per_s:,.0f} | "
                        f"{p.tokens_per_s:,.0f} | {ratios[-1]:.2f} | {before} |")  # fmt: skip
        span, rms = _spread(ratios)
        old_span, old_rms = BEFORE_SETS[split].split(", rms log ")
        summary.append(f"| {split} ({len(mine)} runs) | {span} | {rms} | {old_span}, {old_rms} |")
        tables += [
            f"**{split}** ({len(mine)} runs)",
            "",
            "| run | stack | layout | published tok/s | predicted | ratio | before |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"{split}: ratio {span}, rms log {rms} (before: {BEFORE_SETS[split]})",
            "",
        ]
    return "\n".join([*summary, "", *tables[:-1]])


ANCHORS_JSON = ROOT / "benchmarks" / "anchors.json"


def _anchors_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("meshkit_anchors", ROOT / "benchmarks" / "anchors.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _by_axis(comm: dict[str, float]) -> str:
    """Bytes per step per device by mesh axis, GiB, the largest first ('-' for none)."""
    big = sorted(((v, k) for k, v in comm.items() if v >= 2**20), reverse=True)
    return ", ".join(f"{k} {v / 2**30:.1f}" for v, k in big) or "-"


def _fits(c: dict, hbm: float) -> str:
    return (
        f"yes, {_gib(c['peak_bytes'])} of {_gib(hbm)}"
        if c["ok"]
        else f"no: {c['error'].removeprefix('does not fit: ')}"
    )


def pod_anchors() -> str:
    """Each published pod run as XLA:TPU compiled meshkit's step of it for its own slice, under its own
    layout and under the planner's best (benchmarks/anchors.json, written by benchmarks/anchors.py),
    beside the planner's prediction (recomputed: arithmetic) and the published MFU."""
    from meshkit.planner.cluster import Cluster, Job
    from meshkit.planner.hardware import hardware
    from meshkit.planner.layout import Layout
    from meshkit.planner.predict import predict

    module = _anchors_module()
    anchors = module.ANCHORS
    compiled = json.loads(ANCHORS_JSON.read_text())
    fit_rows, time_rows = [], []
    for a in anchors:
        own, best = compiled[a.name]["own"], compiled[a.name].get("best")
        hw = hardware(a.hardware)
        cluster, job = (
            Cluster(hardware=hw, devices=a.chips),
            Job(global_batch=a.global_batch, precision="bf16"),
        )
        mfu = lambda p, a=a, hw=hw: a.tflop_per_chip * 1e12 / (p.step_time_s * hw.peak_flops)  # noqa: E731
        p = predict(a.shape, a.layout, cluster, job)
        fit_rows.append(
            f"| {a.title} | {a.target} | {a.layout.label()} | {', '.join(own['attention']) or '-'} | "
            f"{_fits(own, hw.memory_bytes)} | {_gib(p.peak_bytes)} | {_by_axis(own['comm_bytes'])} | "
            f"{_by_axis(p.comm_bytes)} | {own['compile_s']:.0f} s |"
        )
        if best is not None:
            lay = Layout(**best["layout"])
            b = predict(a.shape, lay, cluster, module.best_job(a))
            best_cell = f"{lay.label()}: {mfu(b):.1%}, {_fits(best, hw.memory_bytes)}"
        else:
            best_cell = "none meshkit runs fits"
        time_rows.append(
            f"| {a.title} | {a.published_step_s:.2f} s | {a.published_mfu:.1%} | {p.step_time_s:.2f} s | {mfu(p):.1%} | "
            f"{mfu(p) / a.published_mfu - 1:+.0%} | {best_cell} |"
        )
    versions = {(c["jax"], c["libtpu"]) for row in compiled.values() for c in row.values()}
    return "\n".join([
        _wrap("Compiled by `benchmarks/anchors.py` (XLA:TPU from libtpu on this CPU machine, abstract chips: "
              + "; ".join(f"jax {j}, libtpu {t}" for j, t in sorted(versions))
              + "). Per chip, under the run's own layout: the compiler's peak against the HBM XLA:TPU gives a "
              "program, the planner's predicted peak, and the bytes each mesh axis moves per step (GiB, "
              "meshkit's ledger of the TPU HLO beside the planner's ring model):"),
        "",
        "| run | slice | layout | attention | fits (GiB per chip) | predicted peak | moved, compiled | moved, predicted | compile |",
        "|---|---|---|---|---|---|---|---|---|",
        *fit_rows,
        "",
        _wrap("Step time and MFU in each publisher's FLOP convention (the published FLOPs per chip over the "
              "predicted step): the planner's prediction of the run's own layout, and the planner's best "
              "layout that meshkit runs (`meshkit plan --runtime meshkit`'s ranking) with its predicted MFU "
              "and its compile:"),
        "",
        "| run | published step | published MFU | predicted step | predicted MFU | off | planner's best, compiled |",
        "|---|---|---|---|---|---|---|",
        *time_rows,
    ])  # fmt: skip


def _wrap(text: str) -> str:
    """Paragraphs wrapped at 100 columns, as the page's hand-written ones are."""
    return "\n\n".join(
        textwrap.fill(p, 100, break_on_hyphens=False, break_long_words=False) for p in text.split("\n\n")
    )


SECTIONS = {
    "make-run": make_run,
    "planner-published-runs": planner_runs,
    "plan-gpt-1.3b": plan_1_3b,
    "pod-anchors": pod_anchors,
}


def render(text: str) -> str:
    """``text`` with every generated section rebuilt; raises where a section's markers are missing."""
    for name, build in SECTIONS.items():
        pattern = re.compile(rf"(<!-- generated: {name} -->\n).*?(<!-- end generated: {name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(
                f"error: {PAGE.name} has no '<!-- generated: {name} -->' section: add its markers"
            )
        body = build()
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page differs from what is generated")
    args = ap.parse_args(argv)
    old = PAGE.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print(f"{PAGE.relative_to(ROOT)} is stale: run scripts/measurements.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
