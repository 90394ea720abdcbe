"""Every rule a request must meet before it is scheduled, defined once for all parts.

The frontend turns a ``Problem`` into an HTTP 400 (``field`` becomes OpenAI's ``param``); the
engine-core turns it into an ``invalid_request`` Error frame for a wire client that skipped the
frontend. Pure functions of the message and the model's limits: no state, no I/O.
"""

from __future__ import annotations

import math

from msgspec import Struct

from evenflow.protocol.messages import INT64_MAX, INT64_MIN, AddRequest, SamplingParams

MAX_LOGPROBS = 20  # OpenAI's (and vLLM's default) most top alternatives per token


class Problem(Struct, frozen=True):
    """Why a request cannot be scheduled: the offending field and a message naming the values."""

    field: str
    message: str

    def __str__(self) -> str:
        return self.message


def check_sampling_params(p: SamplingParams, vocab_size: int | None = None) -> Problem | None:
    """The first bad field of ``p``, or None when the params are usable."""
    if p.max_tokens < 1:
        return Problem("max_tokens", f"max_tokens must be >= 1, got {p.max_tokens}")
    if not 0 <= p.min_tokens <= p.max_tokens:
        return Problem("min_tokens", f"min_tokens must be in [0, max_tokens={p.max_tokens}], got {p.min_tokens}")
    if not (math.isfinite(p.temperature) and p.temperature >= 0.0):
        return Problem("temperature", f"temperature must be finite and >= 0, got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:  # also refuses NaN
        return Problem("top_p", f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < -1:
        return Problem("top_k", f"top_k must be -1, 0 (disabled) or positive, got {p.top_k}")
    if not 0.0 <= p.min_p <= 1.0:
        return Problem("min_p", f"min_p must be in [0, 1], got {p.min_p}")
    if not -2.0 <= p.presence_penalty <= 2.0:
        return Problem("presence_penalty", f"presence_penalty must be in [-2, 2], got {p.presence_penalty}")
    if not -2.0 <= p.frequency_penalty <= 2.0:
        return Problem("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}")
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0.0):
        return Problem("repetition_penalty", f"repetition_penalty must be finite and > 0, got {p.repetition_penalty}")
    if p.logprobs is not None and not 0 <= p.logprobs <= MAX_LOGPROBS:
        return Problem("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}")
    if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= MAX_LOGPROBS:
        return Problem("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {p.prompt_logprobs}")
    if p.seed is not None and not INT64_MIN <= p.seed <= INT64_MAX:
        return Problem("seed", f"seed must fit in a signed 64-bit integer, got {p.seed}")
    if vocab_size is not None and p.stop_token_ids:
        bad = _outside(p.stop_token_ids, vocab_size)
        if bad is not None:
            return Problem("stop_token_ids", f"stop_token_ids contains {bad}, outside the vocabulary [0, {vocab_size})")
    return None


def check_prompt_token_ids(ids: list[int], vocab_size: int) -> Problem | None:
    """An empty prompt or a token id outside ``[0, vocab_size)``, else None."""
    if not ids:
        return Problem("prompt", "the prompt is empty: at least one prompt token id is required")
    bad = _outside(ids, vocab_size)
    if bad is not None:
        return Problem("prompt", f"prompt token id {bad} at position {ids.index(bad)} is outside the vocabulary "
                                 f"[0, {vocab_size})")
    return None


def check_context_length(prompt_len: int, max_tokens: int | None, max_model_len: int) -> Problem | None:
    """Whether the prompt plus ``max_tokens`` fits the context (vLLM's wording).

    ``max_tokens=None`` (the caller fills in the room left) needs room for at least one token.
    """
    if max_tokens is None:
        if prompt_len >= max_model_len:
            return Problem("prompt", f"This model's maximum context length is {max_model_len} tokens (max_model_len), "
                                     f"but the prompt has {prompt_len} tokens, which leaves no room for a completion.")
        return None
    if prompt_len + max_tokens > max_model_len:
        return Problem("max_tokens", f"This model's maximum context length is {max_model_len} tokens "
                                     f"(max_model_len). However, you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                                     f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.")
    return None


def check_add_request(req: AddRequest, vocab_size: int, max_model_len: int) -> Problem | None:
    """Every rule above for one wire ``AddRequest``, plus its id and arrival time."""
    if not req.request_id:
        return Problem("request_id", "request_id must be a non-empty string")
    if not 0.0 <= req.arrival_time < math.inf:  # NaN would corrupt the priority order
        return Problem("arrival_time", f"arrival_time must be a finite unix time >= 0 (0 = now), got {req.arrival_time}")
    return (check_prompt_token_ids(req.prompt_token_ids, vocab_size)
            or check_sampling_params(req.sampling_params, vocab_size)
            or check_context_length(len(req.prompt_token_ids), req.sampling_params.max_tokens, max_model_len))


def _outside(ids: list[int], vocab_size: int) -> int | None:
    """The first-found id outside ``[0, vocab_size)``; min/max run in C, so valid lists cost no Python loop."""
    lo, hi = min(ids), max(ids)
    if lo < 0:
        return lo
    if hi >= vocab_size:
        return hi
    return None
