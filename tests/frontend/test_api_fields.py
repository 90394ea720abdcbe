"""Every request field the API accepts does what vLLM does with it, or is a 400 naming it: never
accepted and ignored. Against the in-process fake engine (what reaches the engine is recorded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from starlette.testclient import TestClient

from evenflow.frontend.api.server import ServerConfig, build_app, connect_context
from evenflow.frontend.api.unsupported import NO_OP
from evenflow.frontend.api.openai import ChatCompletionRequest, CompletionRequest
from evenflow.frontend.chat_template import render_chat
from evenflow.frontend.tokenizer import Tokenizer

from .fakes import FakeEngineClient

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture()
def fake(demo_model_dir: Path, demo_tokenizer: Tokenizer) -> FakeEngineClient:
    return FakeEngineClient(str(demo_model_dir), demo_tokenizer.encode("¿cómo estás? 🯸", add_special_tokens=False))


@pytest.fixture()
def http(demo_model_dir: Path, fake: FakeEngineClient) -> Iterator[TestClient]:
    config = ServerConfig()
    with TestClient(build_app(config, lambda: connect_context(config, fake))) as c:
        yield c


def _body(path: str, **fields: Any) -> dict:
    body: dict = {"max_tokens": 2, **fields}
    body.setdefault("prompt" if path == COMPLETIONS else "messages",
                    "x" if path == COMPLETIONS else [{"role": "user", "content": "x"}])
    return body


# A value for each refused field that is not its no-op.
REFUSED = {"logit_bias": {"1": 5}, "tools": [{"type": "function"}], "tool_choice": "required",
           "functions": [{"name": "f"}], "function_call": "auto", "suffix": "tail", "audio": {"voice": "x"},
           "prediction": {"type": "content"}, "reasoning_effort": "low", "web_search_options": {},
           "modalities": ["text", "audio"], "store": True, "use_beam_search": True,
           "length_penalty": 0.5, "allowed_token_ids": [1, 2], "bad_words": ["x"],
           "spaces_between_special_tokens": False, "logits_processors": ["f"], "guided_whitespace_pattern": " ",
           "guided_decoding_backend": "xgrammar", "documents": [{"text": "d"}], "chat_template": "{{ x }}",
           "mm_processor_kwargs": {"a": 1}, "cache_salt": "s", "kv_transfer_params": {}, "vllm_xargs": {"a": 1},
           "prompt_embeds": "AAAA"}


def test_every_refused_field_is_declared_and_has_a_refusing_value() -> None:
    assert set(REFUSED) == set(NO_OP)
    for struct in (CompletionRequest, ChatCompletionRequest):
        missing = set(NO_OP) - set(struct.__struct_fields__) - {"suffix", "tools", "tool_choice", "functions",
                                                                  "function_call"}
        assert not missing, f"{struct.__name__} would ignore {missing}"


@pytest.mark.parametrize("field", sorted(REFUSED))
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_refused_field_is_a_400_naming_it(http: TestClient, fake: FakeEngineClient, path: str, field: str) -> None:
    if field not in (CompletionRequest if path == COMPLETIONS else ChatCompletionRequest).__struct_fields__:
        pytest.skip(f"{field} is not a field of {path}")
    r = http.post(path, json=_body(path, **{field: REFUSED[field]}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"] and not fake.submitted


@pytest.mark.parametrize("path,body", [
    (CHAT, {"echo": True}),
    (COMPLETIONS, {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    (COMPLETIONS, {"truncate_prompt_tokens": 0}),
    (CHAT, {"continue_final_message": True}),  # with add_generation_prompt left true
])
def test_other_unsupported_values_are_400(http: TestClient, fake: FakeEngineClient, path: str, body: dict) -> None:
    r = http.post(path, json=_body(path, **body))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] and not fake.submitted


def test_truncate_prompt_tokens_keeps_the_last_tokens(http: TestClient, fake: FakeEngineClient,
                                                     demo_tokenizer: Tokenizer) -> None:
    prompt = "one two three four five six seven"
    ids = demo_tokenizer.encode(prompt)
    assert http.post(COMPLETIONS, json=_body(COMPLETIONS, prompt=prompt, truncate_prompt_tokens=3)).status_code == 200
    assert http.post(COMPLETIONS, json=_body(COMPLETIONS, prompt=ids, truncate_prompt_tokens=-1)).status_code == 200
    messages = [{"role": "user", "content": prompt}]
    assert http.post(CHAT, json=_body(CHAT, messages=messages, truncate_prompt_tokens=4)).status_code == 200
    chat_ids = demo_tokenizer.encode(render_chat(demo_tokenizer.chat_template, messages, True, demo_tokenizer.bos_token,
                                                 demo_tokenizer.eos_token), add_special_tokens=False)
    assert [s[1] for s in fake.submitted] == [ids[-3:], ids, chat_ids[-4:]]


def test_add_special_tokens(http: TestClient, fake: FakeEngineClient, demo_tokenizer: Tokenizer) -> None:
    http.post(COMPLETIONS, json=_body(COMPLETIONS, prompt="hi there", add_special_tokens=False))
    http.post(COMPLETIONS, json=_body(COMPLETIONS, prompt="hi there"))
    assert [s[1] for s in fake.submitted] == [demo_tokenizer.encode("hi there", add_special_tokens=False),
                                             demo_tokenizer.encode("hi there")]


def test_continue_final_message_leaves_the_last_message_open(http: TestClient, fake: FakeEngineClient,
                                                            demo_tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One, two,"}]
    r = http.post(CHAT, json=_body(CHAT, messages=messages, continue_final_message=True, add_generation_prompt=False))
    assert r.status_code == 200, r.text
    prompt = demo_tokenizer.decode(fake.submitted[0][1], skip_special_tokens=False)
    assert prompt.endswith("One, two,")
    closed = render_chat(demo_tokenizer.chat_template, messages, False, demo_tokenizer.bos_token, demo_tokenizer.eos_token)
    assert closed.startswith(prompt) and len(closed) > len(prompt)


def test_return_tokens_as_token_ids(http: TestClient, fake: FakeEngineClient) -> None:
    r = http.post(COMPLETIONS, json=_body(COMPLETIONS, logprobs=2, return_tokens_as_token_ids=True)).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in fake.script[:2]]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    r = http.post(CHAT, json=_body(CHAT, logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in fake.script[:2]]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_prompt_logprobs_reach_the_first_choice_only(http: TestClient, fake: FakeEngineClient, path: str) -> None:
    r = http.post(path, json=_body(path, prompt_logprobs=3, n=2))
    assert r.status_code == 200, r.text
    assert [s[2].prompt_logprobs for s in fake.submitted] == [3, None]  # the second choice may read the cache


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("extra", [{"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": 1, "stream": True}])
def test_prompt_logprobs_out_of_range_or_streamed_is_a_400(http: TestClient, fake: FakeEngineClient, path: str,
                                                           extra: dict) -> None:
    r = http.post(path, json=_body(path, **extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_logprobs" and not fake.submitted


def test_a_one_token_prompt_has_one_null_prompt_logprob(http: TestClient, fake: FakeEngineClient) -> None:
    r = http.post(COMPLETIONS, json=_body(COMPLETIONS, prompt=[5], prompt_logprobs=1))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["prompt_logprobs"] == [None]  # the engine sends no rows for it
