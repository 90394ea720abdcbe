"""POST /v1/chat/completions: chat template -> prompt, streaming and not, ``n`` choices, logprobs."""

from __future__ import annotations

import time
from typing import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive

from evenflow.frontend.logprobs import chat_logprobs_json
from evenflow.frontend.api.completions import usage_of
from evenflow.frontend.api.context import ServingContext, admit, decode_body, engine_error_to_api, new_id
from evenflow.frontend.api.errors import APIError, bad_request
from evenflow.frontend.generation import Generation
from evenflow.frontend.prompt_logprobs import prompt_logprobs_by_prompt
from evenflow.frontend.api.openai import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    encode_json,
)
from evenflow.frontend.api.structured import structured_outputs_async
from evenflow.frontend.api.prepare import (
    OFF_LOOP_CHARS, chat_logprobs, chat_prompt_async, off_loop_if_large, plan_choices, truncate_prompt,
)
from evenflow.frontend.api.unsupported import check_unsupported
from evenflow.frontend.api.sse import DONE, SSEResponse, run_until_disconnect, sse_event


async def create_chat_completion(ctx: ServingContext, body: bytes, receive: Receive,
                                timeout_s: float = 0.0) -> Response | SSEResponse:
    req: ChatCompletionRequest = await off_loop_if_large(len(body), decode_body, body, ChatCompletionRequest)
    lora = await ctx.resolve_model(req.model)
    if req.echo:
        raise bad_request("echo is not supported by evenflow for chat completions", "echo")
    check_unsupported(req)
    structured = await structured_outputs_async(req)
    prompt_ids = truncate_prompt(await chat_prompt_async(req, ctx.tokenizer, req.messages, req.add_special_tokens),
                                 req.truncate_prompt_tokens, ctx.max_model_len)
    logprobs = chat_logprobs(req)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    request_id = new_id("chatcmpl")

    def prepare() -> Generation:
        plan = plan_choices(req, prompt_ids, ctx.max_model_len, ctx.vocab_size, logprobs, max_tokens=max_tokens,
                            structured_outputs=structured)
        return Generation(ctx.client, ctx.tokenizer, request_id, [plan], ctx.metrics, timeout_s=timeout_s, lora=lora)

    gen = await off_loop_if_large(len(body) + req.n * OFF_LOOP_CHARS // 16, prepare)
    top_n = logprobs or 0
    if req.stream:
        await admit(gen, receive)
        return SSEResponse(_stream(ctx, req, gen, request_id, top_n))
    try:
        await run_until_disconnect(receive, gen.run_to_end())
    except APIError:
        raise
    except Exception as e:
        raise engine_error_to_api(e) from None
    choices = []
    for job in gen.jobs:
        asm = job.assembler
        choice = ChatChoice(
            job.index, ChatMessageOut("assistant", asm.text),
            chat_logprobs_json(asm.logprobs, top_n, req.return_tokens_as_token_ids) if logprobs is not None else None,
            asm.finish_reason, asm.stop_reason,
        )
        if req.return_token_ids:
            choice.token_ids = asm.token_ids
        choices.append(choice)
    resp = ChatCompletionResponse(request_id, int(time.time()), ctx.response_model(gen), choices, usage_of(gen))
    if req.return_token_ids:
        resp.prompt_token_ids = prompt_ids
    if req.prompt_logprobs is not None:
        resp.prompt_logprobs = prompt_logprobs_by_prompt(ctx.tokenizer, gen.jobs).get(0)
    return Response(encode_json(resp), media_type="application/json")


async def _stream(
    ctx: ServingContext, req: ChatCompletionRequest, gen: Generation, request_id: str, top_n: int
) -> AsyncIterator[bytes]:
    created = int(time.time())
    model = ctx.response_model(gen)
    want_logprobs = req.logprobs
    try:
        # Every choice opens with its role, one chunk per choice, as OpenAI and vLLM stream.
        for job in gen.jobs:
            opening = ChatCompletionChunk(request_id, created, model,
                                          [ChatChunkChoice(job.index, ChatDelta(role="assistant", content=""))])
            if req.return_token_ids and job.index == 0:
                opening.prompt_token_ids = job.prompt_token_ids
            yield sse_event(encode_json(opening))
        async for job, delta in gen.stream():
            if delta.is_empty:
                continue
            logprobs = chat_logprobs_json(delta.logprobs, top_n, req.return_tokens_as_token_ids) if want_logprobs and delta.logprobs is not None else None
            content = ChatDelta(content=delta.text) if delta.text or delta.finish_reason is None else ChatDelta()
            choice = ChatChunkChoice(job.index, content, logprobs, delta.finish_reason, delta.stop_reason)
            if req.return_token_ids:
                choice.token_ids = delta.token_ids
            yield sse_event(encode_json(ChatCompletionChunk(request_id, created, model, [choice])))
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse_event(encode_json(ChatCompletionChunk(request_id, created, model, [], usage_of(gen))))
    except Exception as e:
        err = e if isinstance(e, APIError) else engine_error_to_api(e)
        yield sse_event(encode_json(err.body()))
    yield DONE
