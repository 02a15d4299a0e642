"""A training run's pieces before it trains: the data, the model, the Trainer under the run's
parallel spec, and the run directory (locked before anything reads it; a resumed run's checkpoint
restored onto the trainer's layout). ``prepare`` builds them all and writes nothing, so that every
bad input fails before a byte is written."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.data import Batches, Corpus, load, process_rows
from meshkit.models import gpt, lora, quantize, registry
from meshkit.models.family import Family
from meshkit.plans import axes
from meshkit.plans.assemble import assemble
from meshkit.train import config as C
from meshkit.train import evals, optim
from meshkit.train import resume as R
from meshkit.train.checkpoint import Checkpointer, CheckpointError, abstract_with, held
from meshkit.train.fits import check_fits, model_shape
from meshkit.train.lock import RunDirLock, check_link, lock_run_dir, new_run_dir
from meshkit.train.metrics import METRICS_NAME, MetricsLog, read_rows
from meshkit.train.objective import reference_step, training_loss
from meshkit.train.task import batch_options, check_data, check_learns
from meshkit.train.trainer import Trainer


@dataclass(kw_only=True)
class Job:
    """Everything a run holds: config, data, model, trainer, data stream, and what it measured."""

    cfg: C.TrainConfig
    data: Corpus
    family: Family
    """The run's model family (``--model``), resolved once from its name and handed down."""
    model: Any
    """The model's config (the family's config class)."""
    trainer: Trainer
    batches: Batches
    run_dir: Path
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    eval_loss: Any = None
    """The jitted loss used for evaluation."""
    tasks: Any = None
    """The ``--eval-tasks`` scored at each evaluation (``meshkit.train.evals.TaskEval``); None: none."""
    log: MetricsLog | None = None
    """Where rows go while the run is open (process 0 only)."""
    stopped_by: int | None = None
    """The signal (SIGINT, SIGTERM) that stopped training early, if one did."""
    reference: Any = None
    """``(trainer, batch) -> batch`` with the reference model's log-probs of its pairs (``--task dpo``:
    ``task.reference_step``); None: the run has no reference."""
    utilisation: tuple[int, float | None, str] | None = None
    """Model FLOPs per token, peak FLOP/s per device and its source (``results.utilisation``, once per run)."""

    @property
    def writer(self) -> bool:
        return jax.process_index() == 0


def prepare(cfg: C.TrainConfig, *, resume: bool = False) -> Job:
    """Build data, model and trainer, and check the resume checkpoint; writes nothing. The job's config
    is ``cfg`` with its precision resolved (``config.by_platform``)."""
    cfg = C.by_platform(cfg)
    C.validate(cfg)
    run_dir = Path(cfg.run.run_dir)
    if resume:
        R.check_same_run(saved_config(run_dir), cfg, str(run_dir))
        if _latest_step(run_dir / "checkpoints") is None:
            raise C.ConfigError(
                f"--resume: no checkpoint in '{run_dir}': train there first, or drop --resume"
            )
    else:
        check_no_checkpoints(run_dir)
    family = registry.family(cfg.model.model)
    data = load_data(cfg)
    check_data(cfg, data)
    check_fits(cfg, family, data)
    model, loss, params, logical_axes = build_model(cfg, family, data.vocab_size)
    trainer = Trainer(
        loss,
        params,
        optim.optimizer(cfg),
        spec=cfg.parallel,
        tokens_per_example=cfg.data.seq_len,
        **_step_options(cfg, family, model, logical_axes),
    )
    check_step(cfg, model, trainer.assembled)
    batches = _stream(cfg, data, family, model, trainer)
    # the held-out loss without the load-balancing loss (a mixture of experts': other families have none)
    plain = dataclasses.replace(model, router_aux_weight=0.0) if model.experts else model
    tasks = evals.build(
        cfg.run.eval_tasks,
        data.encode,
        family,
        plain,
        seq_len=cfg.data.seq_len,
        rows=cfg.data.batch_size,
        sharding=trainer.shardings.batch,
        params_of=functools.partial(family_params, cfg),
    )
    job = Job(
        cfg=cfg,
        data=data,
        family=family,
        model=model,
        trainer=trainer,
        batches=batches,
        run_dir=run_dir,
        eval_loss=jax.jit(_eval_loss(cfg, family, plain)),
        tasks=tasks,
        reference=reference_step(
            cfg, family, model, trainer.params, trainer.shardings.batch, C.lora_config(cfg)
        ),
    )
    if resume:
        _restore(job)
    return job


