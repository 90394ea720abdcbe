"""OpenAI-compatible request and response bodies as msgspec Structs.

Requests are decoded strictly by type (a wrong type is a 400 that names the field, from msgspec's
``at `$.field``` path); unknown fields are ignored, as OpenAI clients send extras. Responses are
encoded straight from these Structs. ``UNSET`` fields are left out of the JSON: they appear only
when asked for (``return_token_ids``).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, Struct, UnsetType


class StreamOptions(Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # refused when true (api/unsupported.py)


class RefusedFields(Struct, kw_only=True):
    """OpenAI and vLLM fields evenflow does not implement, declared so that a request setting one
    gets a 400 naming it (``api/unsupported.py`` holds each one's no-op value)."""

    logit_bias: dict[str, Any] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    modalities: list[str] | None = None
    store: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    spaces_between_special_tokens: Any = None
    logits_processors: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None
    documents: Any = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    prompt_embeds: Any = None


class _SamplingFields(RefusedFields, kw_only=True):
    """Sampling fields shared by /v1/completions and /v1/chat/completions (vLLM's extensions too)."""

    model: str | None = None
    prompt_logprobs: int | None = None  # per prompt token: its logprob and the top-k (vLLM's)
    # None: the endpoint's default, as OpenAI and vLLM: 16 for /v1/completions, the rest of the
    # context for /v1/chat/completions.
    max_tokens: int | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    return_token_ids: bool = False
    # Logprobs keyed "token_id:N" instead of the token's text (vLLM's extension).
    return_tokens_as_token_ids: bool = False
    # Keep only the prompt's last N tokens (-1: the last max_model_len), as vLLM.
    truncate_prompt_tokens: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    # Structured output (api/structured.py): OpenAI's response_format, vLLM's extensions.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # A string, a list of strings, a list of token ids, or a list of token-id lists; checked after
    # decoding (msgspec unions may hold only one array type).
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM: the tokenizer's BOS leads a text prompt
    suffix: str | None = None  # unsupported (400 when non-empty)
    best_of: int | None = None  # unsupported (400 when > n)


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    # Render the last message open, for the model to go on with it (needs add_generation_prompt: false).
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM: the chat template places BOS itself
    echo: bool = False  # vLLM's chat echo: unsupported (400 when true)
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool and function calling are unsupported (400 unless absent, empty or "none").
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # a no-op without tools


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class LoadLoRAAdapterRequest(Struct, kw_only=True):
    """vLLM's /v1/load_lora_adapter body (``lora_path`` unused by /v1/unload_lora_adapter)."""

    lora_name: str
    lora_path: str = ""
    load_inplace: bool = False


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: list[dict[str, Any] | None] | UnsetType = UNSET


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class ChatMessageOut(Struct):
    role: str = "assistant"
    content: str = ""


class ChatChoice(Struct):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: list[dict[str, Any] | None] | UnsetType = UNSET
    object: str = "chat.completion"


class ChatDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | UnsetType = UNSET
    object: str = "chat.completion.chunk"


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "evenflow"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(Struct):
    prompt: str


_encoder = msgspec.json.Encoder()


def encode_json(obj: Any) -> bytes:
    """JSON bytes of a response Struct (or plain data)."""
    return _encoder.encode(obj)
