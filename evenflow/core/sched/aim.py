"""The aim: the predicted step time the adaptive budget sizes prefill to, as a share of the target.

The target is a p99 of the streams' gaps, so about 1% of the gaps may run over it. The aim is the
target divided by a high quantile of the step-time model's error (measured / predicted) over the last
``AIM_WINDOW`` steps that filled it (prefill beside decodes sized to it, predicted at ``FILLED_SHARE`` of
the target or more): the (1 - q) quantile, q being three quarters of 1% of all the streams' gaps
(``AIM_SHARE_MARGIN``) divided by the share of the gaps that fill the aim (the others are predicted
too far below the target to reach it, and take the rest of the 1%). So about q of those steps run over
the target, and the aim follows a noisier or quieter machine within a window. (A tracker that stepped
the aim down 5% of the target per step over it and up 100x less per step under sat at its 0.5x floor in
a served run: a few slow steps took ~1000 steps to undo, and the streams ran at half the target.)
"""

from __future__ import annotations

import numpy as np

GAPS_OVER_TARGET = 0.01  # the target is a p99: the share of the streams' gaps that may run over it
# The aim plans for three quarters of that share: the window's quantile is an estimate and the
# machine's noise drifts. At the full share served p99s ran up to 1.12-1.23x the target; at half the
# aim sat at 0.55-0.65 of it and long prompts paid for the margin (docs/results/steadiness.md).
AIM_SHARE_MARGIN = 0.75
MAX_OVER_SHARE = 0.25  # of the steps that fill the aim, however few of the gaps they are
AIM_WINDOW = 256  # steps that filled the aim, whose prediction errors set it
AIM_MIN_SAMPLES = 16  # errors seen before the aim moves off its start
AIM_MIN = 0.5  # of the target
# Before the errors are known: where the aim settled in served runs on the real GGUF (0.83-0.87 of the
# target); at the target itself the first prompt's steps were the run's worst gaps.
AIM_START = 0.85
STALL_BOUND = 2.0  # of the target: the longest step planned
# Of the target (not the aim, or noisy steps that lower the aim count as filling it, and lower it further):
# a step predicted below it cannot reach the target at the errors such steps show (served on the real GGUF,
# a short prompt's whole step was predicted at 0.2 of the aim, with errors to 1.4x at p99). Counted with
# the steps that fill the aim, those errors held it at 0.80 of the target; the filled steps' own (groups of
# a climb, p90 1.10x) set it at ~0.9. Below the aim's floor, or at the floor no step would count and
# the aim could not come back up.
FILLED_SHARE = 0.4
# The share of decode-carrying steps that fill the aim, averaged over the last ~1,000 of them (all of
# them, until there are that many): the p99 is of all the gaps, so the share is the long run's. (Over
# ~50 it rose to ~1 within each long prompt and the aim took the 99th percentile of the errors there.)
FILLED_SHARE_WINDOW = 1024


assert FILLED_SHARE < AIM_MIN  # a step planned at the aim's floor still fills it


class Aim:
    """The aim as a share of the target (which may move: ``AutoTarget``), learnt from the steps that ran."""

    def __init__(self) -> None:
        self.share = AIM_START  # of the target, within [AIM_MIN, STALL_BOUND]
        self.filled_step_share = 1.0  # of the decode-carrying steps, those that filled the aim
        self._num_steps = 0  # decode-carrying steps followed
        self._errors = np.ones(AIM_WINDOW)  # measured / predicted, of the last aimed prefill steps (a ring)
        self._num_errors = 0

    def follow_step(self, filled: bool) -> None:
        """One decode-carrying step ran: the long run's share of them that fill the aim."""
        self._num_steps += 1
        smoothing = 1 / min(self._num_steps, FILLED_SHARE_WINDOW)
        self.filled_step_share += smoothing * (filled - self.filled_step_share)

    def follow_error(self, error: float) -> None:
        """A step that filled the aim took ``error`` x its prediction."""
        self._errors[self._num_errors % AIM_WINDOW] = error
        self._num_errors += 1
        if self._num_errors >= AIM_MIN_SAMPLES:
            share_over = min(MAX_OVER_SHARE, AIM_SHARE_MARGIN * GAPS_OVER_TARGET / max(self.filled_step_share, 1e-3))
            quantile = float(np.quantile(self._errors[:min(self._num_errors, AIM_WINDOW)], 1 - share_over))
            self.share = min(max(1 / quantile, AIM_MIN), STALL_BOUND)