PREFETCH_THREADS = 2
"""Threads that read the training batches ahead of the step (grain's prefetch)."""


def _stream(cfg: C.TrainConfig, data: Corpus, family: Family, model: Any, trainer: Trainer) -> Any:
    """Where the run's batches come from: the data's stream (checked to hold something to learn), or a GRPO
    run's rollouts (``meshkit.train.rollout``: sampled from the policy as it trains)."""
    if cfg.data.task == "grpo":
        from meshkit.train import rollout

        params_of = functools.partial(family_params, cfg)
        return rollout.build(cfg, data, family, model, trainer, params_of, C.lora_config(cfg))
    batches = data.batches(
        seq_len=cfg.data.seq_len,
        global_batch=cfg.data.batch_size,
        seed=cfg.data.seed,
        threads=PREFETCH_THREADS,
        rows=process_rows(trainer.shardings.batch, cfg.data.batch_size),
        **batch_options(cfg),
    )
    check_learns(cfg, batches)
    return batches


def _eval_loss(cfg: C.TrainConfig, family: Family, model: Any) -> Any:
    """``(params, batch) -> loss`` of the held-out batches: the family's loss of the run's parameters as the
    family's own (``family_params``), or ``--task dpo``'s ``(loss, metrics)``."""
    if cfg.data.task in ("dpo", "grpo"):
        return lambda p, b: training_loss(cfg, family, model)[0](family_params(cfg, p), b)
    # its logits in pieces and its matmuls quantized as the step's
    loss = quantize.wrap(family.module.make_loss(model, loss_chunk=cfg.model.loss_chunk), cfg.model.quantize)
    return lambda p, b: loss(family_params(cfg, p), b)


def load_data(cfg: C.TrainConfig) -> Corpus:
    """The run's data (text, ids, token shards, or a mixture of them: :func:`meshkit.data.load`) with its
    training and held-out token streams; raises where a sequence does not fit (each source's held-out)."""
    data = load(cfg.data.data)
    if data.chat:  # conversations: a held-out row is padded (``Batches``), any length fits
        return data
    for name, tail in [(f"'{p.path}'", p.held_out) for p in data.parts] or [("the data", data.held_out)]:
        if cfg.data.seq_len + 1 > len(tail):
            raise C.ConfigError(
                f"--seq-len {cfg.data.seq_len} needs {cfg.data.seq_len + 1} held-out tokens but the held-out tenth of "
                f"{name} has {len(tail)}; use a shorter --seq-len or more --data"
            )
    return data


def build_model(cfg: C.TrainConfig, family: Family, vocab: int) -> tuple[Any, Any, Any, Any]:
    """``(model config, loss, initial parameters, logical axes)`` of the run's model (``--model``: its
    ``family``); under a pipeline plan the loss is the model as ``Stages``
    (blocks stacked, split over the stages). The parameters are random, or read from ``--init-from hf:DIR``
    straight into the layout the Trainer gives them (each device's block read from the files: the host
    never holds the model)."""
    model = model_config(cfg, family, vocab)
    module = family.module
    loss, _ = training_loss(cfg, family, model)
    if cfg.model.init_from is not None:
        from meshkit.train.init_from import init_from

        shapes = jax.eval_shape(lambda: module.init(jax.random.key(cfg.data.seed), model))
        axes_of = module.logical_axes(shapes)
        # the base weights' layout (a leaf lives where its axes say, trained or frozen: LoRA's adapters
        # are added below, so the base alone is read, as for full training)
        options = _step_options(cfg, family, model, axes_of) | {"trainable": None}
        placed = assemble(loss, shapes, optim.optimizer(cfg), cfg.parallel, **options)
        params = init_from(cfg, model, shardings=placed.shardings.params)
    else:
        params = module.init(jax.random.key(cfg.data.seed), model)
    if (adapters := C.lora_config(cfg)) is not None:  # LoRA: adapters beside the frozen base
        params = lora.add(jax.random.fold_in(jax.random.key(cfg.data.seed), 1), params, adapters)
        return model, lora.wrap(loss, adapters), params, lora.logical_axes(params, module.logical_axes)
    return model, loss, params, module.logical_axes(params)


