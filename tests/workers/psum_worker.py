"""Spawned worker: join the job, sum 1..8 across processes three ways, print one JSON line.

Usage: python psum_worker.py [DEVICES_PER_PROCESS [RESULT_DIR]]. Without DEVICES_PER_PROCESS the
device count comes from the environment (``meshkit launch --devices-per-process``); with RESULT_DIR
the JSON also goes to RESULT_DIR/result_<rank>.json (mpirun may interleave the ranks' stdout).
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit import distributed


def main() -> None:
    devices = int(sys.argv[1]) if len(sys.argv) > 1 else None
    info = distributed.initialize(
        devices_per_process=devices, timeout_s=float(os.environ.get("MESHKIT_TIMEOUT_S", 60))
    )
    n_local = jax.local_device_count()
    local = np.arange(1, n_local + 1, dtype=np.float32) + info.process_index * n_local
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)
    psum = jax.jit(
        jax.shard_map(lambda a: jax.lax.psum(a, "data"), mesh=mesh, in_specs=P("data"), out_specs=P())
    )
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    pmapped = jax.pmap(lambda a: jax.lax.psum(a, "i"), axis_name="i")(local)
    result = {
        "info": info.to_json(),
        "shard_map_psum": float(psum(x).addressable_data(0)[0]),
        "jit_sum": float(total(x).addressable_data(0)),
        "pmap_leading_axis": int(pmapped.shape[0]),
        "pmap_psum": [float(np.asarray(s.data).reshape(-1)[0]) for s in pmapped.addressable_shards],
        "global_shape": list(x.shape),
    }
    print("RESULT " + json.dumps(result), flush=True)
    if len(sys.argv) > 2:
        Path(sys.argv[2], f"result_{info.process_index}.json").write_text(json.dumps(result))
    distributed.shutdown()


if __name__ == "__main__":
    main()
