"""A ModelRunner in the caller's own process behind the engine loop's ``Executor`` interface.

What the worker process (process.py) does over sockets, called directly: no process, no codec, so
tests, benchmarks and a debugger step through one loop from the scheduler into the model. A step
runs when it is sent (the loop keeps at most two in flight, as with worker processes: the runner
fills a step's not-yet-known tokens from its own last samples either way).
"""

from __future__ import annotations

from collections import deque

from evenflow.protocol import ModelRunnerOutput, SchedulerOutput, WorkerConfig, WorkerReady

from evenflow.worker.runner import ModelRunner


class InProcessExecutor:
    """One rank (world size 1), built from a WorkerConfig at ``start()`` or around a given runner."""

    def __init__(self, config: WorkerConfig | None = None, runner: ModelRunner | None = None) -> None:
        if runner is not None and config is None:
            self.config = runner.config
        elif config is not None and runner is None:
            self.config = config
        else:
            raise ValueError("give the executor a WorkerConfig or a ModelRunner (one of them)")
        if self.config.world_size != 1:
            raise ValueError(f"the in-process executor runs one rank, not world_size={self.config.world_size}")
        self.runner = runner
        self._outputs: deque[ModelRunnerOutput] = deque()

    def start(self) -> list[WorkerReady]:
        if self.runner is None:
            self.runner = ModelRunner(self.config)
        runner = self.runner
        return [WorkerReady(0, runner.determine_num_kv_blocks(), runner.block_size, runner.attention_backend,
                            str(runner.dtype), str(runner.device))]

    def init_kv_cache(self, num_blocks: int) -> None:
        self._runner().init_kv_cache(num_blocks)

    def send_step(self, so: SchedulerOutput) -> None:
        out = self._runner().execute_model(so)
        assert out is not None  # rank 0 always answers
        self._outputs.append(out)

    def recv_output(self, step_id: int) -> ModelRunnerOutput:
        out = self._outputs.popleft()
        if out.step_id != step_id:
            raise RuntimeError(f"the runner answered step {out.step_id}, expected {step_id}")
        return out

    def check_alive(self) -> None:
        """Nothing can die on its own here: a failing step raises in ``send_step``."""

    def shutdown(self, timeout: float = 5.0) -> None:
        if self.runner is not None:
            self.runner.shutdown()

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("start() the executor first")
        return self.runner
