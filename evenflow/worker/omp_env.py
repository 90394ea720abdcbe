"""How the worker's OpenMP threads wait between parallel regions: set before torch loads.

By default OpenMP runtimes spin after each region (libgomp: 300,000 spins, ~0.1-1 ms; Intel's:
``KMP_BLOCKTIME`` 200 ms) so the next region starts without a wake-up. That bet holds only while
every thread owns a core. When another process shares one, each region waits for the thread that
is descheduled while its siblings burn their time slices spinning, and a step costs scheduler
slices instead of microseconds: one run with one busy process beside SmolLM2-135M on 2 cores took
8.2x as long (issue 25). Sleeping at once costs a futex wake-up per region (microseconds) on an idle
machine and removes the collapse (docs/results/api_fidelity.md has the measurements), so workers
run with ``OMP_WAIT_POLICY=PASSIVE`` and ``KMP_BLOCKTIME=0`` unless the user set how to wait.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# Any of these set by the user means they chose how threads wait: leave every one alone.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
QUIET_WAIT = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}


def quiet_omp_waits(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set ``QUIET_WAIT`` in ``env`` unless the user set a wait variable; return what was set.
    Must run before torch (and so the OpenMP runtime) is imported in this process."""
    if any(name in env for name in WAIT_VARIABLES):
        return {}
    env.update(QUIET_WAIT)
    return dict(QUIET_WAIT)
