"""Pictures and the summary table of a training run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.console import Console

from meshkit.fmt import fmt_bytes, table


def loss_plot(history: list[dict], evals: list[dict], path: Path, unit: str) -> None:
    """Train loss per step and held-out loss per evaluation, in ``unit`` (the data's
    :attr:`~meshkit.data.corpus.Corpus.loss_unit`)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=1, label="train")
    if held := [e for e in evals if e.get("eval_loss") is not None]:  # GRPO's evaluations score rewards
        ax.plot([e["step"] for e in held], [e["eval_loss"] for e in held], "o-", label="held-out")
    ax.set(xlabel="step", ylabel=f"cross-entropy ({unit})", title="meshkit train: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reward_plot(history: list[dict], evals: list[dict], path: Path) -> None:
    """``--task grpo``: each rollout's mean reward (its group spread shaded) and the held-out prompts' greedy
    reward per evaluation."""
    rows = [h for h in history if "reward" in h]
    fig, ax = plt.subplots(figsize=(7, 4))
    steps, mean = [h["step"] for h in rows], [h["reward"] for h in rows]
    spread = [h.get("reward_std", 0.0) for h in rows]
    ax.plot(steps, mean, lw=1, label="rollouts (mean)")
    ax.fill_between(steps, [m - s for m, s in zip(mean, spread, strict=True)],
                    [m + s for m, s in zip(mean, spread, strict=True)], alpha=0.2, label="within-group std")  # fmt: skip
    if held := [e for e in evals if "eval_reward" in e]:
        ax.plot([e["step"] for e in held], [e["eval_reward"] for e in held], "o-", label="held-out (greedy)")
    ax.set(xlabel="step", ylabel="reward", title="meshkit train --task grpo: reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cost_plot(report: dict[str, Any], path: Path) -> None:
    """Communication per collective and memory per component: measured beside model."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    comm = report["communication"]
    _bars(
        left,
        [f"{c['op']}\n{c['axes']}" for c in comm],
        [c["measured_traffic_bytes"] for c in comm],
        [c["model_traffic_bytes"] for c in comm],
        "model (ring)",
        "traffic per device per step",
    )
    mem = report["memory"]
    labels, measured, model = (
        [m["component"] for m in mem],
        [m["measured_bytes"] for m in mem],
        [m["formula_bytes"] for m in mem],
    )
    if peak := report.get("peak"):  # the step's peak (arguments + temporaries) beside the peak model
        labels.append(f"step peak\n(remat {peak['remat']})")
        measured.append(peak["measured_bytes"])
        model.append(peak["model_bytes"])
    _bars(right, labels, measured, model, "model (ZeRO formula; peak model)", "bytes per device")
    fig.suptitle(f"plan {report['plan']} on {report['mesh']}: measured beside model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, labels, measured, model, model_label, title) -> None:
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], [v / 1024 for v in measured], 0.4, label="measured (compiled)")
    ax.bar([x + 0.2 for x in xs], [v / 1024 for v in model], 0.4, label=model_label)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set(ylabel="KiB", title=title)
    ax.set_ylim(top=max([*measured, *model, 1]) / 1024 * 1.3)
    ax.legend(fontsize=8, loc="upper right")


def _x(ratio: float | None) -> str:
    """A measured/model ratio, or '-' where there is none (0 bytes of 0)."""
    return "-" if ratio is None else f"{ratio:.3f}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _mfu(report: dict[str, Any]) -> str:
    """MFU and the peak it is measured against, or why there is none (a CPU: give --peak-tflops)."""
    if report.get("mfu") is None:
        return f"- ({report.get('peak_source') or 'no peak known'})"
    peak = report["peak_flops_per_device"] / 1e12
    return f"{report['mfu']:.1%} of {report['devices']} x {peak:,.1f} TFLOP/s ({report['peak_source']})"


def summary(report: dict[str, Any], run_dir: Path, console: Console) -> None:
    """The end-of-run table, the sample, and what the run wrote."""
    rows = [*_results(report), *_costs(report)]
    ok = report.get("checks_ok")
    rows.append(["measured = model", "not measured" if ok is None else "yes" if ok else "NO"])
    title = f"Run summary ({report['steps']} steps, plan {report['plan']})"
    console.print(table(title, ["", ""], rows, justify_right=9))
    if report.get("sample"):
        console.print(f"[bold]sample:[/] {report['sample']!r}")
    names = (
        "config.json",
        "metrics.jsonl",
        "report.json",
        "loss.png",
        "reward.png",
        "cost.png",
        "schedule.png",
        "checkpoints",
    )
    wrote = [n + "/" * (n == "checkpoints") for n in names if (run_dir / n).exists()]
    console.print(f"wrote {run_dir}/: {' '.join(wrote)}")


def _preference(report: dict[str, Any]) -> str:
    """``--task dpo``'s held-out pairs: how many the policy prefers the chosen answer of, and by how much."""
    return (
        f"accuracy {report['eval_rewards/accuracies']:.1%}, reward margin "
        f"{report['eval_rewards/margins']:.4f} (chosen over rejected)"
    )


def _reward(report: dict[str, Any]) -> str:
    """``--task grpo``'s held-out prompts: the policy's greedy completions' mean reward."""
    return f"{report['eval_reward']:.4f} (greedy; above 0 on {report['eval_reward_positive']:.1%} of prompts)"


def _results(report: dict[str, Any]) -> list[list[str]]:
    """The table's rows of what the run achieved: losses, tasks, speed, devices, each source of a mixture."""
    flops = f"{report['model_flops_per_token']:,} per token; {report['achieved_flops_per_s'] / 1e9:,.2f} GFLOP/s achieved"
    devices = f"{report['devices']} {report['platform']} in {report['processes']} process(es), mesh {report['mesh']}"
    speed = f"{report['tokens_per_s']:,.0f} tokens/s ({report['step_time_s'] * 1000:.1f} ms/step)"
    rows = [
        ["loss (first step -> last step)", f"{_num(report['initial_loss'])} -> {_num(report['final_loss'])}"],
        ["held-out loss", _num(report["eval_loss"])],
        *(
            [
                [
                    "reward (first rollout -> last)",
                    f"{report['initial_reward']:.4f} -> {report['final_reward']:.4f}",
                ]
            ]
            if "initial_reward" in report
            else []
        ),
        *([["held-out preference", _preference(report)]] if "eval_rewards/accuracies" in report else []),
        *([["held-out reward", _reward(report)]] if "eval_reward" in report else []),
        *(
            [f"task: {name}", f"acc {m['acc']:.3f}, acc_norm {m['acc_norm']:.3f}"]
            for name, m in report.get("tasks", {}).items()
        ),
        ["throughput", speed],
        ["model FLOPs", flops],
        ["MFU", _mfu(report)],
        ["devices", devices],
    ]
    for m in report.get("mixture", []):
        held = "" if m["eval_loss"] is None else f"; held-out {m['eval_loss']:.4f}"
        said = f"{m['share']:.1%} of rows (weight {m['weight']:.1%}), {m['rows']:,} rows = {m['tokens']:,} tokens, "
        rows.append([f"data: {m['name']}", said + f"{m['epochs']:.2f} epochs{held}"])
    if "dropped_tokens" in report:
        dropped = f"{report['dropped_tokens']:,} ({report['dropped_fraction']:.2%} of all routed)"
        rows.append(["MoE dropped token-slots", dropped])
    return rows


def _costs(report: dict[str, Any]) -> list[list[str]]:
    """The table's rows of what the step cost, measured beside the model: communication, memory, bubble."""
    rows = [
        [
            f"comm {c['op']} over {c['axes']}",
            f"{fmt_bytes(c['measured_traffic_bytes'])} (model x{_x(c['ratio'])})",
        ]
        for c in report.get("communication", [])
    ]
    rows += [
        [f"memory: {m['component']}", f"{fmt_bytes(m['measured_bytes'])} (formula x{_x(m['ratio'])})"]
        for m in report.get("memory", [])
    ]
    if peak := report.get("peak"):
        said = f"{fmt_bytes(peak['measured_bytes'])} (model x{peak['ratio']:.3f}, remat {peak['remat']})"
        rows.append(["memory: step peak", said])
    if pipe := report.get("pipeline"):
        said = f"{_num(pipe['bubble_measured'])} (model {_num(pipe['bubble_model'])}); schedule.png"
        rows.append([f"pipeline bubble ({pipe['schedule']}, {pipe['ticks']} ticks)", said])
    return rows
