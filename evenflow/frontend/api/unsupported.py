"""OpenAI and vLLM request fields evenflow does not implement: a 400 naming the field whenever a
request sets one to anything but its no-op value, so that no field is accepted and then ignored
(that would change results silently). Every such field is declared on the request Structs
(``openai.RefusedFields``) precisely so that its value reaches this check; fields that no API
evenflow follows declares are ignored, as OpenAI and vLLM ignore extras.
"""

from __future__ import annotations

from typing import Any, Callable

from evenflow.frontend.api.errors import bad_request


def _falsy(value: Any) -> bool:
    return not value


def _is_none(value: Any) -> bool:
    return value is None


def _none_or(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in allowed


# field -> whether its value is a no-op. Absent fields take their declared default, a no-op.
NO_OP: dict[str, Callable[[Any], bool]] = {
    # OpenAI
    "logit_bias": _falsy,
    "tools": _falsy,
    "tool_choice": _none_or("none"),
    "functions": _falsy,
    "function_call": _none_or("none"),
    "suffix": _falsy,
    "audio": _is_none,
    "prediction": _is_none,
    "reasoning_effort": _is_none,
    "web_search_options": _is_none,
    "modalities": lambda value: value is None or list(value) == ["text"],
    "store": _falsy,
    # vLLM's extensions
    "use_beam_search": _falsy,
    "length_penalty": _none_or(1.0),
    "allowed_token_ids": _is_none,
    "bad_words": _falsy,
    "spaces_between_special_tokens": _none_or(True),
    "logits_processors": _falsy,
    "guided_whitespace_pattern": _is_none,
    "guided_decoding_backend": _none_or("auto", "guidance", "llguidance"),
    "documents": _falsy,
    "chat_template": _is_none,
    "mm_processor_kwargs": _falsy,
    "cache_salt": _is_none,
    "kv_transfer_params": _is_none,
    "vllm_xargs": _falsy,
    "prompt_embeds": _is_none,
}


def check_unsupported(req: Any) -> None:
    """A 400 naming the first field ``req`` sets to something evenflow would otherwise ignore."""
    for field, no_op in NO_OP.items():
        if not no_op(getattr(req, field, None)):
            raise bad_request(f"{field} is not supported by evenflow", field)
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of > getattr(req, "n", 1):
        raise bad_request("best_of is not supported by evenflow", "best_of")
    logprobs = getattr(req, "logprobs", None)  # completions: a count (0 too); chat: a bool
    if getattr(req, "echo", False) and logprobs is not None and logprobs is not False:
        raise bad_request("echo with logprobs is not supported by evenflow (prompt_logprobs gives the prompt's)", "echo")
    options = getattr(req, "stream_options", None)
    if options is not None and options.continuous_usage_stats:
        raise bad_request("stream_options.continuous_usage_stats is not supported by evenflow",
                          "stream_options.continuous_usage_stats")
