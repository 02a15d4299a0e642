"""Time limits for the processes the tests start, from what each was measured to cost.

A limit guards against a hang, not against slowness: a process that ends passes however long it
took, so the limit only has to be far above the slowest honest run and finite. Each call site names
what its command cost when measured: CPU seconds (user + system, of the command and every process
it waited for: a launcher's ranks too), from a run with ``MESHKIT_TEST_CPU`` set (conftest writes
each test's children's CPU seconds there; a test's figure bounds each of its commands). CPU seconds
do not stretch with load as wall seconds do; the load is read when the process starts instead:

    limit = (max(FLOOR_S, MARGIN * cpu_s) * busy + waits_s) * MESHKIT_TEST_TIMEOUT_SCALE

where ``busy`` = the 1-minute load average per core, at least 1 (a command gets about 1/busy of a
core when more processes than cores want one), and ``waits_s`` the seconds the command is made to
wait by design (a heartbeat timeout, a stall watch), which load does not shorten. MARGIN covers a
cold compilation cache, a load that rises after the start, and a slower machine; a machine slower
still sets MESHKIT_TEST_TIMEOUT_SCALE.
"""

import os

#: How many times its measured CPU seconds (times the load) a command may take.
MARGIN = 10
#: No limit below this: a Python start that imports JAX takes seconds on a loaded machine.
FLOOR_S = 60.0


def busy() -> float:
    """Runnable processes per core over the last minute, at least 1."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def limit(cpu_s: float, waits_s: float = 0.0) -> float:
    """Seconds a command measured at ``cpu_s`` CPU seconds (and ``waits_s`` of designed waits) may run
    before the test calls it hung."""
    scale = float(os.environ.get("MESHKIT_TEST_TIMEOUT_SCALE", "1"))
    return (max(FLOOR_S, MARGIN * cpu_s) * busy() + waits_s) * scale
