"""One process of the multi-process pipeline test: dp+pp (1F1B) on a tiny GPT over 2 processes x 4
devices, on two meshes in turn: stage=2,data=4 (each process holds one stage, so every activation and
cotangent crosses processes) and stage=4,data=2 (the pipeline spans the processes: two stages on each,
the permutes between stages 1 and 2, and the ring's wrap, cross). Writes
OUT_DIR/result-<process>.json: per mesh, the parameters gathered from every process, which processes
hold each stage, and the bubble counted from the executed schedule.

stage=2,data=4 runs in float64 (``DTYPES``): its gradients are all-reduced over 4 data shards whose
sum gloo orders otherwise than one process does, a float32 rounding that depends on the machine
(6e-8 here, 2.1e-7 on another), so the test proves the function in float64. stage=4,data=2 runs in
float32: each gradient element there has at most 2 nonzero partial sums (2 data shards; the
embedding's and head's only on their own stage), and a + b rounds the same in either order.
Usage: pipeline_worker.py OUT_DIR
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
from meshkit.devices import host  # noqa: E402
from meshkit.models import gpt  # noqa: E402

out_dir = Path(sys.argv[1])
#: The meshes and the dtype each trains in (why: the docstring).
DTYPES = {"stage=2,data=4": "float64", "stage=4,data=2": "float32"}
tokens = np.random.default_rng(0).integers(0, 32, size=(16, 9)).astype(np.int32)
batch = (tokens[:, :-1], tokens[:, 1:])
result = {"process": info.process_index, "processes": info.process_count, "meshes": {}}
for mesh, dtype in DTYPES.items():
    cfg = gpt.GPTConfig(vocab_size=32, seq_len=8, layers=4, width=16, heads=2, scan_layers=True, dtype=dtype)
    with jax.enable_x64(dtype == "float64"):
        trainer = meshkit.Trainer(gpt.stages(cfg), gpt.init(jax.random.key(0), cfg), optax.adam(1e-2), plan="dp+pp",
                                  mesh=mesh, microbatches=4, pipeline_schedule="1f1b")  # fmt: skip
        for _ in range(2):
            metrics = trainer.step(batch)
        params = [a.tolist() for a in jax.tree.leaves(host(trainer.params))]
    record = np.asarray(trainer.last_schedule)
    result["meshes"][mesh] = {
        "dtype": dtype,
        "stage_processes": [sorted({d.process_index for d in row.flat}) for row in trainer.mesh.devices],
        "bubble": float(np.mean(record[..., 0] == 0)),
        "loss": float(metrics["loss"]),
        "params": params,
    }
(out_dir / f"result-{info.process_index}.json").write_text(json.dumps(result))
