"""``meshkit train``: a model trained under any plan, with proof of what it cost.

``run(cfg)`` prepares everything that can fail on bad input before it writes a byte (data,
model, plan, mesh, resume checkpoint), then trains with a progress bar, evaluates on the held-out
split, checkpoints with orbax (periodically and at the end in the background, the step loop going on
while the files are written; on SIGINT or SIGTERM at a step every process agrees on, waiting for it:
:mod:`meshkit.train.stop`), and finishes with
``report.json`` (loss, throughput, communication and memory measured beside the model, FLOPs),
``loss.png``, ``cost.png`` and a summary table (what it reports is computed in
:mod:`meshkit.train.results`). Only process 0 writes files.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from meshkit._errors import MeshkitError
from meshkit.data import global_batch
from meshkit.fmt import to_json
from meshkit.models import num_params
from meshkit.rewards import RewardError
from meshkit.train import config as C
from meshkit.train import evals, optim
from meshkit.train import resume as R
from meshkit.train.checkpoint import Checkpointer
from meshkit.train.job import Job, check_no_checkpoints, lock_first, prepare, take_new_dir
from meshkit.train.lock import (
    lock_run_dir,
    make_run_dir,
    point_link,
    write_atomic,
)
from meshkit.train.metrics import METRICS_NAME, MetricsLog, read_rows
from meshkit.train.objective import OPTIONS
from meshkit.train.profile import PROFILE_DIR, StepProfiler, summary_table
from meshkit.train.profile import check_steps as check_profile
from meshkit.train.results import evaluate, mfu, moe_slots, proof, results, sample
from meshkit.train.rollout import Rollouts, nothing_learnt
from meshkit.train.stop import StopRequest
from meshkit.train.stop import exit_code as stop_exit_code
from meshkit.train.task import trained_tokens


@contextlib.contextmanager
def _metrics(job: Job) -> Iterator[None]:
    """Keep ``job.log`` open for the block (opening it here unless an outer block did)."""
    if job.log is not None or not job.writer:
        yield
        return
    job.log = MetricsLog(
        job.run_dir, trackers=C.trackers(job.cfg), first_step=job.step, config=job.cfg.to_json()
    )
    try:
        yield
    finally:
        job.log.close()
        job.log = None


def train(
    job: Job, console: Console, *, stop_after: int | None = None, profiler: StepProfiler | None = None
) -> bool:
    """Run steps up to ``cfg.run.steps`` (or ``stop_after``); returns False if stopped by a signal
    (SIGINT, SIGTERM: see :mod:`meshkit.train.stop`), after a checkpoint, with ``job.stopped_by`` set.
    ``profiler`` traces the steps it names (``--profile``)."""
    cfg = job.cfg
    profiler = profiler or StepProfiler(job.trainer, None, job.run_dir, console)
    last = cfg.run.steps if stop_after is None else min(cfg.run.steps, stop_after)
    lr = optim.lr_schedule(cfg)
    ckpt = Checkpointer(job.run_dir / "checkpoints") if job.writer or jax.process_count() > 1 else None
    columns = [
        TextColumn("[bold]train[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
    ]
    signum = None
    try:
        with (
            _metrics(job),
            Progress(*columns, console=console, disable=not console.is_terminal) as bar,
            StopRequest() as stop,
        ):
            task = bar.add_task("train", total=cfg.run.steps, completed=job.step, info="")
            while (signum := stop.agreed()) is None and job.step < last:  # every process, every step
                profiler.before(job.step + 1, job.step)
                row = _one_step(job, float(lr(job.step)))
                check_finite(job, row, ckpt)
                profiler.after(job.step)
                _log(job, row)
                bar.update(
                    task, completed=job.step, info=f"loss {row['loss']:.4f}  {row['tokens_per_s']:,.0f} tok/s"
                )
                if not console.is_terminal and (job.step % 50 == 0 or job.step == last):
                    console.print(
                        f"step {job.step}/{cfg.run.steps}  loss {row['loss']:.4f}  {row['tokens_per_s']:,.0f} tok/s"
                    )
                if cfg.run.eval_every and job.step % cfg.run.eval_every == 0 and job.step != cfg.run.steps:
                    _log(job, {"step": job.step, **evaluate(job)})
                    if (tasks := evals.line(job.evals[-1])) is not None:
                        console.print(tasks, highlight=False)
                if ckpt is not None and (job.step % cfg.run.checkpoint_every == 0 or job.step == last):
                    _save(job, ckpt)
            if signum is not None:
                _stopped(job, ckpt, console, signum)
    except KeyboardInterrupt:  # raised by code (SIGINT itself is a StopRequest)
        signum = signal.SIGINT
        _stopped(job, ckpt, console, signum)
    except RewardError:  # a rollout's reward failed before its step ran: the steps done are good, keep them
        if ckpt is not None and job.step and ckpt.latest_step() != job.step:
            _save(job, ckpt, wait=True)
        raise
    finally:
        profiler.close()
        job.batches.close()
        if ckpt is not None:
            _close(ckpt, failing=sys.exc_info()[0] is not None)
    job.stopped_by = signum
    return signum is None


def _stopped(job: Job, ckpt: Checkpointer | None, console: Console, signum: int) -> None:
    """Save the step reached (a second signal meanwhile ends the process: see StopRequest) and say so."""
    name = signal.Signals(signum).name
    if job.step == 0:
        console.print(f"stopped by {name} before the first step: nothing to save")
        return
    if ckpt is not None:
        _save(job, ckpt, wait=True)
    console.print(f"stopped by {name} at step {job.step}: checkpoint saved; continue with --resume")


def _one_step(job: Job, lr: float) -> dict[str, Any]:
    t = job.trainer
    rollout: dict[str, float] = {}
    if isinstance(job.batches, Rollouts):  # --task grpo: sampled, scored, placed (its time apart)
        began = time.perf_counter()
        local = batch = (made := job.batches.next_batch(t))[0]
        if rollout := made[1]:
            rollout["rollout_s"] = time.perf_counter() - began
    else:
        local = next(job.batches)
        batch = global_batch(t.shardings.batch, local, job.cfg.data.batch_size)
    start = time.perf_counter()
    if job.reference is not None:  # --task dpo: the frozen model's log-probs of the pairs, in the step's time
        batch = job.reference(t, batch)
    metrics = t.step(batch)
    loss = float(metrics["loss"])  # waits for the step
    elapsed = time.perf_counter() - start
    job.step += 1
    row = {
        "step": job.step,
        "loss": loss,
        "tokens_per_s": job.cfg.data.batch_size * job.cfg.data.seq_len / elapsed,
        "step_time_s": elapsed,
        "lr": lr,
        "grad_norm": float(metrics["grad_norm"]),
        **job.batches.delivered(job.batches.batch),
    }
    if (used := mfu(job, row["tokens_per_s"])) is not None:
        row["mfu"] = used
    if job.cfg.data.task in OPTIONS:  # post-training: TRL's metrics of its loss, and of its rollout
        row.update({k: float(v) for k, v in metrics.items() if k not in ("loss", "grad_norm")} | rollout)
    elif (learnt := trained_tokens(local, job.cfg.data.batch_size * job.cfg.data.seq_len)) is not None:
        row["trained_tokens"] = learnt  # fine-tuning: the targets the masked loss learnt from
    if "dropped_fraction" in metrics:  # a mixture of experts: the step's token-slots past capacity
        row["dropped_fraction"] = fraction = float(metrics["dropped_fraction"])
        row["dropped_tokens"] = round(fraction * moe_slots(job))
        row["router_aux"] = float(metrics["router_aux"])
    job.history.append(row)
    return row


class DivergedError(MeshkitError):
    """A step's loss or gradient norm is not finite: the run stops there, before it saves that step."""


