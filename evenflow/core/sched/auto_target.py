"""The target the adaptive budget runs with when the user names none: derived from the decode step.

With neither ``--max-num-batched-tokens`` nor ``--target-itl-ms`` given, the engine holds the streams'
inter-token latency at

    target = max(AUTO_TARGET_FLOOR_S, AUTO_TARGET_DECODE_MULTIPLE x the decode-only step)

* The multiple sets how a step is shared: a step of k x the decode step leaves (k - 1) / k of it to
  prompt tokens, so a long prompt beside streams prefills at about (k - 1) / k of its unchunked rate
  (its first token about k / (k - 1) times later, plus what each chunk costs beyond its share, and
  less the aim's margin below the target for the machine's noise). k = 6, from served runs on the
  real model (docs/results/steadiness.md): at k = 4 the aim's margin (0.7-0.85 of the target on a
  busy 2-core machine) and the decodes' share of a prefill step left a prompt 46-60% of each step,
  and its first token came 1.6-2.1x later than unchunked; at k = 6, 1.2-1.45x, the streams' p99 on
  the target. Against the fixed 2048-token budget on a 2-core Xeon (set 27): k = 4, 6, 9 started a
  2048-token prompt 1.95-2.16x, 1.54-1.71x, 1.37-1.51x later and left a worst gap of 0.16-0.18x,
  0.23-0.27x, 0.34-0.42x the fixed budget's: the larger k buys first tokens with stalls.
* The floor is what a reader cannot tell apart: 50 ms a token is 20 tokens/s, faster than anyone
  reads a stream. A small model whose decode step is a few ms gets this floor, not 6x its step, and
  its prompts chunks several times larger than 6x would allow.
* The decode step is measured, not configured: a multiplicative median tracker over the measured
  decode-only steps (up or down by ``DECODE_STEP_TRACKING`` a step), so it follows a slower machine,
  more streams or longer contexts within a few hundred steps, and a rare slow step moves it by 0.5%.
  (At 2% a step the target swung +-20% with the number of streams decoding at the moment, and steps
  sized to a target that then fell ran over it: 7% of the prefill steps in a served run.)
"""

from __future__ import annotations

AUTO_TARGET_FLOOR_S = 0.050
AUTO_TARGET_DECODE_MULTIPLE = 6.0
DECODE_STEP_TRACKING = 0.005


class AutoTarget:
    """The derived target, from the decode-only steps seen so far."""

    def __init__(self) -> None:
        self.decode_step_s = 0.0  # 0: none measured yet

    @property
    def target_s(self) -> float:
        return max(AUTO_TARGET_FLOOR_S, AUTO_TARGET_DECODE_MULTIPLE * self.decode_step_s)

    def observe_decode_step(self, seconds: float) -> None:
        """One measured step that carried decodes and no prompt chunk."""
        if self.decode_step_s == 0.0:
            self.decode_step_s = seconds
        elif seconds > self.decode_step_s:
            self.decode_step_s *= 1 + DECODE_STEP_TRACKING
        else:
            self.decode_step_s /= 1 + DECODE_STEP_TRACKING
