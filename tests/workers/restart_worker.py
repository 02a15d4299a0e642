"""``meshkit train`` with faults at chosen steps: ``FAULTS="attempt:rank:step:SIGNAL,..."`` makes
process ``rank`` send itself ``SIGNAL`` (KILL, TERM...) as it starts ``step``, in the job's start
number ``attempt`` (``MESHKIT_RESTART_ATTEMPT``, 0 when unset): deterministic crashes and
preemptions mid-training, whatever the machine's load. Checkpoints are saved in the background, so
before its fault the process waits until the saves already started are complete (no step directory
still temporary): the step a restart resumes from is then the same on every run. Arguments are
``meshkit``'s."""

import os
import signal
import sys
import time
from pathlib import Path

from meshkit.cli import main
from meshkit.train import loop
from meshkit.train.checkpoint import held

attempt, rank = os.environ.get("MESHKIT_RESTART_ATTEMPT", "0"), os.environ.get("MESHKIT_PROCESS_ID", "0")
faults = {}  # step -> signal, for this process in this start
for fault in filter(None, os.environ.get("FAULTS", "").split(",")):
    at_attempt, at_rank, step, name = fault.split(":")
    if (at_attempt, at_rank) == (attempt, rank):
        faults[int(step)] = signal.Signals[f"SIG{name}"]

if faults:
    one_step = loop._one_step

    def _saved(directory: Path) -> bool:
        names = [p.name for p in directory.iterdir()] if directory.is_dir() else []
        return bool(held(directory)) and len(held(directory)) == len(names)

    def _one_step(job, lr):
        if (signum := faults.get(job.step + 1)) is not None:
            deadline = time.monotonic() + 300  # a background save on a loaded 2-core machine
            while not _saved(job.run_dir / "checkpoints") and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signum)
        return one_step(job, lr)

    loop._one_step = _one_step

sys.exit(main(sys.argv[1:]))
