"""The target the adaptive budget runs with when the user names none: derived from the measured steps.

With neither ``--max-num-batched-tokens`` nor ``--target-itl-ms`` given, the engine holds the streams'
inter-token latency at

    target = max(AUTO_TARGET_FLOOR_S, k x the decode-only step, the prompt step / AUTO_TARGET_PREFILL_PIECES)

with k = AUTO_TARGET_DECODE_MULTIPLE.

* The multiple sets how a step is shared: a step of k x the decode step leaves (k - 1) / k of it to
  prompt tokens, so a long prompt beside streams prefills at about (k - 1) / k of its unchunked rate
  (its first token about k / (k - 1) times later, plus what each chunk costs beyond its share, and
  less the aim's margin below the target for the machine's noise), while the streams' longest gap is
  about k decode steps where a fixed budget's is the long prompt's whole prefill. k = 8, from served
  runs on the real model (docs/results/steadiness.md, set 69): beside the fixed 2048-token budget on a
  2-core Xeon, k = 8 started a 2048-token prompt 1.24-1.44x later with a worst gap of 0.18-0.25x the
  fixed budget's and the streams' p99 at 1.00-1.02x the target; k = 6 in the same set 1.52-1.90x later
  (gaps 0.14-0.36x). A larger k buys first tokens with stalls (set 27: k = 9 left gaps of 0.34-0.42x).
* The prompt step is what a fixed budget stalls the streams for: a prompt chunk of the whole token budget
  alone, estimated from the prompt work of the steps that ran (``PromptStepEstimate``). A target of a
  ``AUTO_TARGET_PREFILL_PIECES``-th of it cuts a long prompt into about that many steps whatever the decode
  step costs: the decode step alone ties the target to the wrong cost when decoding gets cheaper and
  prefill does not (with AMX tiles for few-row products a 6-stream decode step of the real GGUF took ~0.6x
  its time, the 2048-token prefill the same, and k = 8 started long prompts 1.82x later than the fixed
  budget at 0.12x its worst gap, set 73). Six pieces keep the worst gap near a sixth of the fixed budget's
  (its bar is a quarter). Not capped by the decode term: on a 2-core AVX2 EPYC the real GGUF's 2048-token
  prefill is ~250 decode steps, and a cap of 16 decode steps (2x the decode term) held the target below two
  layers of a long prompt beside the streams: it went in token chunks of ~30 tokens at 1.3x its unchunked
  cost, and the streams' throughput with it (set 98, docs/results/steadiness.md). Where a long prompt's
  first steps run cold (a layer 2-3x its later cost on a Xeon with AMX, set 74) the target is as much
  higher until the window's lower quartile has the warm steps.
* Until ``PROMPT_STEP_MIN_SAMPLES`` such steps ran, the prompt step is the step-time fit's price of the
  budget's chunk (``prompt_step_guess_s``, set by the budget controller): a target of the decode term
  alone cut the first long prompts into ~30-token chunks, which never measure a chunk of the budget's
  size, and held for 70 s of a served run.
* The floor is what a reader cannot tell apart: 50 ms a token is 20 tokens/s, faster than anyone
  reads a stream. A small model whose decode step is a few ms gets this floor, not 8x its step, and
  its prompts chunks several times larger than 8x would allow.
* The decode step is measured, not configured: a multiplicative median tracker over the measured
  decode-only steps (up or down by ``DECODE_STEP_TRACKING`` a step), so it follows a slower machine,
  more streams or longer contexts within a few hundred steps, and a rare slow step moves it by 0.5%.
  (At 2% a step the target swung +-20% with the number of streams decoding at the moment, and steps
  sized to a target that then fell ran over it: 7% of the prefill steps in a served run.)
"""

from __future__ import annotations

import numpy as np

AUTO_TARGET_FLOOR_S = 0.050
AUTO_TARGET_DECODE_MULTIPLE = 8.0
AUTO_TARGET_PREFILL_PIECES = 6.0
DECODE_STEP_TRACKING = 0.005
# Steps whose prompt work estimates the prompt step: a chunk of at least this share of the token budget
# (its per-token cost is the budget's: shorter chunks run smaller GEMMs and attend to fewer keys).
PROMPT_STEP_MIN_SHARE = 0.25
PROMPT_STEP_WINDOW = 16  # estimates whose lower quartile is the prompt step: a group's noise is not the target's
# The quartile, not the median: a slow prompt step is a neighbour's more often than the machine's, and one long
# prompt is ~10 of the window's estimates (a served run's first prompts, in a slow phase of the host at ~2x their
# layers' later cost, raised the target from ~800 to 1,500 ms for the next 60 s, set 101).
PROMPT_STEP_QUANTILE = 0.25
PROMPT_STEP_MIN_SAMPLES = 4


class PromptStepEstimate:
    """The time of a prompt chunk of the whole token budget, alone: the lower quartile over the last
    ``PROMPT_STEP_WINDOW`` prompt steps of their prompt work scaled to the budget."""

    def __init__(self) -> None:
        self._estimates = np.zeros(PROMPT_STEP_WINDOW)
        self._count = 0
        self.seconds = 0.0  # the quartile, taken when an estimate comes in (read every step); 0.0 until enough

    def observe(self, prompt_s: float, work_tokens: float, budget_tokens: int) -> None:
        """A step whose prompt work (``work_tokens``: tokens through every layer) took ``prompt_s``."""
        self._estimates[self._count % PROMPT_STEP_WINDOW] = max(prompt_s, 0.0) * budget_tokens / work_tokens
        self._count += 1
        if self._count >= PROMPT_STEP_MIN_SAMPLES:
            window = self._estimates[:min(self._count, PROMPT_STEP_WINDOW)]
            self.seconds = float(np.quantile(window, PROMPT_STEP_QUANTILE))


class AutoTarget:
    """The derived target, from the decode-only steps and the prompt steps seen so far."""

    def __init__(self) -> None:
        self.decode_step_s = 0.0  # 0: none measured yet
        self.prompt_step = PromptStepEstimate()
        self.prompt_step_guess_s = 0.0  # the fit's price of the budget's chunk, while too few were measured

    @property
    def prompt_step_s(self) -> float:
        """The prompt step measured, or the fit's guess until enough were (0.0: neither)."""
        return self.prompt_step.seconds or self.prompt_step_guess_s

    @property
    def target_s(self) -> float:
        return max(AUTO_TARGET_FLOOR_S, AUTO_TARGET_DECODE_MULTIPLE * self.decode_step_s,
                   self.prompt_step_s / AUTO_TARGET_PREFILL_PIECES)

    def observe_decode_step(self, seconds: float) -> None:
        """One measured step that carried decodes and no prompt chunk."""
        if self.decode_step_s == 0.0:
            self.decode_step_s = seconds
        elif seconds > self.decode_step_s:
            self.decode_step_s *= 1 + DECODE_STEP_TRACKING
        else:
            self.decode_step_s /= 1 + DECODE_STEP_TRACKING