def check_step(cfg: C.TrainConfig, model: Any, assembled: Any) -> None:
    """What the run's step (``plans.Assembled``) cannot take, before the run directory is written, not at
    the first compile: a ``--batch-size`` that does not divide over the data axis and micro-batches, a
    sequence, heads or experts an active axis cannot split (``Axis.check_run``)."""
    assembled.check_examples(cfg.data.batch_size)
    for axis in axes.active(assembled.spec.plan_info):
        axis.check_run(
            axis.size(assembled.placement),
            seq_len=cfg.data.seq_len,
            heads=model.heads,
            experts=model.experts,
            form=cfg.parallel.context_attention,
        )


def family_params(cfg: C.TrainConfig, params: Any) -> Any:
    """A run's parameters as its family's own: a LoRA run's adapters merged into their weights."""
    adapters = C.lora_config(cfg)
    return params if adapters is None else lora.merge(params, adapters)


def _step_options(cfg: C.TrainConfig, family: Family, model: Any, logical_axes: Any) -> dict[str, Any]:
    """The run's step options beside its spec (the Trainer's, and ``assemble``'s for the layout an
    ``--init-from`` checkpoint is read into: the same, so the Trainer keeps the arrays where they are)."""
    return {
        "clip_norm": cfg.optimizer.clip,
        "logical_axes": logical_axes,
        "grad_norm": True,
        "has_aux": training_loss(cfg, family, model)[1],
        "units": family.units(model),
        "trainable": run_trainable(cfg),
    }


def run_trainable(cfg: C.TrainConfig) -> Any:
    """Which leaves the run trains (``Trainer``'s ``trainable=``): a LoRA run its adapters, else None (all);
    the step and ``load_run``'s optimizer state both ask it."""
    return None if C.lora_config(cfg) is None else lora.trainable


def model_config(cfg: C.TrainConfig, family: Family, vocab: int) -> Any:
    """The run's model config: from its shape options, or from ``--init-from``'s checkpoint (checked
    against them and the data's vocabulary); computing in its precision (by platform where none is
    given: ``config.by_platform``), scanned under a pipeline."""
    spec = C.by_platform(cfg).parallel
    scan = cfg.model.scan_layers or spec.plan_info.pipeline
    if cfg.model.init_from is not None:
        from meshkit.train.init_from import checkpoint_config

        return checkpoint_config(cfg, family, vocab, precision=spec.precision, scan_layers=scan)
    return family.config.from_shape(
        model_shape(cfg, family, vocab), precision=spec.precision, scan_layers=scan
    )


def saved_config(run_dir: Path) -> C.TrainConfig:
    """The config a run directory was started with; raises unless it holds a run to resume. Reads
    ``config.json`` only: the checkpoints are listed by ``prepare``, once the run holds the lock."""
    saved_path = run_dir / "config.json"
    if not saved_path.is_file() or not (run_dir / "checkpoints").is_dir():
        raise C.ConfigError(f"--resume: no checkpoint in '{run_dir}': train there first, or drop --resume")
    try:
        data = json.loads(saved_path.read_text())
    except ValueError as e:
        raise C.ConfigError(f"--resume: '{saved_path}' is not JSON ({e}): give the run's directory") from None
    return C.TrainConfig.from_json(data, where=f"--resume: '{saved_path}'")


def resume_on_restart(run_dir: str | None) -> bool:
    """Whether this start of a job is a restart (``meshkit launch --max-restarts``, a SLURM requeue:
    :func:`meshkit.distributed.restart_attempt`) of a run in ``run_dir`` that holds a checkpoint,
    which it then continues. A first start, or a run directory not named, trains as asked."""
    from meshkit.distributed import restart_attempt

    if not run_dir or restart_attempt() == 0:
        return False
    checkpoints = Path(run_dir) / "checkpoints"
    return (
        (Path(run_dir) / "config.json").is_file()
        and checkpoints.is_dir()
        and _latest_step(checkpoints) is not None
    )