def check_finite(job: Job, row: dict[str, Any], ckpt: Checkpointer | None) -> None:
    """Stop the run at a step whose loss or gradient norm is nan or infinite: the parameters it made are
    not saved (nor exported), so the last checkpoint stays the last good step. Every process sees the
    same global loss and norm, so all stop at the same step."""
    loss, norm = row["loss"], row["grad_norm"]
    if math.isfinite(loss) and math.isfinite(norm):
        return
    cfg = job.cfg
    saved = None if ckpt is None else ckpt.in_flight() or ckpt.latest_step()
    kept = f"the last checkpoint is step {saved}" if saved else "nothing was saved"
    if len(job.history) == 1 and job.step == 1:  # the very first step: the start, not the training, is wrong
        start = (
            f"the checkpoint {cfg.model.init_from[len(C.HF_PREFIX) :]}"
            if cfg.model.init_from
            else "the random init"
        )
        fix = f"check the weights and config of {start} and the data"
    else:
        fix = f"lower --lr (now {cfg.optimizer.lr:g})" + (
            "" if cfg.optimizer.clip else ", clip gradients (--clip 1.0)"
        )
        fix += ", or check the data at this step"
    raise DivergedError(
        f"step {job.step}: the loss is {loss:.6g} and the gradient norm {norm:.6g}: training stopped before "
        f"saving this step ({kept}): {fix}"
    )


