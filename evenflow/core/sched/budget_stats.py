"""The adaptive budget's counters: cumulative for ``/metrics``, and the periodic log line's deltas."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from evenflow.protocol import SchedulerStats

log = logging.getLogger("evenflow.core.sched.budget_controller")

LOG_INTERVAL_S = 30.0
BUDGET_LOG2_BUCKETS = 17  # budgets up to 2**16 tokens; bucket i counts budgets in (2**(i-1), 2**i]


@dataclass
class BudgetStats:
    """Cumulative, since the engine started."""

    last_budget: int = 0
    budget_log2_counts: list[int] = field(default_factory=lambda: [0] * BUDGET_LOG2_BUCKETS)
    budget_sum: int = 0
    predicted_s: float = 0.0  # summed over observed steps that carried decodes
    measured_s: float = 0.0
    num_steps: int = 0
    num_within_target: int = 0
    layer_group_steps: int = 0  # steps planned for a prompt's layer group (layered_prefill.py)
    layered_prefills_stopped: int = 0  # climbs that went on in token chunks: a layer overran the room

    def count_budget(self, budget: int) -> None:
        self.last_budget = budget
        self.budget_sum += budget
        self.budget_log2_counts[min((budget - 1).bit_length(), BUDGET_LOG2_BUCKETS - 1)] += 1

    def count_step(self, predicted_s: float, measured_s: float, target_s: float) -> None:
        """A decode-carrying step the controller planned, and what it took."""
        self.predicted_s += predicted_s
        self.measured_s += measured_s
        self.num_steps += 1
        self.num_within_target += measured_s <= target_s

    def fill(self, stats: SchedulerStats, target_s: float) -> SchedulerStats:
        """Write the adaptive budget's part of the scheduler's stats."""
        b = stats.budget
        b.target_itl_s, b.token_budget = target_s, self.last_budget
        b.token_budget_log2_counts, b.token_budget_sum = list(self.budget_log2_counts), self.budget_sum
        b.step_predicted_s, b.step_measured_s = self.predicted_s, self.measured_s
        b.num_controlled_steps, b.num_steps_within_target = self.num_steps, self.num_within_target
        stats.scheduler.num_layer_group_steps = self.layer_group_steps  # layer groups are the controller's
        stats.scheduler.num_layered_prefills_stopped = self.layered_prefills_stopped
        return stats


class BudgetLog:
    """Every ``LOG_INTERVAL_S``: the target and the budgets since the last line."""

    def __init__(self) -> None:
        self._logged = BudgetStats()
        self._next_log = time.monotonic() + LOG_INTERVAL_S

    def due(self) -> bool:
        return time.monotonic() >= self._next_log

    def write(self, s: BudgetStats, target_s: float, aim_s: float, source: str, ceiling: int) -> None:
        last = self._logged
        steps = sum(s.budget_log2_counts) - sum(last.budget_log2_counts)
        controlled = s.num_steps - last.num_steps
        mean_budget = (s.budget_sum - last.budget_sum) / steps if steps else 0.0
        within = (s.num_within_target - last.num_within_target) / controlled if controlled else 1.0
        log.info("token budget: target %.1f ms (%s), aim %.1f ms, mean budget %.1f tokens over %d steps "
                 "(ceiling %d), %d of them a prompt's layer group, %.1f%% of %d steps with decodes within the target",
                 target_s * 1e3, source, aim_s * 1e3, mean_budget, steps, ceiling,
                 s.layer_group_steps - last.layer_group_steps, 100 * within, controlled)
        self._logged = replace(s, budget_log2_counts=list(s.budget_log2_counts))
        self._next_log = time.monotonic() + LOG_INTERVAL_S
