"""One process of a multi-process training test: DP or FSDP on the MLP, then a checkpoint.

Run under `meshkit launch` or `mpirun` (no arguments about processes: meshkit.distributed finds
them). Writes OUT_DIR/result-<process>.json with the parameters gathered from every process (a
file, not stdout: mpirun interleaves long lines of different processes).
Usage: train_worker.py PLAN CHECKPOINT_DIR OUT_DIR
"""

import json
import sys
from pathlib import Path

import meshkit.distributed

info = meshkit.distributed.initialize(devices_per_process=4)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import meshkit  # noqa: E402
from meshkit.data import global_batch  # noqa: E402
from meshkit.devices import host  # noqa: E402
from meshkit.models import mlp  # noqa: E402
from meshkit.train.checkpoint import Checkpointer  # noqa: E402

plan, ckpt_dir, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
params = mlp.init(jax.random.key(0), [16, 64, 64, 8])
trainer = meshkit.Trainer(mlp.loss, params, optax.adam(1e-2), plan=plan, mesh="data=8")
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 16)).astype(np.float32)
y = np.sin(x @ np.ones((16, 8), np.float32) / 4)
local = 64 // jax.process_count()
mine = slice(jax.process_index() * local, (jax.process_index() + 1) * local)
batch = global_batch(trainer.shardings.batch, (x[mine], y[mine]))  # each process loads only its slice
for _ in range(10):
    metrics = trainer.step(batch)
with Checkpointer(ckpt_dir) as ckpt:
    ckpt.save(10, trainer.params, trainer.opt_state, {"plan": plan})
result = {
    "process": info.process_index,
    "processes": info.process_count,
    "source": info.source,
    "local_devices": jax.local_device_count(),
    "devices": jax.device_count(),
    "loss": float(metrics["loss"]),
    "params": [a.tolist() for a in jax.tree.leaves(host(trainer.params))],
}
(out_dir / f"result-{info.process_index}.json").write_text(json.dumps(result))
