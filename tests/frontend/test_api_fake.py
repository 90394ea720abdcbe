"""The HTTP API against an in-process fake engine client (no processes, fast)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Iterator

import pytest
from starlette.testclient import TestClient

from evenflow.frontend.api.generation import Generation
from evenflow.frontend.api.prepare import ChoicePlan
from evenflow.frontend.api.server import ServerConfig, build_app, connect_context
from evenflow.frontend.api.sse import SSEResponse
from evenflow.frontend.client import EngineError
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


def test_n_choices_echo_and_logprobs(http: TestClient, fake: FakeEngineClient) -> None:
    r = http.post("/v1/completions", json={"prompt": ["ab", "cd"], "n": 2, "max_tokens": 3, "echo": True, "logprobs": 2,
                                           "seed": 5})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][0]["text"].startswith("ab") and body["choices"][3]["text"].startswith("cd")
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and len(lp["top_logprobs"][0]) >= 2 and lp["text_offset"][0] == 2
    assert [s[2].seed for s in fake.submitted] == [5, 6, 5, 6]


def test_chat_streaming_n2(http: TestClient) -> None:
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 5,
                                                "stream": True, "logprobs": True, "top_logprobs": 1})
    events = _events(r)
    assert [c["delta"] for c in events[0]["choices"]] == [{"role": "assistant", "content": ""}] * 2
    for i in (0, 1):
        text = "".join(c["delta"].get("content", "") for e in events[1:] for c in e["choices"] if c["index"] == i)
        assert text == TEXT[:len(text)] and len(text) > 5
        assert sum(len(c["logprobs"]["content"]) for e in events[1:] for c in e["choices"] if c["index"] == i) == 5


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


def test_engine_unavailable_is_503(demo_model_dir: Path) -> None:
    with _client(demo_model_dir, _DeadEngine(str(demo_model_dir), [5])) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 503
        events = _events(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}))
        assert events[-1]["error"]["code"] == 503


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
