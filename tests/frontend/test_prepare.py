"""Request parsing and validation: every rejection is a 400 that names the field and the numbers."""

from __future__ import annotations

import asyncio
import threading

import msgspec
import pytest

from evenflow.frontend.api.context import decode_body
from evenflow.frontend.api.errors import APIError
from evenflow.frontend.api.openai import ChatCompletionRequest, CompletionRequest
from evenflow.frontend.api.prepare import (
    COMPLETIONS_DEFAULT_MAX_TOKENS, OFF_LOOP_CHARS, chat_logprobs, chat_prompt, chat_prompt_async, check_model,
    completion_prompts, completion_prompts_async, plan_choices,
)
from evenflow.frontend.tokenizer import Tokenizer


def _req(**kw: object) -> CompletionRequest:
    return msgspec.convert({"prompt": "x", **kw}, CompletionRequest)


def _raises(status: int, *needles: str):  # noqa: ANN202 (a tiny context manager)
    class _Check:
        def __enter__(self) -> None:
            return None

        def __exit__(self, typ, exc, tb) -> bool:
            assert isinstance(exc, APIError), f"expected APIError, got {exc!r}"
            assert exc.status == status, exc.message
            for n in needles:
                assert n in exc.message or n == exc.param, (n, exc.message, exc.param)
            return True

    return _Check()  # type: ignore[return-value]


def test_prompt_forms(demo_tokenizer: Tokenizer) -> None:
    bos = demo_tokenizer.bos_token_id
    [one] = completion_prompts("def f():", demo_tokenizer)
    assert one[0] == bos and demo_tokenizer.decode(one) == "def f():"
    assert completion_prompts(["a", "b"], demo_tokenizer) == [demo_tokenizer.encode("a"), demo_tokenizer.encode("b")]
    assert completion_prompts([5, 6, 7], demo_tokenizer) == [[5, 6, 7]]
    assert completion_prompts([[5], [6, 7]], demo_tokenizer) == [[5], [6, 7]]


@pytest.mark.parametrize("prompt", [[], [1, "a"], [[1], "a"], [[1, 2.5]], [99999]])
def test_bad_prompts(demo_tokenizer: Tokenizer, prompt: list) -> None:
    with _raises(400, "prompt"):
        completion_prompts(prompt, demo_tokenizer)


def test_wrong_type_names_the_field() -> None:
    with _raises(400, "max_tokens", "Expected `int | null`, got `str`"):
        decode_body(b'{"prompt": "x", "max_tokens": "ten"}', CompletionRequest)
    with _raises(400, "temperature"):
        decode_body(b'{"prompt": "x", "temperature": [1]}', CompletionRequest)
    with _raises(400, "malformed JSON"):
        decode_body(b'{"prompt": ', CompletionRequest)
    with _raises(400, "prompt"):
        decode_body(b'{"max_tokens": 3}', CompletionRequest)
    with _raises(400, "messages"):
        decode_body(b'{"messages": [{"content": "no role"}]}', ChatCompletionRequest)


def test_max_tokens_default_and_limit() -> None:
    plan = plan_choices(_req(), list(range(10)), max_model_len=100, vocab_size=256, logprobs=None)
    assert plan.params[0].max_tokens == 90  # chat, as vLLM: the room left
    plan = plan_choices(_req(), list(range(10)), 100, 256, None, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)
    assert plan.params[0].max_tokens == 16  # completions, as OpenAI and vLLM
    plan = plan_choices(_req(), list(range(90)), 100, 256, None, default_max_tokens=16)
    assert plan.params[0].max_tokens == 10  # the default never overflows the context
    plan = plan_choices(_req(max_tokens=40), list(range(10)), 100, 256, None, default_max_tokens=16)
    assert plan.params[0].max_tokens == 40
    with _raises(400, "maximum context length is 100", "requested 101 tokens", "91 for the completion", "max_tokens"):
        plan_choices(_req(max_tokens=91), list(range(10)), max_model_len=100, vocab_size=256, logprobs=None)
    with _raises(400, "100 tokens", "100 tokens"):
        plan_choices(_req(), list(range(100)), max_model_len=100, vocab_size=256, logprobs=None)


def test_sampling_ranges_and_fan_out() -> None:
    with _raises(400, "top_p"):
        plan_choices(_req(top_p=0.0), [1], 100, 256, None)
    with _raises(400, "n"):
        plan_choices(_req(n=0), [1], 100, 256, None)
    with _raises(400, "stop_token_ids", "999"):
        plan_choices(_req(stop_token_ids=[999]), [1], 100, 256, None)
    with _raises(400, "logprobs"):
        plan_choices(_req(), [1], 100, 256, 21)
    plan = plan_choices(_req(n=3, seed=7, stop="END", max_tokens=4), [1, 2], 100, 256, 2)
    assert [p.seed for p in plan.params] == [7, 8, 9]
    assert plan.stop == ["END"] and all(p.logprobs == 2 and p.max_tokens == 4 for p in plan.params)


