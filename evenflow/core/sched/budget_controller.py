"""``--target-itl-ms``: each step's prefill allowance, chosen so the decoding streams stay on target.

Before a step, the decodes it will carry are known (``RunningSurvey``). The controller predicts,
with the ``StepTimeModel`` fitted to past steps, the time of those decodes plus P prompt tokens,
and allows the largest P whose prediction stays within the target. The time is quadratic in P
(a chunk of P tokens after C computed ones attends to P*C + P*(P+1)/2 pairs), so P is one square
root, not a search.

* Decodes are never limited; only the prefill riding along is.
* A floor (``PREFILL_FLOOR_TOKENS``) keeps prompts moving when even the decodes miss the target.
* With no decodes running there are no streams to protect: the whole budget goes to prompts.
* Trust: P is at most twice the largest prefill the model has been fitted on, so a model that has
  only seen small steps grows its steps by doubling instead of extrapolating far.
* Headroom: the step is aimed at the target minus a tracked high quantile (95th) of measured -
  predicted seconds: a noisy machine gets headroom, a steady one none, and the share of steps
  within target stays high rather than half of them running over. The margin is absolute, not a
  ratio: a decode step's jitter is a few milliseconds whatever the target, and a ratio learned on
  short decode-only steps took as much from every prefill allowance (a tiny model lost 30%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from evenflow.protocol import ModelRunnerOutput, SchedulerOutput, SchedulerStats

from evenflow.core.sched.config import SchedulerConfig
from evenflow.core.sched.prefill_gate import PrefillGate, RunningSurvey
from evenflow.core.sched.step_time_model import StepShape, StepTimeModel, shape_of_step

PREFILL_FLOOR_TOKENS = 16
MIN_OBSERVATIONS = 8  # steps observed before the model's prediction is trusted over the floor
TRUST_GROWTH = 2.0
# The tracked quantile of measured - predicted step time (seconds), moved by a share of the
# target per step: up by QUANTILE * STEP when a step overran its prediction + margin, else down.
ERROR_QUANTILE = 0.95
ERROR_QUANTILE_STEP = 0.02  # of the target
ERROR_MARGIN_MAX = 0.5  # of the target: never aim below half of it
BUDGET_LOG2_BUCKETS = 17  # budgets up to 2**16 tokens; bucket i counts budgets in (2**(i-1), 2**i]


@dataclass
class BudgetStats:
    """Cumulative, for the metrics."""

    last_budget: int = 0
    budget_log2_counts: list[int] = field(default_factory=lambda: [0] * BUDGET_LOG2_BUCKETS)
    budget_sum: int = 0
    predicted_s: float = 0.0  # summed over observed steps that carried decodes
    measured_s: float = 0.0
    num_steps: int = 0
    num_within_target: int = 0


@dataclass
class _Planned:
    shape: StepShape
    predicted_s: float
    has_decodes: bool


class BudgetController:
    """Chooses prefill allowances for a target step time and learns from the steps that ran."""

    def __init__(self, target_s: float, max_tokens: int, max_model_len: int, max_requests: int) -> None:
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.model = StepTimeModel(max_tokens, max_model_len, max_requests)
        self.error_margin_s = 0.0
        self.largest_prefill_seen = 0
        self.stats = BudgetStats()
        self._planned: dict[int, _Planned] = {}  # step_id -> what was predicted for it

    @classmethod
    def for_config(cls, config: SchedulerConfig) -> BudgetController | None:
        if config.target_itl_ms is None:
            return None
        return cls(config.target_itl_ms / 1000, config.max_num_batched_tokens, config.max_model_len,
                   config.max_num_seqs)

    def prefill_allowance(self, survey: RunningSurvey) -> int:
        """Prompt tokens the next step may carry beside its ``survey.decodes`` decodes."""
        room = max(self.max_tokens - survey.decodes, 0)
        if survey.decodes == 0:
            allowance = room
        elif self.model.num_observations < MIN_OBSERVATIONS:
            allowance = PREFILL_FLOOR_TOKENS
        else:
            trust = max(PREFILL_FLOOR_TOKENS, int(TRUST_GROWTH * self.largest_prefill_seen))
            allowance = max(PREFILL_FLOOR_TOKENS, min(self._largest_within_target(survey), trust))
        allowance = min(allowance, room)
        budget = survey.decodes + allowance
        self.stats.last_budget = budget
        self.stats.budget_sum += budget
        self.stats.budget_log2_counts[min((budget - 1).bit_length(), BUDGET_LOG2_BUCKETS - 1)] += 1
        return allowance

    def _largest_within_target(self, survey: RunningSurvey) -> int:
        cost = self.model.coefficients()
        d, c = survey.decodes, survey.first_prefill_context
        base = (cost.fixed + cost.per_token * d + cost.per_read * (survey.decode_context + d + c)
                + cost.per_request * (d + max(survey.prefills, 1)))
        slack = base - (self.target_s - self.error_margin_s)  # negative: room for prefill
        if slack >= 0:
            return 0
        # A chunk of P after C: P tokens, C + P reads, P * (C + (P + 1) / 2) pairs, so
        # per_pair/2 * P^2 + (per_token + per_read + per_pair * (C + 1/2)) * P + slack <= 0
        a = cost.per_pair / 2
        b = cost.per_token + cost.per_read + cost.per_pair * (c + 0.5)
        if a > 0:
            p = (-b + math.sqrt(b * b - 4 * a * slack)) / (2 * a)
        elif b > 0:
            p = -slack / b
        else:
            return self.max_tokens
        return int(min(p, self.max_tokens))

    def record(self, output: SchedulerOutput, gate: PrefillGate) -> None:
        """Remember what the scheduled step holds and what it should cost, until its time arrives."""
        if output.total_num_scheduled_tokens == 0:
            return
        survey = gate.survey
        drafts = max(output.total_num_scheduled_tokens - survey.decodes - gate.prefill_tokens, 0)
        shape = shape_of_step(survey.decodes, survey.decode_context, gate.chunks, drafts)
        step_id = output.step_id
        self._planned.pop(step_id - 8, None)  # a step never sent (an engine shutting down) is not kept
        self._planned[step_id] = _Planned(shape, self.model.predict(shape), survey.decodes > 0)
        self.largest_prefill_seen = max(self.largest_prefill_seen, gate.prefill_tokens)

    def predicted_s(self, step_id: int) -> float | None:
        """The model's prediction for a step scheduled and not yet observed (the step watchdog's yardstick)."""
        planned = self._planned.get(step_id)
        return planned.predicted_s if planned is not None and self.model.num_observations >= MIN_OBSERVATIONS else None

    def observe(self, output: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Fit the model to one step's measured time: rank 0's wait for it (the engine-core's share of
        the step's period: zero unless the loop fell behind), input building, forward and sampling."""
        planned = self._planned.pop(output.step_id, None)
        seconds = result.wait_s + result.prepare_s + result.forward_s + result.sample_s
        if planned is None or seconds <= 0:
            return
        if planned.has_decodes and planned.predicted_s > 0 and self.model.num_observations >= MIN_OBSERVATIONS:
            s = self.stats
            s.predicted_s += planned.predicted_s
            s.measured_s += seconds
            s.num_steps += 1
            s.num_within_target += seconds <= self.target_s
            above = seconds > planned.predicted_s + self.error_margin_s
            step = ERROR_QUANTILE_STEP * self.target_s * (ERROR_QUANTILE if above else ERROR_QUANTILE - 1)
            self.error_margin_s = min(max(self.error_margin_s + step, 0.0), ERROR_MARGIN_MAX * self.target_s)
        self.model.observe(planned.shape, seconds)

    def fill_stats(self, stats: SchedulerStats) -> SchedulerStats:
        s = self.stats
        stats.target_itl_s, stats.token_budget = self.target_s, s.last_budget
        stats.token_budget_log2_counts, stats.token_budget_sum = list(s.budget_log2_counts), s.budget_sum
        stats.step_predicted_s, stats.step_measured_s = s.predicted_s, s.measured_s
        stats.num_controlled_steps, stats.num_steps_within_target = s.num_steps, s.num_within_target
        return stats
