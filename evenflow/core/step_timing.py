"""Cumulative timing of steps, measured by the engine and the workers, merged into SchedulerStats."""

from __future__ import annotations

from dataclasses import dataclass

from evenflow.protocol import ModelRunnerOutput, SchedulerStats, WorkerTimingStats


@dataclass
class StepTiming:
    """Worker seconds, cumulative since start-up (the scheduler times its own calls)."""

    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    idle_s: float = 0.0
    num_contended_steps: int = 0

    def add_worker_step(self, mro: ModelRunnerOutput, after_idle: bool) -> None:
        """Add rank 0's split of one step. Its wait before a step that followed an empty spell is
        the clients' silence, not engine overhead, so it is not counted as idle."""
        self.prepare_s += mro.prepare_s
        self.forward_s += mro.forward_s
        self.sample_s += mro.sample_s
        self.num_contended_steps += mro.contended
        if not after_idle:
            self.idle_s += mro.wait_s

    def fill(self, stats: SchedulerStats) -> SchedulerStats:
        """Write the workers' part of the scheduler's stats."""
        stats.workers = WorkerTimingStats(prepare_s=self.prepare_s, forward_s=self.forward_s,
                                          sample_s=self.sample_s, idle_s=self.idle_s,
                                          num_contended_steps=self.num_contended_steps)
        return stats
