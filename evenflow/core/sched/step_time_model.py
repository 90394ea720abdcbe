"""An online model of a step's duration, fitted to the step times the workers report.

A step's time is close to linear in what it holds (Sarathi-Serve, vLLM's profiling): a fixed
cost (launches, scheduling, the weights streamed once per step), a cost per token (the linears),
a cost per K/V token read (attention reading each request's context: what a decode's attention
costs, memory-bound), a cost per (query, key) pair of a prefill chunk (attention's arithmetic,
which only a chunk of many queries makes large) and a cost per request (sampling, per-request
input building). So the model is

    seconds = theta . (1, tokens / T, kv_reads / L, prefill_pairs / (T * L), requests / R)

with T, L, R the budget, max_model_len and max_num_seqs (so that every feature is O(1) and the
fit is well conditioned), fitted by recursive least squares with exponential forgetting: every
observation costs a 5x5 update, and old steps fade with ``FORGETTING`` per step, so a new model or
a machine that got slower (another process on a core) is followed within a few dozen steps.

Why reads and pairs apart: a decode reads C keys for one query, a chunk of P queries reads its C
keys once and does P*C dot products. One "pairs" term priced a chunk's pairs at a decode's
memory-bound rate: on the tiny model it overpriced a 64-token chunk after 1,536 tokens several
times over (``scripts/profile_step_time.py`` times a grid of shapes and shows both fits).

Forgetting lets the covariance grow without bound in directions the recent steps do not excite
(e.g. a long run of decode-only steps says nothing about the cost of prefill tokens); its
eigenvalues are capped (``MAX_COVARIANCE_EIGENVALUE``), the usual guard against that wind-up. Only
the directions that grew are cut: scaling the whole covariance down to a capped trace also shrank
the excited direction, so after a few hundred decode-only steps the fit stopped forgetting there.
Served on the real model, the decode step rose from 24 to 36 ms (a busy core) and the prediction
crept from 26 to 28 ms over 25 steps; with the eigenvalues capped a simulated shift is followed
within ~4 steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

# Weight of an observation k steps old: FORGETTING ** k (0.95: half-life ~14 steps).
FORGETTING = 0.95
# Initial covariance (scaled features, seconds): large means the first observations dominate.
INITIAL_COVARIANCE = 1e3
MAX_COVARIANCE_EIGENVALUE = 1e3


@dataclass(frozen=True)
class StepShape:
    """What one step holds, in the units the model takes."""

    tokens: float  # tokens computed in the step
    kv_reads: float  # sum over requests of the keys its attention reads (its context after the step)
    prefill_pairs: float  # sum over prefill chunks of (query, key) pairs
    requests: float  # requests in the step


def chunk_pairs(num_new: float, num_computed: float) -> float:
    """(query, key) pairs of a causal chunk of ``num_new`` tokens after ``num_computed``."""
    return num_new * (num_computed + (num_new + 1) / 2)


def shape_of_step(decodes: int, decode_computed: int, chunks: list[tuple[int, int]], drafts: int = 0,
                  chunk_share: float = 1.0) -> StepShape:
    """A step of ``decodes`` decodes (``decode_computed``: their computed tokens, summed; ``drafts``:
    speculative tokens verified beside them) and prefill ``chunks`` given as (new tokens, computed
    tokens before the chunk). A draft is priced as a token and a read; its few pairs are left out.
    ``chunk_share``: the share of the layers the chunks run through (a prompt prefilled by layer
    groups, layered_prefill.py), which prices their tokens, reads and pairs by that share."""
    new = sum(n for n, _ in chunks)
    return StepShape(
        tokens=decodes + drafts + chunk_share * new,
        kv_reads=decode_computed + decodes + drafts + chunk_share * (sum(computed for _, computed in chunks) + new),
        prefill_pairs=chunk_share * sum(chunk_pairs(n, computed) for n, computed in chunks),
        requests=decodes + len(chunks),
    )


class StepCosts(NamedTuple):
    """Seconds per step, per token, per K/V token read, per prefill pair, per request."""

    fixed: float
    per_token: float
    per_read: float
    per_pair: float
    per_request: float


def largest_chunk_within(cost: StepCosts, context: int, room_s: float) -> float | None:
    """The largest chunk P after ``context`` tokens that the costs price within ``room_s`` seconds beyond the
    step's base (its decodes, and the reads of the C tokens before the chunk), 0 for no room, or None where
    they see no price in prompt tokens.

    A chunk of P after C: P tokens, P more reads, P * (C + (P + 1) / 2) pairs, so
    per_pair/2 * P^2 + (per_token + per_read + per_pair * (C + 1/2)) * P - room_s <= 0: one square root, not a
    search. (Fitted costs may be negative: a < 0 is read as 0, the conservative side; b <= 0 with a <= 0 prices
    prompt tokens at nothing.)"""
    if room_s <= 0:
        return 0.0
    a = cost.per_pair / 2
    b = cost.per_token + cost.per_read + cost.per_pair * (context + 0.5)
    if a > 0:
        return (-b + math.sqrt(b * b + 4 * a * room_s)) / (2 * a)
    if b > 0:
        return room_s / b
    return None


class StepTimeModel:
    """Recursive least squares over (1, tokens, K/V reads, prefill pairs, requests) with forgetting."""

    def __init__(self, max_tokens: int, max_model_len: int, max_requests: int) -> None:
        self.scale = np.array([1.0, 1.0 / max_tokens, 1.0 / max_model_len, 1.0 / (max_tokens * max_model_len),
                               1.0 / max_requests])
        self.theta = np.zeros(5)  # seconds per scaled feature
        self.covariance = np.eye(5) * INITIAL_COVARIANCE
        self.num_observations = 0

    def features(self, shape: StepShape) -> np.ndarray:
        return self.scale * np.array([1.0, shape.tokens, shape.kv_reads, shape.prefill_pairs, shape.requests])

    def predict(self, shape: StepShape) -> float:
        return float(self.theta @ self.features(shape))

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One RLS update with forgetting."""
        x = self.features(shape)
        px = self.covariance @ x
        gain = px / (FORGETTING + x @ px)
        self.theta += gain * (seconds - self.theta @ x)
        covariance = (self.covariance - np.outer(gain, px)) / FORGETTING
        if covariance.trace() > MAX_COVARIANCE_EIGENVALUE:  # else no eigenvalue can be over the cap
            eigenvalues, vectors = np.linalg.eigh((covariance + covariance.T) / 2)
            if eigenvalues[-1] > MAX_COVARIANCE_EIGENVALUE:
                covariance = (vectors * np.minimum(eigenvalues, MAX_COVARIANCE_EIGENVALUE)) @ vectors.T
        self.covariance = covariance
        self.num_observations += 1

    def coefficients(self) -> StepCosts:
        """The fitted costs, negatives read as 0: a fit on few, similar steps can tilt one cost
        below zero, and no real cost is negative."""
        return StepCosts(*(float(c) for c in np.maximum(self.theta * self.scale, 0.0)))

    def fitted_costs(self) -> StepCosts:
        """The fitted costs as ``predict`` uses them, negatives included. What a step is planned by
        must be what it is predicted by: a fit on steps that all carried 16-token chunks tilts the
        fixed cost up and the per-token cost below zero, and the costs read with negatives as 0 then
        predicted the decodes alone at 2.5x the whole step (59.6 against 24.1 ms, tiny model, 375
        steps), so every allowance fell to the floor and the fit never saw a larger chunk."""
        return StepCosts(*(float(c) for c in self.theta * self.scale))


