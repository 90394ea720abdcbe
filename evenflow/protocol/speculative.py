"""Speculative decoding settings, shared by the engine-core (draft slots) and the workers (proposer).

The JSON shape and the validation follow vLLM's ``--speculative-config``; ``ngram`` (prompt lookup)
is the one method. Validation lives here, once: the engine-core's command line and the worker both
call ``parse_speculative_config``.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct

SPECULATIVE_METHODS = ("ngram",)
DEFAULT_DISABLE_BY_BATCH_SIZE = 16  # see SpeculativeConfig


class SpeculativeConfig(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": A, "prompt_lookup_max": B}``.

    ``disable_by_batch_size``: no drafts in a step once this many requests are running (vLLM's
    name). Unlike vLLM, unset means 16, not never: drafting pays while the forward is memory-bound,
    but on a CPU a large batch is compute-bound already and drafting regardless measured 0.45x the
    output tok/s at saturation (docs/speculative_decoding.md). An explicit null means never.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    @property
    def ngram_min(self) -> int:
        """vLLM's defaults: both unset -> 5; one unset -> the other."""
        return self.prompt_lookup_min or self.prompt_lookup_max or 5

    @property
    def ngram_max(self) -> int:
        return self.prompt_lookup_max or self.prompt_lookup_min or 5

    def validate(self) -> str | None:
        """A message naming the first bad value, or None."""
        if self.method == "[ngram]":  # vLLM accepts this spelling too
            self.method = "ngram"
        if self.method not in SPECULATIVE_METHODS:
            return f"speculative method {self.method!r} is not supported (supported: {', '.join(SPECULATIVE_METHODS)})"
        if self.num_speculative_tokens < 1:
            return f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if value is not None and value < 1:
                return f"{name} must be >= 1, got {value}"
        if self.ngram_min > self.ngram_max:
            return f"prompt_lookup_min ({self.ngram_min}) must be <= prompt_lookup_max ({self.ngram_max})"
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            return f"disable_by_batch_size must be >= 2, got {self.disable_by_batch_size}"
        return None


def parse_speculative_config(text: str | bytes) -> SpeculativeConfig:
    """Parse and validate the JSON of ``--speculative-config``; ValueError says what is wrong."""
    try:
        config = msgspec.json.decode(text, type=SpeculativeConfig)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"--speculative-config: {e}") from None
    problem = config.validate()
    if problem is not None:
        raise ValueError(f"--speculative-config: {problem}")
    return config
