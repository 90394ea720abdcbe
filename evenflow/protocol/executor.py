"""The seam between the engine loop and whatever runs the model (vLLM's ``Executor``).

The engine-core's step loop (evenflow/core/engine_loop.py) uses only these methods. Two
implementations: worker processes over ZMQ (``WorkerGroup``, evenflow/core/workers.py) and a
``ModelRunner`` in the caller's own process (``InProcessExecutor``, evenflow/worker/in_process.py)
for tests, benchmarks and a debugger. The interface lives here, in the contract, because the two
sit in different parts that never import each other.
"""

from __future__ import annotations

from typing import Protocol

from evenflow.protocol.worker_messages import ModelRunnerOutput, SchedulerOutput, WorkerReady


class Executor(Protocol):
    """Runs steps in order; up to two may be in flight (sent, not yet received)."""

    def start(self) -> list[WorkerReady]:
        """Load the model on every rank; one WorkerReady per rank (its block size and KV room)."""
        ...

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the engine's choice of KV blocks on every rank; returns once each holds them."""
        ...

    def send_step(self, so: SchedulerOutput) -> None:
        """Start one step (never blocks for the step's result)."""
        ...

    def recv_output(self, step_id: int) -> ModelRunnerOutput:
        """The result of the oldest step in flight, which must be ``step_id``."""
        ...

    def check_alive(self) -> None:
        """Raise (the multiprocess one: ``WorkerFailure``) when a rank has died."""
        ...

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop every rank and free what they hold."""
        ...