class MeasuredPromptCost:
    """What a prompt token beside decodes has cost, as measured, by the context its chunk follows:
    the time of each prefill step over the model's prediction of its decodes alone, per prompt
    token, summed over the last ``window`` such steps whose chunk came after a context of the same
    power of two (token-weighted, so a 16-token chunk's noise weighs little; a late chunk attends
    to more keys and costs more a token than an early one).

    A check on the fit, not a second model: the five costs are fitted over steps that are mostly
    alike, so a fit can price prompt tokens near nothing, or below, while it predicts the steps it
    sees well. Served on the tiny model, 12-14% of the planned prefill steps were predicted at or
    under their decodes alone, and chunks of 1,000-1,500 tokens so sized took 114-184 ms against a
    50 ms target: every one of the runs' worst gaps."""

    def __init__(self, window: int, max_context: int) -> None:
        buckets = max_context.bit_length() + 1
        self._seconds = np.zeros((buckets, window))
        self._tokens = np.zeros((buckets, window))
        self._counts = np.zeros(buckets, dtype=np.int64)

    def observe(self, step_s: float, decodes_alone_s: float, prompt_tokens: int, context: int) -> None:
        """One step: its measured time, the model's prediction of its decodes alone (clipped to the
        step: a fit below zero puts the whole step on the prompt, the conservative side), and the
        context its chunks followed."""
        b = self._bucket(context)
        i = self._counts[b] % self._tokens.shape[1]
        self._seconds[b, i] = step_s - min(max(decodes_alone_s, 0.0), step_s)
        self._tokens[b, i] = prompt_tokens
        self._counts[b] += 1

    def num_steps(self, context: int) -> int:
        return int(self._counts[self._bucket(context)])

    def per_token_s(self, context: int) -> float:
        """Seconds a prompt token after ``context`` (0.0: none measured there)."""
        b = self._bucket(context)
        tokens = float(self._tokens[b].sum())
        return float(self._seconds[b].sum()) / tokens if tokens > 0 else 0.0

    def same_bucket(self, contexts: list[int]) -> bool:
        """Whether chunks after these contexts are priced as one (none or one chunk: True)."""
        return len({self._bucket(context) for context in contexts}) <= 1

    def _bucket(self, context: int) -> int:
        return min(max(int(context), 0).bit_length(), len(self._counts) - 1)
