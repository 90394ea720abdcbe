"""An engine-core on a thread of the caller's process, its model on an in-process executor.

The one module that puts the parts together in one process (each part alone still imports only
``protocol``): ``LLM(..., in_process=True)`` uses it, so a debugger can step from ``generate()``
through the client, the engine loop and the scheduler into the model runner. The frontend still
talks to the engine over a ZMQ socket (an ``ipc://`` path), exactly as with a separate process.
"""

from __future__ import annotations

import logging
import threading

from evenflow.core.cli import config_and_model
from evenflow.core.component_configs import worker_template
from evenflow.core.engine import EngineCore
from evenflow.protocol import Ready
from evenflow.worker.in_process import InProcessExecutor

log = logging.getLogger("evenflow.in_process_engine")


class InProcessEngine:
    """``EngineCore`` serving ``listen`` from a daemon thread; ``flags`` are engine-core's own."""

    def __init__(self, model: str, listen: str, flags: list[str]) -> None:
        cfg, info = config_and_model(["--model", model, "--listen", listen, *flags])
        if cfg.tensor_parallel_size != 1 or cfg.nnodes != 1:
            raise ValueError("an in-process engine runs one rank: --tensor-parallel-size 1, --nnodes 1")
        executor = InProcessExecutor(worker_template(cfg, info.model_path, cfg.max_model_len or info.max_model_len))
        self.engine = EngineCore(cfg, info, executor)
        try:
            self.ready: Ready = self.engine.start()  # loads the model on this thread
        except BaseException:
            executor.shutdown()
            raise
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._serve, name="evenflow-engine-core", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.exit_code = self.engine.run()
        log.info("in-process engine-core exited with code %d", self.exit_code)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop gracefully (every live request is aborted, every client told) and wait for it."""
        self.engine.request_stop("shutdown")
        self._thread.join(timeout)
