"""Spawned worker: join the job and run psum collectives in a loop until something fails.

Usage: python fault_worker.py [--explicit ADDRESS N RANK] [--heartbeat S] [--die-rank R --die-after K]
[--idle-rank I]. Prints ``ready`` after the first collective; process R SIGKILLs itself after K
collectives; process I sleeps (no collectives) after the first.
"""

import argparse
import os
import signal
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit import distributed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--explicit", nargs=3, metavar=("ADDRESS", "N", "RANK"))
    parser.add_argument(
        "--heartbeat", type=float, default=None, help="default: MESHKIT_HEARTBEAT_TIMEOUT_S or 30"
    )
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-after", type=int, default=20)
    parser.add_argument("--idle-rank", type=int, default=-1, help="this rank sleeps after the first step")
    args = parser.parse_args()
    explicit = (args.explicit[0], int(args.explicit[1]), int(args.explicit[2])) if args.explicit else ()
    info = distributed.initialize(
        *explicit, devices_per_process=2, heartbeat_timeout_s=args.heartbeat, timeout_s=60
    )
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), jnp.ones((2,)))
    step = jax.jit(
        jax.shard_map(lambda a: jax.lax.psum(a, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    )
    with distributed.fail_fast():
        for i in range(1_000_000_000):
            step(x).block_until_ready()
            if i == 0:
                print(f"ready {info.process_index} pid {os.getpid()}", flush=True)
            while info.process_index == args.idle_rank:
                time.sleep(1)
            if info.process_index == args.die_rank and i == args.die_after:
                os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
