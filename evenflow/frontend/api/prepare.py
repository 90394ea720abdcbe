"""From a decoded OpenAI request to what the engine needs: prompt token ids and SamplingParams.

Pure functions (no sockets, no event loop) so every validation rule is unit-tested directly.
Each rule that rejects a request raises ``APIError(400)`` naming the field and the numbers.
The ``*_async`` variants run tokenization and template rendering of a large input in a worker
thread: the event loop also keeps the engine link alive (heartbeats), so it must not stall.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, TypeVar


from evenflow.protocol import SamplingParams, StructuredOutputsParams
from evenflow.protocol.validation import Problem, check_context_length, check_prompt_token_ids, check_sampling_params

from evenflow.frontend.chat_template import ChatTemplateError, content_text, render_chat
from evenflow.frontend.choices import ChoicePlan, fan_out, stop_strings
from evenflow.frontend.tokenizer import Tokenizer
from evenflow.frontend.api.errors import APIError, bad_request
from evenflow.frontend.api.limits import check_num_messages, check_num_prompts
from evenflow.frontend.api.openai import ChatCompletionRequest, ChatMessage, _SamplingFields

MAX_N = 128
PROMPT_FORMS = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
# Inputs above this many characters are tokenized/rendered off the event loop (a thread hop costs
# ~50 us, tokenizing 2000 characters about as much; a 1 MB prompt would stall the loop for ~0.1 s).
OFF_LOOP_CHARS = 2000
CHARS_PER_TOKEN = 4  # for sizing token-id inputs against OFF_LOOP_CHARS
OFF_LOOP_MESSAGES = 32  # more chat messages than this are rendered off the loop whatever their size
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions

T = TypeVar("T")


async def off_loop_if_large(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a worker thread when ``size`` (characters) exceeds OFF_LOOP_CHARS."""
    if size > OFF_LOOP_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def completion_prompts(prompt: str | list[Any], tokenizer: Tokenizer, add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each prompt: a string, strings, a token-id list, or token-id lists (text gets
    the tokenizer's BOS when ``add_special_tokens``; token ids are taken as they are)."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens=add_special_tokens)]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if not isinstance(prompt[0], int):  # several prompts (a token-id list is one)
        check_num_prompts(len(prompt))
    if all(isinstance(p, str) for p in prompt):
        return tokenizer.encode_batch(list(prompt), add_special_tokens=add_special_tokens)
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [_checked_ids(prompt, tokenizer.vocab_size)]
    if all(isinstance(p, list) for p in prompt):
        if not all(all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
            raise bad_request(PROMPT_FORMS, "prompt")
        return [_checked_ids(p, tokenizer.vocab_size) for p in prompt]
    raise bad_request(PROMPT_FORMS, "prompt")


async def completion_prompts_async(prompt: str | list[Any], tokenizer: Tokenizer,
                                   add_special_tokens: bool = True) -> list[list[int]]:
    """``completion_prompts``, off the event loop for a large prompt."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        check_num_prompts(len(prompt))  # before sizing them, on the loop
    return await off_loop_if_large(_prompt_size(prompt), completion_prompts, prompt, tokenizer, add_special_tokens)


def _prompt_size(prompt: str | list[Any]) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    size = 0
    for p in prompt:
        if isinstance(p, str):
            size += len(p)
        elif isinstance(p, list):
            size += len(p) * CHARS_PER_TOKEN
        else:
            size += CHARS_PER_TOKEN
    return size


def _checked_ids(ids: list[int], vocab_size: int) -> list[int]:
    _raise_if(check_prompt_token_ids(ids, vocab_size))
    return list(ids)


def _raise_if(problem: Problem | None) -> None:
    """A protocol validation Problem as OpenAI's 400, its field as ``param``."""
    if problem is not None:
        raise bad_request(problem.message, problem.field)


def chat_prompt(req: ChatCompletionRequest | Any, tokenizer: Tokenizer, messages: list[ChatMessage],
                add_special_tokens: bool = False) -> list[int]:
    """Render ``messages`` with the chat template and tokenize (the template places BOS itself,
    unless ``add_special_tokens`` asks the tokenizer for it too, as vLLM's field does)."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    try:
        dicts = [{"role": m.role, "content": content_text(m.content), **({"name": m.name} if m.name else {})} for m in messages]
        text = render_chat(
            tokenizer.chat_template,
            dicts,
            add_generation_prompt=getattr(req, "add_generation_prompt", True),
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
            extra_context=getattr(req, "chat_template_kwargs", None),
            continue_final_message=getattr(req, "continue_final_message", False),
        )
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


async def chat_prompt_async(req: ChatCompletionRequest | Any, tokenizer: Tokenizer,
                            messages: list[ChatMessage], add_special_tokens: bool = False) -> list[int]:
    """``chat_prompt``, off the event loop when the messages are large or many (the template's cost
    grows with the count of messages, even empty ones)."""
    check_num_messages(len(messages))
    if len(messages) > OFF_LOOP_MESSAGES:
        return await asyncio.to_thread(chat_prompt, req, tokenizer, messages, add_special_tokens)
    size = sum(_content_size(m.content) for m in messages)
    return await off_loop_if_large(size, chat_prompt, req, tokenizer, messages, add_special_tokens)


def _content_size(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(str(part.get("text", ""))) if isinstance(part, dict) else 0 for part in content)
    return 0


def truncate_prompt(prompt_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """The prompt's last ``truncate_prompt_tokens`` tokens (-1: the last ``max_model_len``), as vLLM
    truncates on the left; None keeps it whole."""
    keep = truncate_prompt_tokens
    if keep is None:
        return prompt_ids
    if keep == -1:
        keep = max_model_len
    if not 1 <= keep <= max_model_len:
        raise bad_request(f"truncate_prompt_tokens must be -1 or in [1, max_model_len={max_model_len}], "
                          f"got {truncate_prompt_tokens}", "truncate_prompt_tokens")
    return prompt_ids[-keep:]


def plan_choices(
    req: _SamplingFields,
    prompt_ids: list[int],
    max_model_len: int,
    vocab_size: int,
    logprobs: int | None,
    max_tokens: int | None = None,
    default_max_tokens: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> ChoicePlan:
    """SamplingParams for each of ``req.n`` choices, after every length and range check.

    Without ``max_tokens`` (or ``req.max_tokens``), a choice gets ``default_max_tokens`` capped to
    the room left in the context, or all that room when ``default_max_tokens`` is None.
    """
    _raise_if(check_prompt_token_ids(prompt_ids, vocab_size))
    if req.prompt_logprobs is not None and req.stream:  # vLLM's rule: they come whole, at the end
        raise bad_request("prompt_logprobs is not available when stream is true", "prompt_logprobs")
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    prompt_len = len(prompt_ids)
    if max_tokens is None:
        max_tokens = req.max_tokens
    _raise_if(check_context_length(prompt_len, None, max_model_len))
    if max_tokens is None:
        room = max_model_len - prompt_len  # vLLM's chat default: whatever room is left
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    else:
        _raise_if(check_context_length(prompt_len, max_tokens, max_model_len))
    base = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        structured_outputs=structured_outputs,
        prompt_logprobs=req.prompt_logprobs,
    )
    _raise_if(check_sampling_params(base, vocab_size))
    params = fan_out(base, req.n)
    _raise_if(check_sampling_params(params[-1]))  # the last choice's seed + n - 1 must still fit
    return ChoicePlan(
        prompt_token_ids=prompt_ids,
        params=params,
        stop=stop_strings(req.stop),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        priority=req.priority,
    )


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def check_model(requested: str | None, served: list[str] | set[str]) -> None:
    # No model, or "", means the served one, as in vLLM (_is_model_supported).
    if requested and requested not in served:
        raise APIError(404, f"The model `{requested}` does not exist. Served: {', '.join(served)}.", "model")