def test_chat_prompt_and_logprobs(demo_tokenizer: Tokenizer) -> None:
    req = msgspec.convert({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3},
                          ChatCompletionRequest)
    ids = chat_prompt(req, demo_tokenizer, req.messages)
    assert demo_tokenizer.decode(ids, skip_special_tokens=False) == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ids.count(demo_tokenizer.bos_token_id) == 1
    assert chat_logprobs(req) == 3
    with _raises(400, "top_logprobs"):
        chat_logprobs(msgspec.convert({"messages": [], "top_logprobs": 2}, ChatCompletionRequest))


def test_chat_without_template_is_a_clear_400(demo_tokenizer: Tokenizer) -> None:
    bare = Tokenizer(demo_tokenizer.hf, "<s>", "</s>", True, chat_template=None)
    req = msgspec.convert({"messages": [{"role": "user", "content": "hi"}]}, ChatCompletionRequest)
    with _raises(400, "no chat template", "--chat-template"):
        chat_prompt(req, bare, req.messages)


def test_unknown_model_is_404() -> None:
    check_model(None, {"demo"})
    check_model("", {"demo"})  # empty means the served model, as in vLLM
    check_model("demo", {"demo"})
    with _raises(404, "nope"):
        check_model("nope", {"demo"})


def test_chat_template_kwargs_collisions_and_template_errors_are_400(demo_tokenizer: Tokenizer) -> None:
    def req(kwargs: dict) -> ChatCompletionRequest:
        return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs},
                               ChatCompletionRequest)

    plain = chat_prompt(req({}), demo_tokenizer, req({}).messages)
    for kwargs in ({"messages": 5}, {"add_generation_prompt": False}, {"bos_token": "X"}, {"eos_token": None},
                   {"template": "x", "extra_context": 1}):
        r = req(kwargs)
        assert chat_prompt(r, demo_tokenizer, r.messages) == plain  # fixed variables win, no TypeError
    broken = Tokenizer(demo_tokenizer.hf, "<s>", "</s>", True, chat_template="{{ messages[0].content + 1 }}")
    with _raises(400, "messages", "the chat template failed", "TypeError"):
        chat_prompt(req({}), broken, req({}).messages)


class _ThreadRecordingTokenizer(Tokenizer):
    """Records the thread each encode runs on."""

    def __init__(self, base: Tokenizer) -> None:
        super().__init__(base.hf, base.bos_token, base.eos_token, base.add_bos_token, base.chat_template)
        self.threads: list[threading.Thread] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread())
        return super().encode(text, add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        self.threads.append(threading.current_thread())
        return super().encode_batch(texts, add_special_tokens)


def test_large_inputs_are_tokenized_off_the_event_loop(demo_tokenizer: Tokenizer) -> None:
    tok = _ThreadRecordingTokenizer(demo_tokenizer)
    big = "word " * (OFF_LOOP_CHARS // 5 + 10)

    def chat(content: str) -> ChatCompletionRequest:
        return msgspec.convert({"messages": [{"role": "user", "content": content}]}, ChatCompletionRequest)

    async def main() -> list[bool]:
        loop_thread = threading.current_thread()
        small_req, big_req = chat("hi"), chat(big)
        assert await completion_prompts_async("hi", tok) == completion_prompts("hi", tok)
        assert await completion_prompts_async(big, tok) == completion_prompts(big, tok)
        assert await completion_prompts_async(["a", big], tok) == completion_prompts(["a", big], tok)
        assert await chat_prompt_async(small_req, tok, small_req.messages) == chat_prompt(small_req, tok, small_req.messages)
        assert await chat_prompt_async(big_req, tok, big_req.messages) == chat_prompt(big_req, tok, big_req.messages)
        # Each call was followed by its synchronous reference (on the loop's thread).
        return [t is loop_thread for t in tok.threads[0::2]]

    assert asyncio.run(main()) == [True, False, False, True, False]


def test_seed_of_every_choice_must_fit_int64() -> None:
    from evenflow.protocol.validation import INT64_MAX
    plan_choices(_req(n=1, seed=INT64_MAX), [1], 100, 256, None)
    with _raises(400, "seed"):
        plan_choices(_req(n=2, seed=INT64_MAX), [1], 100, 256, None)  # choice 1 would get INT64_MAX + 1
    with _raises(400, "position 1", "prompt"):
        plan_choices(_req(), [1, 256], 100, 256, None)