def _log(job: Job, row: dict[str, Any]) -> None:
    if "eval_loss" in row or "eval_reward" in row:  # an evaluation (GRPO's scores rewards)
        job.evals.append(row)
    if job.log is not None:
        job.log.write(row)


def _save(job: Job, ckpt: Checkpointer, *, wait: bool = False) -> None:
    """Checkpoint the step reached. In the background unless ``wait``: the loop goes on once the
    arrays are copied off the devices, and waits only if the previous save is still being written."""
    if job.step in ckpt.all_steps() or job.step == ckpt.in_flight():
        if wait:
            ckpt.wait()
        return
    meta = {"step": job.step, "data": job.batches.state, "config": job.cfg.to_json()}
    ckpt.save(job.step, job.trainer.params, job.trainer.opt_state, meta, wait=wait)


def _close(ckpt: Checkpointer, *, failing: bool) -> None:
    """Finish the save in flight (a run that stops, ends or fails keeps its last checkpoint). When the
    run is already failing, its own error is the one reported: a failed save then adds nothing."""
    if not failing:
        ckpt.close()
        return
    with contextlib.suppress(Exception):
        ckpt.close()


def _trainable(job: Job) -> str:
    """`` (N trainable)`` where some parameters are frozen (LoRA), else nothing."""
    frozen = job.trainer.per_layer.trainable
    if frozen is None:
        return ""
    return f" ({num_params(frozen.train(job.trainer.params)):,} trainable)"


def _packing_line(job: Job) -> str:
    """Conversations packed into rows (fine-tuning data): how many, and how many were cut to a row (their
    answers' cut tokens are not learnt), else nothing."""
    if (p := job.batches.packing_summary) is None:
        return ""
    cut = (
        f", [bold]{p['truncated']:,} cut[/] to --seq-len {job.cfg.data.seq_len} + 1" if p["truncated"] else ""
    )
    if "pairs" in p:  # preference pairs: a row each (meshkit.data.packing.PairRows)
        return f"; {p['pairs']:,} preference pairs, a row each ({p['fill']:.0%} filled{cut})"
    return f"; {p['documents']:,} conversations packed in {p['rows']:,} rows ({p['fill']:.0%} filled{cut})"


def _attempt(what: str, problems: list[str], fn, *args) -> Any:
    """``fn(*args)``, or None and one line in ``problems`` if it fails: a report never costs the results."""
    try:
        return fn(*args)
    except Exception as e:
        if os.environ.get("MESHKIT_DEBUG"):
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:300]
        problems.append(f"{what} failed ({type(e).__name__}: {first})")
        return None


def finish(job: Job, console: Console, profile: dict[str, Any] | None = None) -> dict[str, Any]:
    """Final evaluation, then what can be made of report.json, sample, plots and the summary table;
    anything but the evaluation that fails is one warning line, and the rest is still written.
    ``profile``: the summary of the profiled steps (``--profile``), into the report and a table."""
    with _metrics(job):
        _log(job, {"step": job.step, **evaluate(job)})
    out, problems = results(job), []
    if profile is not None:
        out["profile"] = profile
    out.update(_attempt("the communication/memory report", problems, proof, job) or {"checks_ok": None})
    out["sample"] = _attempt("sampling", problems, sample, job, job.cfg.run.sample_chars) or ""
    plots = _attempt("loading matplotlib", problems, importlib.import_module, "meshkit.train.plots")
    if job.writer and plots is not None:
        loss_png = job.run_dir / "loss.png"
        _attempt("loss.png", problems, plots.loss_plot, job.history, job.evals, loss_png, job.data.loss_unit)
        if job.cfg.data.task == "grpo":
            _attempt(
                "reward.png", problems, plots.reward_plot, job.history, job.evals, job.run_dir / "reward.png"
            )
        if "communication" in out:
            _attempt("cost.png", problems, plots.cost_plot, out, job.run_dir / "cost.png")
    if problems:
        out["report_problems"] = list(problems)
    if job.writer:
        write_atomic(job.run_dir / "report.json", to_json(out, indent=2))
    if plots is not None:
        _attempt("the summary table", problems, plots.summary, out, job.run_dir, console)
    if profile is not None and "error" not in profile:
        console.print(summary_table(profile))
    if out.get("deterministic"):
        from meshkit.train.report import deterministic_line

        console.print(deterministic_line(out["deterministic"]), soft_wrap=True, highlight=False)
    for line in problems:
        console.print(
            f"[yellow]warning:[/] {line}; the training results are in {job.run_dir}", soft_wrap=True
        )
    return out


