"""Overload, deadlines and body limits at the HTTP layer (a scripted engine client, no processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from starlette.testclient import TestClient

from evenflow.frontend.api.server import ServerConfig, build_app, connect_context
from evenflow.frontend.tokenizer import Tokenizer

from .fakes import FakeEngineClient

OVERLOADED = ("overloaded", "max_num_queued_reqs: the engine holds 4 requests, its limit (--max-num-queued-reqs) is 4")


@pytest.fixture()
def fake(demo_model_dir: Path, demo_tokenizer: Tokenizer) -> FakeEngineClient:
    return FakeEngineClient(str(demo_model_dir), demo_tokenizer.encode("some words", add_special_tokens=False))


def _http(fake: FakeEngineClient, **cfg: object) -> TestClient:
    config = ServerConfig(**cfg)  # type: ignore[arg-type]
    return TestClient(build_app(config, lambda: connect_context(config, fake)))


@pytest.fixture()
def http(fake: FakeEngineClient) -> Iterator[TestClient]:
    with _http(fake) as c:
        yield c


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_overload_is_503_with_retry_after_before_any_status(http: TestClient, fake: FakeEngineClient, path: str,
                                                           body: dict, stream: bool) -> None:
    fake.refuse = OVERLOADED
    r = http.post(path, json={**body, "stream": stream, "n": 2})
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1" and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["type"] == "ServiceUnavailableError" and "max_num_queued_reqs" in err["message"]
    assert 'reason="max_num_queued_reqs"} 1.0' in http.get("/metrics").text
    fake.refuse = None
    ok = http.post(path, json={**body, "stream": stream})
    assert ok.status_code == 200


def test_a_refused_sibling_aborts_the_admitted_choices(http: TestClient, fake: FakeEngineClient) -> None:
    real_generate = fake.generate

    def generate(request_id: str, *a: object, **kw: object):  # type: ignore[no-untyped-def]
        fake.refuse = OVERLOADED if request_id.endswith("-1") else None
        return real_generate(request_id, *a, **kw)  # type: ignore[arg-type]

    fake.generate = generate  # type: ignore[method-assign]
    fake.step_delay = 0.05
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "n": 2, "stream": True})
    assert r.status_code == 503
    assert not fake.live and fake.aborted  # the admitted choice was aborted, not left running


def test_request_timeout_header_reaches_the_engine_and_a_deadline_is_504(http: TestClient,
                                                                         fake: FakeEngineClient) -> None:
    seen: list[float] = []
    real_generate = fake.generate

    def generate(*a: object, timeout_s: float = 0.0, **kw: object):  # type: ignore[no-untyped-def]
        seen.append(timeout_s)
        return real_generate(*a, **kw)  # type: ignore[arg-type]

    fake.generate = generate  # type: ignore[method-assign]
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"X-Request-Timeout": "2.5"})
    assert r.status_code == 200 and seen == [2.5]
    for bad in ("0", "-1", "soon", "inf"):
        r = http.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Timeout": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Timeout"
    fake.generate = real_generate  # type: ignore[method-assign]
    fake.refuse = ("request_timeout", "request 'x' exceeded its deadline of 2.5 s (3 tokens generated) and was aborted")
    r = http.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 504 and "deadline" in r.json()["error"]["message"]


def test_body_over_the_limit_is_413_before_it_is_read(fake: FakeEngineClient) -> None:
    with _http(fake, max_body_bytes=1000) as c:
        r = c.post("/v1/completions", content=b'{"prompt": "' + b"a" * 2000 + b'"}',
                   headers={"content-type": "application/json"})
        assert r.status_code == 413 and "1000" in r.json()["error"]["message"]

        def chunks() -> Iterator[bytes]:  # no content-length: counted as it streams in
            for _ in range(5):
                yield b"a" * 400

        assert c.post("/v1/completions", content=chunks()).status_code == 413
        assert c.post("/tokenize", content=b"x" * 1001).status_code == 413
        assert c.post("/v1/completions", json={"prompt": "fits", "max_tokens": 1}).status_code == 200
