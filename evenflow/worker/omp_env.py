"""How the worker's OpenMP threads wait between parallel regions: set before torch loads.

By default OpenMP runtimes spin long after each region (libgomp: 300,000 spins; Intel's
``KMP_BLOCKTIME`` 200 ms) so the next region starts without a wake-up. That bet holds only while
every thread owns a core. When another process shares one, each region waits for the thread that
is descheduled while its siblings burn their time slices spinning: one run with one busy process
beside SmolLM2-135M on 2 cores took 8.2x as long (issue 25). Sleeping at once removes that, but a
B=1 decode step is hundreds of regions a few microseconds apart, and a futex wake-up for each made
one stream 2x slower at 2 threads than a short spin, and slower than one thread
(docs/results/quantization.md). So libgomp's threads spin ``SPIN_COUNT`` times, long enough to
catch the next region of the same step and far shorter than a time slice, then sleep: beside a
busy process that costs 1.02-1.08x sleeping at once (docs/results/steadiness.md). Intel's runtime
sleeps at once (``KMP_BLOCKTIME=0``; torch's pip builds use libgomp). A user who set any wait
variable chose how threads wait: all of them are left alone.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# Any of these set by the user means they chose how threads wait: leave every one alone.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
SPIN_COUNT = 10_000
QUIET_WAIT = {"GOMP_SPINCOUNT": str(SPIN_COUNT), "KMP_BLOCKTIME": "0"}


def quiet_omp_waits(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set ``QUIET_WAIT`` in ``env`` unless the user set a wait variable; return what was set.
    Must run before torch (and so the OpenMP runtime) is imported in this process."""
    if any(name in env for name in WAIT_VARIABLES):
        return {}
    env.update(QUIET_WAIT)
    return dict(QUIET_WAIT)