def run(
    cfg: C.TrainConfig,
    console: Console,
    *,
    resume: bool = False,
    stop_after: int | None = None,
    latest_link: Path | None = None,
    profile: tuple[int, int] | None = None,
) -> int:
    """The whole job; returns the exit code (0 done; stopped by a signal after a checkpoint: 128 +
    its number, 130 for SIGINT, 143 for SIGTERM). ``profile``: the steps (first, last) to trace into
    ``<run_dir>/profile`` (:mod:`meshkit.train.profile`). ``latest_link``: the caller named the run directory
    (``runs/<time>``) and keeps this symlink pointed at the newest run; a new run then gets a
    directory of its own (``<time>-2``... when another run took the name)."""
    R.check_stop_after(stop_after, 0)  # before the model is built; a resumed run's step is checked below
    if profile is not None:
        check_profile(profile, cfg.run.steps)
    fresh = latest_link is not None and not resume
    lock = lock_first(cfg, fresh, latest_link)  # held until run() returns: one run per directory
    job = prepare(cfg, resume=resume)
    R.check_stop_after(stop_after, job.step)
    if profile is not None:
        check_profile(profile, cfg.run.steps, job.step)
    if fresh:
        take_new_dir(job)
    if job.writer:
        if lock is None:  # a directory that did not exist: created now that the inputs are known good
            make_run_dir(job.run_dir)
            lock = lock_run_dir(job.run_dir)
            if not resume:
                check_no_checkpoints(job.run_dir)  # another run may have trained here meanwhile
        if latest_link is not None and latest_link.resolve() != job.run_dir.resolve():
            point_link(latest_link, job.run_dir.resolve())
        write_atomic(job.run_dir / "config.json", C.dumps(job.cfg))
        if resume or (job.run_dir / METRICS_NAME).exists():
            # rows past the checkpoint (and lines cut short) are dropped before appending; a run that
            # trains again from the start in its directory (a restart before any complete checkpoint)
            # keeps none of the earlier attempt's rows
            rows = read_rows(job.run_dir / METRICS_NAME, warn=False)
            write_atomic(
                job.run_dir / METRICS_NAME,
                "".join(to_json(r) + "\n" for r in rows if r["step"] <= job.step),
            )
    n = job.trainer.num_devices
    console.print(
        f"meshkit train: {num_params(job.trainer.params):,} parameters{_trainable(job)}, plan [bold]{cfg.parallel.plan}[/] on "
        f"{n} {jax.default_backend()} device(s) {dict(job.trainer.mesh.shape)}, data {job.data.source} "
        f"({job.data.num_tokens:,} tokens, vocab {job.data.vocab_size})"
        + (f", resuming at step {job.step}" if resume else "")
        + _packing_line(job),
        soft_wrap=True,
    )
    profiler = StepProfiler(job.trainer, profile if job.writer else None, job.run_dir / PROFILE_DIR, console)
    with _metrics(job):
        if not train(job, console, stop_after=stop_after, profiler=profiler):
            return stop_exit_code(job.stopped_by or signal.SIGINT)
        if job.step < cfg.run.steps:
            console.print(f"stopped after step {job.step} of {cfg.run.steps}; continue with --resume")
            return 0
        out = finish(job, console, profiler.summary)
    if job.cfg.data.task == "grpo" and (said := nothing_learnt(job.history)) is not None:
        console.print(
            f"[red]error:[/] {said}; the run's results are in {job.run_dir}", soft_wrap=True, highlight=False
        )
        return 1
    if out.get("eval_bpb") is not None:
        console.print(
            f"held-out: {out['eval_loss']:.4f} {job.data.loss_unit}, {out['eval_bpb']:.4f} bits/byte "
            f"({job.data.tokenizer}, vocab {job.data.vocab_size})",
            highlight=False,
        )
    return 0
