"""Whether a run fits before anything is allocated: the vocabulary against the data, the step's memory as
the planner's model of meshkit's own step predicts it against what a device has (``check_fits``), and the
run's model as the planner's ``ModelShape`` (``model_shape``)."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from meshkit._errors import MeshkitError
from meshkit.data import Corpus
from meshkit.models.family import Family
from meshkit.models.shape import ModelShape
from meshkit.train import config as C

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

    # a checkpoint's embedding is trained; a GRPO run's prompts are not what it learns (it samples its answers)
    if data.vocab_size > data.num_tokens and cfg.model.init_from is None and cfg.data.task != "grpo":
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
