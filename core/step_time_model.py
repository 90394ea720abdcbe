"""An online model of a step's duration, fitted to the step times the workers report.

A step's time is close to linear in what it holds (Sarathi-Serve, vLLM's profiling): a fixed
cost (launches, scheduling, the weights streamed once per step), a cost per token (the linears),
a cost per (query token, context token) pair (attention) and a cost per request (sampling,
per-request input building). So the model is

    seconds = theta . (1, tokens / T, context_pairs / (T * L), requests / R)

with T, L, R the budget, max_model_len and max_num_seqs (so that every feature is O(1) and the
fit is well conditioned), fitted by recursive least squares with exponential forgetting: every
observation costs a 4x4 update, and old steps fade with ``FORGETTING`` per step, so a new model or
a machine that got slower (another process on a core) is followed within a few dozen steps.

Forgetting lets the covariance grow without bound in directions the recent steps do not excite
(e.g. a long run of decode-only steps says nothing about the cost of prefill tokens); it is capped
(``MAX_COVARIANCE_TRACE``), the usual guard against that wind-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Weight of an observation k steps old: FORGETTING ** k (0.95: half-life ~14 steps).
FORGETTING = 0.95
# Initial covariance (scaled features, seconds): large means the first observations dominate.
INITIAL_COVARIANCE = 1e3
MAX_COVARIANCE_TRACE = 1e4


@dataclass(frozen=True)
class StepShape:
    """What one step holds, in the units the model takes."""

    tokens: float  # tokens computed in the step
    context_pairs: float  # sum over requests of new tokens x context each attends to
    requests: float  # requests in the step


def chunk_pairs(num_new: float, num_computed: float) -> float:
    """(query, key) pairs of a causal chunk of ``num_new`` tokens after ``num_computed``."""
    return num_new * (num_computed + (num_new + 1) / 2)


class StepTimeModel:
    """Recursive least squares over (1, tokens, context pairs, requests) with forgetting."""

    def __init__(self, max_tokens: int, max_model_len: int, max_requests: int) -> None:
        self.scale = np.array([1.0, 1.0 / max_tokens, 1.0 / (max_tokens * max_model_len), 1.0 / max_requests])
        self.theta = np.zeros(4)  # seconds per scaled feature
        self.covariance = np.eye(4) * INITIAL_COVARIANCE
        self.num_observations = 0

    def features(self, shape: StepShape) -> np.ndarray:
        return self.scale * np.array([1.0, shape.tokens, shape.context_pairs, shape.requests])

    def predict(self, shape: StepShape) -> float:
        return float(self.theta @ self.features(shape))

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One RLS update with forgetting."""
        x = self.features(shape)
        px = self.covariance @ x
        gain = px / (FORGETTING + x @ px)
        self.theta += gain * (seconds - self.theta @ x)
        covariance = (self.covariance - np.outer(gain, px)) / FORGETTING
        trace = covariance.trace()
        if trace > MAX_COVARIANCE_TRACE:
            covariance *= MAX_COVARIANCE_TRACE / trace
        self.covariance = covariance
        self.num_observations += 1

    def coefficients(self) -> tuple[float, float, float, float]:
        """(seconds per step, per token, per context pair, per request), negatives read as 0:
        a fit on few, similar steps can tilt one cost below zero, and no real cost is negative."""
        fixed, per_token, per_pair, per_request = np.maximum(self.theta * self.scale, 0.0)
        return float(fixed), float(per_token), float(per_pair), float(per_request)
