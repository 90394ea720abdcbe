"""The HTTP API against an in-process fake engine client (no processes, fast)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Iterator

import pytest
from starlette.testclient import TestClient

from evenflow.frontend.generation import Generation
from evenflow.frontend.api.prepare import ChoicePlan
from evenflow.frontend.api.server import ServerConfig, build_app, connect_context
from evenflow.frontend.api.sse import SSEResponse
from evenflow.frontend.clients.engine_client import EngineError
from evenflow.frontend.tokenizer import Tokenizer
from evenflow.protocol import SamplingParams

from .fakes import FakeEngineClient

TEXT = "Hello wörld € and more text here. STOP now and then some more words"


def _client(model_dir: Path, fake: FakeEngineClient, **cfg: object) -> TestClient:
    config = ServerConfig(**cfg)  # type: ignore[arg-type]
    return TestClient(build_app(config, lambda: connect_context(config, fake)))


@pytest.fixture()
def fake(demo_model_dir: Path, demo_tokenizer: Tokenizer) -> FakeEngineClient:
    return FakeEngineClient(str(demo_model_dir), demo_tokenizer.encode(TEXT, add_special_tokens=False))


@pytest.fixture()
def http(demo_model_dir: Path, fake: FakeEngineClient) -> Iterator[TestClient]:
    with _client(demo_model_dir, fake) as c:
        yield c


def _events(resp) -> list[dict]:  # noqa: ANN001
    lines = [ln[len("data: "):] for ln in resp.text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_completion_non_streaming(http: TestClient, fake: FakeEngineClient, demo_tokenizer: Tokenizer) -> None:
    r = http.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 6, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    [choice] = body["choices"]
    assert choice["text"] == demo_tokenizer.decode(fake.script[:6]) and choice["finish_reason"] == "length"
    assert choice["token_ids"] == fake.script[:6] and choice["prompt_token_ids"] == demo_tokenizer.encode("hi")
    assert body["usage"]["prompt_tokens"] == len(demo_tokenizer.encode("hi")) and body["usage"]["completion_tokens"] == 6


def test_streaming_with_stop_string_and_usage(http: TestClient, fake: FakeEngineClient) -> None:
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 40, "stream": True, "stop": ["STOP"],
                                           "stream_options": {"include_usage": True}})
    events = _events(r)
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == TEXT[:TEXT.index("STOP")]
    finals = [c for e in events for c in e["choices"] if c["finish_reason"]]
    assert finals == [{**finals[0], "finish_reason": "stop", "stop_reason": "STOP"}]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] < 40
    assert fake.aborted == [fake.submitted[0][0]]  # the engine request was aborted at the match
    assert fake.abort_messages == [fake.submitted[0][0]]  # by exactly one Abort (closing its stream)


def test_every_token_gets_a_chunk_even_while_its_text_is_held_back(http: TestClient, fake: FakeEngineClient) -> None:
    # "ö" and "€" span two and three byte-level tokens: their first tokens have no text of their own
    # yet. As vLLM streams, each still gets a chunk (empty text), so clients see every token arrive.
    n = len(fake.script)
    events = _events(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": n, "stream": True}))
    texts = [c["text"] for e in events for c in e["choices"]]
    assert len(texts) == n and "".join(texts) == TEXT and texts.count("") >= 3
    events = _events(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": n, "stream": True}))
    deltas = [c["delta"] for e in events[1:] for c in e["choices"]]
    assert len(deltas) == n and "".join(d["content"] for d in deltas) == TEXT
    assert sum(d["content"] == "" for d in deltas) >= 3


def test_n_choices_echo_and_logprobs(http: TestClient, fake: FakeEngineClient, demo_tokenizer: Tokenizer) -> None:
    r = http.post("/v1/completions", json={"prompt": ["ab", "cd"], "n": 2, "max_tokens": 3, "echo": True, "seed": 5})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    out = demo_tokenizer.decode(fake.script[:3])
    assert body["choices"][0]["text"] == "ab" + out and body["choices"][3]["text"] == "cd" + out
    assert all(c["logprobs"] is None for c in body["choices"])
    assert [s[2].seed for s in fake.submitted] == [5, 6, 5, 6]
    streamed = _events(http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "echo": True, "stream": True}))
    assert "".join(c["text"] for e in streamed for c in e["choices"]) == "ab" + out

    r = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "logprobs": 2})
    [choice] = r.json()["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 3 and len(lp["top_logprobs"][0]) >= 2 and lp["text_offset"][0] == 0
    # Each token's text starts at its offset (the fake's tokens are whole characters here).
    assert [choice["text"][o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])] == lp["tokens"]


def test_echo_with_logprobs_is_refused(http: TestClient) -> None:
    r = http.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "echo": True, "logprobs": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    assert "prompt_logprobs" in r.json()["error"]["message"]  # points at the field that gives them


@pytest.mark.parametrize("path,field,value", [
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/completions", "logit_bias", {"50256": -100}),
    ("/v1/chat/completions", "logit_bias", {"1": 5}),
    ("/v1/completions", "suffix", "tail"),
    ("/v1/completions", "best_of", 3),
])
def test_unsupported_openai_fields_are_400(http: TestClient, fake: FakeEngineClient, path: str, field: str,
                                           value: object) -> None:
    body: dict = {"max_tokens": 2, field: value}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"] == f"{field} is not supported by evenflow"
    assert err["type"] == "BadRequestError" and not fake.submitted


@pytest.mark.parametrize("path,extra", [
    ("/v1/chat/completions", {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
                              "functions": [], "logit_bias": {}}),
    ("/v1/completions", {"suffix": "", "best_of": 1, "logit_bias": {}, "response_format": None}),
])
def test_no_op_values_of_unsupported_fields_are_accepted(http: TestClient, path: str, extra: dict) -> None:
    body: dict = {"max_tokens": 2, **extra}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    assert http.post(path, json=body).status_code == 200


def test_default_max_tokens_is_16_for_completions_and_the_rest_for_chat(http: TestClient,
                                                                        fake: FakeEngineClient) -> None:
    r = http.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    assert fake.submitted[-1][2].max_tokens == 16
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    prompt_len = len(fake.submitted[-1][1])
    assert fake.submitted[-1][2].max_tokens == fake.max_model_len - prompt_len


def test_chat_template_kwargs_cannot_break_the_request(http: TestClient) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    for kwargs in ({"messages": "x"}, {"add_generation_prompt": False}, {"bos_token": "B"}, {"template": 1},
                   {"extra_flag": True}):
        r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "chat_template_kwargs": kwargs,
                                                    "return_token_ids": True})
        assert r.status_code == 200, (kwargs, r.text)
    ref = http.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    r = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "return_token_ids": True,
                                                "chat_template_kwargs": {"messages": [], "bos_token": "B"}})
    assert r.json()["prompt_token_ids"] == ref  # the fixed variables win


def test_chat_streaming_n2(http: TestClient) -> None:
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 5,
                                                "stream": True, "logprobs": True, "top_logprobs": 1})
    events = _events(r)
    # One role chunk per choice, each with a single choice, as OpenAI and vLLM send them.
    assert [e["choices"] for e in events[:2]] == [
        [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
          "stop_reason": None}] for i in (0, 1)]
    assert all(len(e["choices"]) == 1 for e in events)
    for i in (0, 1):
        text = "".join(c["delta"].get("content", "") for e in events[2:] for c in e["choices"] if c["index"] == i)
        assert text == TEXT[:len(text)] and len(text) > 5
        assert sum(len(c["logprobs"]["content"]) for e in events[2:] for c in e["choices"] if c["index"] == i) == 5


def test_errors(http: TestClient) -> None:
    def err(path: str, status: int, **kw: object) -> dict:
        r = http.post(path, **kw)  # type: ignore[arg-type]
        assert r.status_code == status, r.text
        return r.json()["error"]

    assert err("/v1/completions", 400, content=b"{not json")["message"].startswith("malformed JSON")
    assert err("/v1/completions", 400, json={"prompt": "x", "n": "2"})["param"] == "n"
    e = err("/v1/completions", 400, json={"prompt": "x", "max_tokens": 1000})
    assert "256" in e["message"] and "1000" in e["message"]
    assert err("/v1/completions", 404, json={"prompt": "x", "model": "gpt-4"})["type"] == "NotFoundError"
    assert err("/v1/chat/completions", 400, json={"messages": "hi"})["param"] == "messages"
    assert http.get("/v1/models").json()["data"][0]["id"] == "fake-model"


def test_tokenize_detokenize(http: TestClient, demo_tokenizer: Tokenizer) -> None:
    r = http.post("/tokenize", json={"prompt": "def f():"}).json()
    assert r["tokens"] == demo_tokenizer.encode("def f():") and r["count"] == len(r["tokens"])
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "def f():"
    assert http.post("/detokenize", json={"tokens": [10**6]}).status_code == 400
    big = "def f(x):\n    return x * 2  # é€\n" * 200  # large: tokenized and decoded off the event loop
    ids = http.post("/tokenize", json={"prompt": big, "add_special_tokens": False}).json()["tokens"]
    assert ids == demo_tokenizer.encode(big, add_special_tokens=False)
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == big
    assert http.post("/detokenize", json={"tokens": ids + [10**6]}).json()["error"]["param"] == "tokens"


def test_api_key(demo_model_dir: Path, fake: FakeEngineClient) -> None:
    with _client(demo_model_dir, fake, api_key="sekret") as c:
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 401
        bad = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "AuthenticationError"
        ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


class _DeadEngine(FakeEngineClient):
    async def generate(self, *a: object, **kw: object):  # type: ignore[override]
        raise EngineError("engine_dead", "no message from the engine-core for 5.0 s")
        yield  # pragma: no cover

    async def call_utility(self, method: str, timeout: float = 30.0):  # type: ignore[override]
        raise EngineError("engine_dead", "gone")

    connected = False  # type: ignore[assignment]
    failure = EngineError("engine_dead", "gone")


def test_engine_unavailable_is_503(demo_model_dir: Path) -> None:
    with _client(demo_model_dir, _DeadEngine(str(demo_model_dir), [5])) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 503
        # A stream is refused before its status too: 503 + Retry-After, never 200 and then an error.
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == 503
        assert 'evenflow:request_rejected_total{model_name="fake-model",reason="engine_unavailable"} 2.0' in \
            c.get("/metrics").text


def test_disconnect_mid_stream_aborts_engine_request(demo_model_dir: Path, demo_tokenizer: Tokenizer) -> None:
    fake = FakeEngineClient(str(demo_model_dir), [5, 6, 7], step_delay=0.01)
    plan = ChoicePlan([1, 2], [SamplingParams(max_tokens=10_000)] * 2, [], False, True, 0)
    gen = Generation(fake, demo_tokenizer, "req", [plan])
    sent: list[dict] = []

    async def body():
        async for job, d in gen.stream():
            yield d.text.encode()

    async def receive() -> dict:
        await asyncio.sleep(0.2)
        return {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        sent.append(msg)

    async def main() -> None:
        await SSEResponse(body())({"type": "http"}, receive, send)
        await asyncio.sleep(0.05)  # the detached abort runs

    asyncio.run(main())
    assert len(sent) > 3  # it was streaming
    assert sorted(fake.aborted) == ["req-0", "req-1"] and not fake.live


def test_model_answers_to_its_name_and_alias_each_listed_once(demo_model_dir: Path, demo_tokenizer: Tokenizer) -> None:
    # The engine serves under the --model string as given (vLLM) and names the folder's base name
    # as an alias, so clients of either convention work; /v1/models lists each name once.
    fake = FakeEngineClient(str(demo_model_dir), demo_tokenizer.encode(TEXT), model_aliases=("base", "fake-model"))
    with _client(demo_model_dir, fake) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["fake-model", "base"]
        for name in ("fake-model", "base"):
            assert http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2}).status_code == 200
        assert http.post("/v1/completions", json={"model": "other", "prompt": "hi"}).status_code == 404
    with _client(demo_model_dir, fake, served_model_name="mine") as http:  # an explicit name replaces both
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["mine"]
        assert http.post("/v1/completions", json={"model": "base", "prompt": "hi"}).status_code == 404
