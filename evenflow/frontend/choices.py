"""What the HTTP server and the offline ``LLM`` share about a request's choices: the plan of its
``n`` choices, their seeds, its stop strings, and the error a bad field raises."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from evenflow.protocol import SamplingParams

MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024  # each one; every delta of every choice is checked against every string


class InvalidRequest(ValueError):
    """A request field the frontend refuses: the HTTP server answers it as a 400 naming ``field``."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


@dataclass
class ChoicePlan:
    """How to run the ``n`` choices of one prompt."""

    prompt_token_ids: list[int]
    params: list[SamplingParams]  # one per choice (seeds differ)
    stop: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    priority: int


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    longest = max(stops, key=len, default="")
    if len(longest) > MAX_STOP_STRING_CHARS:
        raise InvalidRequest(f"a stop string of {len(longest)} characters is over the limit of "
                             f"{MAX_STOP_STRING_CHARS}", "stop")
    return [s for s in stops if s]


def fan_out(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice; with a seed, choice i samples with ``seed + i``. Only the
    first choice computes ``prompt_logprobs`` (the others share its prompt and may read the prefix
    cache)."""
    if n == 1:
        return [params]
    return [msgspec.structs.replace(params, seed=None if params.seed is None else params.seed + i,
                                    prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            for i in range(n)]
