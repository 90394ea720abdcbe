"""Prefill by layer groups: a prompt beside decoding streams climbs a few layers a step.

Under ``--target-itl-ms`` a prompt that does not fit a step's prompt allowance was cut into token
chunks, and the cut cost: every chunk step reads every weight again and multiplies fewer rows. On the
real GGUF on a 2-core Xeon a 2048-token prompt beside 6 streams took ten ~200-token chunks whose
prompt work came to ~1.5x its unchunked step's (docs/results/steadiness.md). Cut by layers instead,
each step runs all the prompt's tokens through a slice of the layers: the slices add up to the
unchunked step exactly (every layer costs the same), a slice is priced by what slices of the same
shape measured (``LayerPrice``), and the streams still get a token every step.

One prompt at a time is ``LayeredPrefill``: its request, its chunk (all its known tokens left, within
the token budget) and the next layer. Its ``num_computed_tokens`` stays where it was until the step of
its last group, which samples; its blocks are offered to prefix hits only then (until then some
layers' K/V are unwritten). While it climbs, the step's prompt room is its, but for a prompt short
enough to prefill whole within a step's allowance: that one goes in the next step, and the climb's
group beside it takes the room it leaves, or waits that step (never two in a row), so a short
request's first token waits for one step, not for the whole climb (beside the climbs of 2048-token
prompts, served on the real GGUF, the streams' new prompts had a p99 TTFT of ~1 s, 1.6-2.5x the fixed
budget's). Each such prompt then decodes beside the groups, a token a step. A group is charged its
share of the chunk against the token budget (``group_tokens``: its tokens through a slice of the layers
do that share of their work), so the chunk is the prompt's whole rest and the streams it starts still
fit: in its layers a step has more rows than the budget, up to twice it (``WorkerConfig.max_step_rows``).
The workers keep its residual stream between its steps (evenflow/worker/layered_prefill.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from evenflow.core.request import Request
from evenflow.core.sched.config import SchedulerConfig


@dataclass
class LayeredPrefill:
    """The prompt climbing the layers."""

    request: Request
    num_tokens: int  # its chunk: every known token it has left, as far as a step holds them
    num_computed: int  # the tokens before the chunk
    next_layer: int = 0

    def span(self, num_layers_now: int, num_layers: int) -> tuple[int, int]:
        """The layers of its next step, ``num_layers_now`` of them at most."""
        return self.next_layer, min(self.next_layer + max(num_layers_now, 1), num_layers)


def may_layer(config: SchedulerConfig, request: Request, num_new: int) -> bool:
    """Whether ``request``'s next ``num_new`` tokens may be prefilled by layer groups: on (the config's
    ``num_layers``), a prompt whose whole rest fits one step's token budget, and nothing that
    reads per-token rows before its last layer or per step (prompt logprobs, a grammar, an adapter)."""
    params = request.sampling_params
    return (config.num_layers > 1 and 1 < num_new <= config.max_num_batched_tokens
            and params.prompt_logprobs is None and request.grammar is None and request.lora is None)


def group_tokens(num_tokens: int, span: tuple[int, int], num_layers: int) -> int:
    """A layer group's share of its chunk's tokens, rounded so a climb's groups add up to the chunk."""
    start, end = span
    return round(num_tokens * end / num_layers) - round(num_tokens * start / num_layers)


def price_key(num_tokens: int, num_computed: int) -> tuple[int, int]:
    """What a layer group's price is kept under: its chunk's tokens and context, each to a power of
    two (a 2042- and a 2043-token chunk cost the same a token)."""
    return num_tokens.bit_length(), num_computed.bit_length()


class LayerPrice:
    """What one layer of a layered prompt costs beside the decodes, as measured on earlier groups.

    Every layer of a chunk does the same work, so a prompt's groups are priced by measurements of the
    same shape (``price_key``: its later groups by its own earlier ones, its first group by the last
    prompt's) rather than by the step-time fit, whose per-token cost is mostly learnt on steps of other
    shapes; the aim's margin for prediction errors then shrinks to the machine's noise. (Served on the
    real GGUF a climb's first group cost 5-10% more a layer than its later ones, within that margin.)"""

    def __init__(self) -> None:
        self._per_token_layer_s: dict[tuple[int, int], float] = {}

    def per_layer_s(self, key: tuple[int, int], num_tokens: int) -> float | None:
        """Seconds a layer of ``num_tokens`` tokens in a group ``key`` costs, as measured (None: never;
        0.0 is a price: a step at or under its decodes' prediction)."""
        price = self._per_token_layer_s.get(key)
        return None if price is None else price * num_tokens

    def forget(self, key: tuple[int, int]) -> None:
        """No price for ``key``: its next group probes. (A price too high to climb by would never be
        measured again: one slow start-up measurement would keep every later prompt of the shape in
        token chunks.)"""
        self._per_token_layer_s.pop(key, None)

    def observe(self, key: tuple[int, int], prompt_s: float, layers: int, num_tokens: int) -> None:
        """A step that ran ``layers`` layers of ``num_tokens`` tokens in a group ``key`` and took
        ``prompt_s`` beyond its decodes."""
        price = max(prompt_s, 0.0) / (layers * num_tokens)
        last = self._per_token_layer_s.get(key)
        if last is not None:
            price = (last + price) / 2  # the last few groups: a drifting machine is followed
        elif len(self._per_token_layer_s) >= 64:  # shapes seen long ago: forget them
            self._per_token_layer_s.clear()
        self._per_token_layer_s[key] = price
