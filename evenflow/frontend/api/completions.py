"""POST /v1/completions: streaming and not, several prompts, ``n`` choices, echo, logprobs."""

from __future__ import annotations

import time
from typing import AsyncIterator

from starlette.responses import Response
from starlette.types import Receive

from evenflow.frontend.logprobs import completion_logprobs_json
from evenflow.frontend.api.context import ServingContext, admit, decode_body, engine_error_to_api, new_id
from evenflow.frontend.api.errors import APIError
from evenflow.frontend.generation import Generation
from evenflow.frontend.prompt_logprobs import prompt_logprobs_by_prompt
from evenflow.frontend.api.openai import CompletionChoice, CompletionRequest, CompletionResponse, PromptTokensDetails, Usage, encode_json
from evenflow.frontend.api.structured import structured_outputs_async
from evenflow.frontend.api.limits import check_num_choices
from evenflow.frontend.api.prepare import (
    COMPLETIONS_DEFAULT_MAX_TOKENS, OFF_LOOP_CHARS, completion_prompts_async, off_loop_if_large, plan_choices,
    truncate_prompt,
)
from evenflow.frontend.api.unsupported import check_unsupported
from evenflow.frontend.api.sse import DONE, SSEResponse, run_until_disconnect, sse_event


def usage_of(gen: Generation) -> Usage:
    prompt, completion = gen.num_prompt_tokens, gen.num_completion_tokens
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(gen.num_cached_tokens))


async def create_completion(ctx: ServingContext, body: bytes, receive: Receive,
                           timeout_s: float = 0.0) -> Response | SSEResponse:
    # Every step of preparation runs off the event loop when the body is large (limits.py bounds it).
    req: CompletionRequest = await off_loop_if_large(len(body), decode_body, body, CompletionRequest)
    lora = await ctx.resolve_model(req.model)
    check_unsupported(req)
    structured = await structured_outputs_async(req)
    prompts = [truncate_prompt(ids, req.truncate_prompt_tokens, ctx.max_model_len)
               for ids in await completion_prompts_async(req.prompt, ctx.tokenizer, req.add_special_tokens)]
    check_num_choices(len(prompts), req.n)
    request_id = new_id("cmpl")

    def prepare() -> Generation:
        plans = [plan_choices(req, ids, ctx.max_model_len, ctx.vocab_size, req.logprobs,
                              default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS, structured_outputs=structured)
                 for ids in prompts]
        return Generation(ctx.client, ctx.tokenizer, request_id, plans, ctx.metrics, timeout_s=timeout_s, lora=lora)

    gen = await off_loop_if_large(len(body) + len(prompts) * req.n * OFF_LOOP_CHARS // 16, prepare)
    echo = [_prompt_text(ctx, req, i, ids) for i, ids in enumerate(prompts)] if req.echo else None
    if req.stream:
        await admit(gen, receive)
        return SSEResponse(_stream(ctx, req, gen, request_id, echo))
    try:
        await run_until_disconnect(receive, gen.run_to_end())
    except APIError:
        raise
    except Exception as e:  # EngineError, lost connection: not the client's fault unless it says so
        raise engine_error_to_api(e) from None
    choices = []
    prompt_logprobs = prompt_logprobs_by_prompt(ctx.tokenizer, gen.jobs) if req.prompt_logprobs is not None else {}
    for job in gen.jobs:
        asm = job.assembler
        prefix = echo[job.prompt_index] if echo else ""
        choice = CompletionChoice(
            job.index, prefix + asm.text,
            completion_logprobs_json(asm.logprobs, len(prefix), req.return_tokens_as_token_ids) if job.params.logprobs is not None else None,
            asm.finish_reason, asm.stop_reason,
        )
        if req.return_token_ids:
            choice.token_ids = asm.token_ids
            choice.prompt_token_ids = job.prompt_token_ids
        if job.prompt_index in prompt_logprobs:  # every choice of a prompt shows them, as in vLLM
            choice.prompt_logprobs = prompt_logprobs[job.prompt_index]
        choices.append(choice)
    resp = CompletionResponse(request_id, int(time.time()), ctx.response_model(gen), choices, usage_of(gen))
    return Response(encode_json(resp), media_type="application/json")


def _prompt_text(ctx: ServingContext, req: CompletionRequest, index: int, ids: list[int]) -> str:
    if req.truncate_prompt_tokens is not None:  # the echo is the prompt the model saw
        return ctx.tokenizer.decode(ids)
    if isinstance(req.prompt, str):
        return req.prompt
    if req.prompt and isinstance(req.prompt[0], str):
        return req.prompt[index]
    return ctx.tokenizer.decode(ids)


async def _stream(
    ctx: ServingContext, req: CompletionRequest, gen: Generation, request_id: str, echo: list[str] | None
) -> AsyncIterator[bytes]:
    created = int(time.time())
    model = ctx.response_model(gen)
    first = [True] * len(gen.jobs)
    try:
        async for job, delta in gen.stream():
            text = delta.text
            prefix_len = len(echo[job.prompt_index]) if echo else 0
            is_first = first[job.index]
            first[job.index] = False
            if is_first and echo:
                text = echo[job.prompt_index] + text
            elif delta.is_empty:
                continue
            logprobs = None
            if job.params.logprobs is not None and delta.logprobs is not None:
                logprobs = completion_logprobs_json(delta.logprobs, prefix_len, req.return_tokens_as_token_ids)
            choice = CompletionChoice(job.index, text, logprobs, delta.finish_reason, delta.stop_reason)
            if req.return_token_ids:
                choice.token_ids = delta.token_ids
                if is_first:
                    choice.prompt_token_ids = job.prompt_token_ids
            yield sse_event(encode_json(CompletionResponse(request_id, created, model, [choice])))
        if req.stream_options is not None and req.stream_options.include_usage:
            yield sse_event(encode_json(CompletionResponse(request_id, created, model, [], usage_of(gen))))
    except Exception as e:
        err = e if isinstance(e, APIError) else engine_error_to_api(e)
        yield sse_event(encode_json(err.body()))
    yield DONE