def _latest_step(directory: Path) -> int | None:
    with Checkpointer(directory) as ckpt:  # only lists: deletes nothing
        return ckpt.latest_step()


def check_no_checkpoints(run_dir: Path) -> None:
    """A new run must not train into a directory that holds another run's checkpoints. A restart whose
    run was stopped before its first checkpoint was complete (only a save's temporary directory is
    there) trains again from the start in the same directory."""
    if held(run_dir / "checkpoints"):  # an interrupted first save's leftovers are not a run's checkpoints
        raise C.ConfigError(
            f"run directory '{run_dir}' already holds checkpoints: pass --resume, or a new --run-dir"
        )


def _restore(job: Job) -> None:
    """Restore the newest readable step onto the trainer's layout. A checkpoint of the GPT's other
    form (``--scan-layers`` changed on resume) is read replicated in its own form and converted."""
    t = job.trainer
    with Checkpointer(job.run_dir / "checkpoints") as ckpt:
        try:
            params, opt_state, meta = ckpt.restore(
                None,
                abstract_with(t.params, t.shardings.params),
                abstract_with(t.opt_state, t.shardings.opt_state),
            )
        except CheckpointError as first:
            try:
                params, opt_state, meta = ckpt.restore(None, *_other_form(t, job.model.scan_layers))
            except CheckpointError:
                raise first from None  # neither form: the first error names the mismatch
            params, opt_state = gpt.to_form((params, opt_state), job.model.scan_layers)
            params, opt_state = jax.device_put(
                (params, opt_state), (t.shardings.params, t.shardings.opt_state)
            )
    _check_config_unedited(job, meta)
    t.params, t.opt_state = params, opt_state
    job.batches.restore(meta["data"])
    job.step = int(meta["step"])
    job.history = [h for h in read_rows(job.run_dir / METRICS_NAME, warn=job.writer) if h["step"] <= job.step]
    job.evals = [e for e in job.history if "eval_loss" in e]
    job.history = [h for h in job.history if "loss" in h]


def _check_config_unedited(job: Job, meta: dict) -> None:
    """The options that fixed the run are the checkpoint's: an edited config.json is refused."""
    if "config" not in meta:
        return
    where = f"the checkpoint of step {meta['step']}"
    at_save = C.TrainConfig.from_json(meta["config"], where=where)
    for key, what in R.FIXED_ON_RESUME.items():
        if R.effective(at_save, key) != R.effective(job.cfg, key):
            raise C.ConfigError(
                f"--resume: {C.flag(key)} is {R.effective(job.cfg, key)!r} in {job.run_dir / 'config.json'} but "
                f"{R.effective(at_save, key)!r} in {where}, and it fixes {what}: restore config.json"
            )


def _other_form(t: Trainer, scan_layers: bool) -> tuple[Any, Any]:
    """Restore targets for a checkpoint of the GPT's other form, replicated over the trainer's mesh."""
    replicated = NamedSharding(t.mesh, P())
    shapes = jax.eval_shape(lambda tree: gpt.to_form(tree, not scan_layers), (t.params, t.opt_state))
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated), shapes)


def lock_first(cfg: C.TrainConfig, fresh: bool, latest_link: Path | None) -> RunDirLock | None:
    """Process 0, before anything reads, lists or cleans the run directory: lock it if it exists
    (a second run on a live one is refused here, having touched nothing). A new run's ``latest_link``
    must be a link or absent; its directory is created later, once its inputs are known good."""
    if jax.process_index() != 0:
        return None
    if fresh:
        check_link(latest_link)
        return None
    run_dir = Path(cfg.run.run_dir)
    return lock_run_dir(run_dir) if run_dir.is_dir() else None


def take_new_dir(job: Job) -> None:
    """Create the new run's own directory (process 0; another run started in the same second gets
    another name) and give its name to every process."""
    name = str(new_run_dir(job.run_dir)) if job.writer else ""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        buf = np.zeros(4096, np.uint8)
        buf[: len(name.encode())] = np.frombuffer(name.encode(), np.uint8)
        name = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).rstrip(b"\0").decode()
    job.run_dir, job.cfg = Path(name), job.cfg.replace(run_dir=name)
