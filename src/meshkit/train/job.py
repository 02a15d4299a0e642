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

from meshkit._errors import MeshkitError
from meshkit.data import Batches, Corpus, load, process_rows
from meshkit.models import gpt, lora, registry
from meshkit.models.family import Family
from meshkit.models.shape import ModelShape
from meshkit.plans import axes
from meshkit.plans.assemble import assemble
from meshkit.train import config as C
from meshkit.train import evals, optim
from meshkit.train import resume as R
from meshkit.train.checkpoint import Checkpointer, CheckpointError, abstract_with, held
from meshkit.train.lock import RunDirLock, check_link, lock_run_dir, new_run_dir
from meshkit.train.metrics import METRICS_NAME, MetricsLog, read_rows
from meshkit.train.task import batch_options, check_data, check_learns, reference_step, training_loss
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
    batches = data.batches(
        seq_len=cfg.data.seq_len,
        global_batch=cfg.data.batch_size,
        seed=cfg.data.seed,
        threads=PREFETCH_THREADS,
        rows=process_rows(trainer.shardings.batch, cfg.data.batch_size),
        **batch_options(cfg),
    )
    check_learns(cfg, batches)
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


def _eval_loss(cfg: C.TrainConfig, family: Family, model: Any) -> Any:
    """``(params, batch) -> loss`` of the held-out batches: the family's loss of the run's parameters as the
    family's own (``family_params``), or ``--task dpo``'s ``(loss, metrics)``."""
    if cfg.data.task == "dpo":
        return lambda p, b: training_loss(cfg, family, model)[0](family_params(cfg, p), b)
    return lambda p, b: family.module.make_loss(model)(family_params(cfg, p), b)


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


#: Bytes per parameter that bound a step's state from above (fp32 parameters, gradients, two Adam
#: moments, and as much again for the gathered and temporary copies) for ``check_fits``'s gate.
_STATE_BOUND = 32


def check_fits(cfg: C.TrainConfig, family: Family, data: Corpus) -> None:
    """Refuse, before anything is allocated or compiled, a vocabulary larger than the data holds
    tokens (a ``.npy``'s ids or a prepared directory's tokenizer: most embedding rows would never
    train; not where ``--init-from`` brings trained rows, as fine-tuning does), then a run whose step the planner's model of
    meshkit's own step (``Job(runtime="meshkit")``) predicts to need more memory per device than a
    device has: ``memory_stats()['bytes_limit']`` where the device reports it, else the host's
    available memory (``/proc/meminfo``) shared by this process's devices. A model far below that
    (a generous bound on parameters, state and activations under an eighth of it) is not predicted."""
    from meshkit.planner.sizes import param_count

    if (
        data.vocab_size > data.num_tokens and cfg.model.init_from is None
    ):  # a checkpoint's embedding is trained
        tokens = np.concatenate(
            [data.train.read(0, len(data.train)), data.held_out.read(0, len(data.held_out))]
        )
        used = len(np.unique(tokens))
        size = (
            f"a vocabulary of {data.vocab_size:,} ({data.vocab_size * cfg.model.width:,} embedding parameters at "
            f"--width {cfg.model.width}) for {data.num_tokens:,} tokens using {used:,} distinct ids"
        )
        if data.tokenizer == "ids":
            raise C.ConfigError(
                f"token ids in '{data.source}' reach {data.vocab_size - 1:,}: {size}: renumber the ids from 0 "
                "(np.unique(ids, return_inverse=True)) or give more data"
            )
        raise C.ConfigError(
            f"the tokenizer of {data.source} has {size}: most embedding rows would never train: prepare the "
            f"text with a smaller tokenizer (meshkit data prepare without --tokenizer trains one of "
            f"--vocab-size ids) or give more data"
        )
    spec, shape = cfg.parallel, model_shape(cfg, family, data.vocab_size)
    devices = jax.device_count()
    available = device_memory()
    if available is None:
        return
    activations = (
        4
        * cfg.data.batch_size
        * cfg.model.layers
        * (64 * cfg.data.seq_len * cfg.model.width + 8 * cfg.model.heads * cfg.data.seq_len**2)
    )
    if _STATE_BOUND * param_count(shape) + activations < available / 8:
        return
    from meshkit.fmt import fmt_bytes
    from meshkit.planner.auto import hardware_of
    from meshkit.planner.cluster import Cluster
    from meshkit.planner.cluster import Job as PlannerJob
    from meshkit.planner.layout import Layout
    from meshkit.planner.predict import predict

    if spec.plan_info.split_axes("sequence"):
        return  # the planner's meshkit runtime prices no sequence split: it would price whole sequences
    try:
        layout = Layout.from_spec(spec, devices, cfg.data.batch_size)
        hw, _ = hardware_of(jax.devices()[0].device_kind)
        n = layout.devices
        job = PlannerJob(
            global_batch=cfg.data.batch_size,
            precision=spec.precision,
            runtime="meshkit",
            flash_attention=False,
        )
        pred = predict(shape, layout, Cluster(hardware=hw, devices=n, devices_per_host=n), job)
    except (MeshkitError, ValueError, KeyError):
        return  # a layout the planner cannot describe: the Trainer's own checks speak for it
    if not pred.valid or pred.peak_bytes <= available:
        return
    parts = ", ".join(
        f"{k.replace('_', ' ')} {fmt_bytes(v)}" for k, v in pred.memory.items() if v >= 0.01 * pred.peak_bytes
    )
    raise C.ConfigError(
        f"this run needs about {fmt_bytes(pred.peak_bytes)} per device ({parts}; the planner's model of the step) "
        f"but a device has {fmt_bytes(available)}: use a smaller --width, --layers, --seq-len or --batch-size, "
        f"a plan that shards more (--plan fsdp), --remat layer, or more devices"
    )


def device_memory() -> float | None:
    """Bytes one device of this process can use: its ``bytes_limit`` where reported, else the host's
    ``MemAvailable`` over this process's devices (simulated CPU devices share the host)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    host = host_available()
    return None if host is None else host / jax.local_device_count()


def host_available() -> float | None:
    """The host's ``MemAvailable`` in bytes (``/proc/meminfo``), None where it is not reported."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


def model_shape(cfg: C.TrainConfig, family: Family, vocab: int) -> ModelShape:
    """The shape of the run's model (what ``--plan auto`` plans for and the model is built from): the
    run's options, its family's own among them, and from ``--init-from`` what its checkpoint fixes."""
    own = {name: cfg.get(name) for name in family.options}
    if cfg.model.init_from is not None:
        from meshkit.train.init_from import checkpoint_shape

        own |= checkpoint_shape(cfg, family)
    moe = {
        "experts": cfg.model.experts,
        "experts_per_token": cfg.model.experts_per_token,
        "capacity_factor": cfg.model.capacity_factor,
    }
    return ModelShape(
        name=family.name,
        family=family.name,
        layers=cfg.model.layers,
        width=cfg.model.width,
        heads=cfg.model.heads,
        vocab=vocab,
        seq=cfg.data.seq_len,
        gated=family.gated,
        **(moe | own),
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
