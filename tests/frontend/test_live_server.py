"""The real thing: one engine-core on the demo model, two frontends sharing one port (SO_REUSEPORT),
driven with the official ``openai`` client and raw HTTP. One server set for the whole module."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from .live import metric, start, stop, tail, wait_for
from tests.ports import free_port

pytestmark = pytest.mark.slow


class Server:
    def __init__(self, url: str, logs: list[Path]) -> None:
        self.url = url
        self.logs = logs
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("live")
    engine_addr = f"ipc://{tmp}/engine.sock"
    port = free_port()
    env = {"EVENFLOW_METRICS_DIR": str(tmp / "metrics")}
    logs = [tmp / "engine.log", tmp / "frontend-0.log", tmp / "frontend-1.log"]
    procs = [start(["-m", "evenflow.core.cli", "--model", str(demo_model_dir), "--listen", engine_addr,
                    "--served-model-name", "demo", "--max-model-len", "512", "--num-kv-blocks", "96",
                    "--max-num-batched-tokens", "256"], logs[0], env)]
    for i in (0, 1):
        procs.append(start(["-m", "evenflow.frontend.cli", "--engine", engine_addr, "--port", str(port),
                            "--frontend-name", f"frontend-{i}"], logs[1 + i], env))
    try:
        wait_for(lambda: all("serving demo" in log.read_text(errors="replace") for log in logs[1:]), 120, procs, logs)
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200, 30, procs, logs)
        yield Server(f"http://127.0.0.1:{port}", logs)
    finally:
        stop(procs[1:])
        stop(procs[:1])


def test_completions_non_streaming_n_logprobs_usage(server: Server) -> None:
    r = server.client.completions.create(model="demo", prompt="def fibonacci(n):", max_tokens=8, n=2, logprobs=2,
                                         temperature=1.0, seed=1)
    assert len(r.choices) == 2 and {c.index for c in r.choices} == {0, 1}
    for c in r.choices:
        assert c.finish_reason == "length" and len(c.logprobs.tokens) == 8
        assert all(len(t) >= 2 for t in c.logprobs.top_logprobs)
        # A token that is part of a character is keyed by its bytes ("bytes:\\xe2"), not its text.
        assert "".join(c.logprobs.tokens) == c.text or any(t.startswith("bytes:") for t in c.logprobs.tokens)
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens > 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + 16


def test_completions_streaming_matches_non_streaming(server: Server) -> None:
    kw = dict(model="demo", prompt="import os\n", max_tokens=24, temperature=0.0)
    full = server.client.completions.create(**kw).choices[0].text
    chunks = list(server.client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.text for ch in chunks for c in ch.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]


def test_chat_streaming_and_not(server: Server) -> None:
    msgs = [{"role": "user", "content": "Say hi"}]
    r = server.client.chat.completions.create(model="demo", messages=msgs, max_tokens=6, temperature=0.0,
                                              logprobs=True, top_logprobs=2)
    assert r.choices[0].message.role == "assistant" and len(r.choices[0].logprobs.content) == 6
    stream = server.client.chat.completions.create(model="demo", messages=msgs, max_tokens=6, temperature=0.0,
                                                   stream=True, n=2)
    texts = {0: "", 1: ""}
    for ch in stream:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == texts[1] == r.choices[0].message.content  # greedy: both samples agree


def test_stop_string_across_tokens(server: Server) -> None:
    kw = dict(model="demo", prompt="class Foo:", max_tokens=30, temperature=0.0, extra_body={"return_token_ids": True})
    ref = server.client.completions.create(**kw).choices[0]
    text = ref.text
    assert len(text) > 12
    stop = text[5:12]  # seven characters: spans token boundaries with this tokenizer
    r = server.client.completions.create(stop=[stop], **kw).choices[0]
    assert r.text == text[:text.index(stop)] and r.finish_reason == "stop"
    streamed = "".join(c.text for ch in server.client.completions.create(stop=[stop], stream=True, **kw) for c in ch.choices)
    assert streamed == r.text


def test_errors_live(server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="512"):
        server.client.completions.create(model="demo", prompt="x", max_tokens=5000)
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="other", prompt="x", max_tokens=2)
    assert [m.id for m in server.client.models.list().data] == ["demo"]


def test_disconnect_frees_kv_blocks(server: Server) -> None:
    body = {"model": "demo", "prompt": "def long():", "max_tokens": 450, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept alive: dropping the iterator would close the connection
        for _ in range(3):
            while not next(lines).startswith("data: "):
                pass
        during = server.metrics()
        assert metric(during, "evenflow:kv_cache_usage_perc") > 0 and metric(during, "evenflow:num_requests_running") == 1
        aborted_before = metric(during, "evenflow:request_success_total", model_name="demo", finished_reason="abort")
    # The connection is closed here, mid-stream.
    # 450 tokens would take many seconds; freed blocks show up long before.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        m = server.metrics()
        if metric(m, "evenflow:num_requests_running") == 0 and metric(m, "evenflow:kv_cache_usage_perc") == 0:
            time.sleep(1.2)  # the serving frontend's snapshot reaches the shared folder
            aborted = metric(server.metrics(), "evenflow:request_success_total", model_name="demo",
                             finished_reason="abort")
            assert aborted == aborted_before + 1
            break
        time.sleep(0.2)
    else:
        raise AssertionError("KV blocks not freed after the client left:\n" + server.metrics() + tail(server.logs))


def test_two_frontends_concurrent_streams_counted_once(server: Server) -> None:
    time.sleep(1.5)  # every frontend has published its snapshot
    before = metric(server.metrics(), "evenflow:request_success_total")
    gen_before = metric(server.metrics(), "evenflow:generation_tokens_total")
    num, max_tokens = 12, 10

    def one(i: int) -> str:
        # A fresh client per stream: new connections, spread over both frontends by the kernel.
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
        stream = c.completions.create(model="demo", prompt=f"# file {i}\n", max_tokens=max_tokens, stream=True,
                                      extra_body={"ignore_eos": True})
        return "".join(ch.choices[0].text for ch in stream if ch.choices)

    with concurrent.futures.ThreadPoolExecutor(num) as pool:
        texts = list(pool.map(one, range(num)))
    assert all(texts)
    time.sleep(1.5)
    served = [log.read_text() for log in server.logs[1:]]
    assert all("serving demo" in s for s in served)
    for _ in range(4):  # whichever frontend answers the scrape, the totals agree
        m = server.metrics()
        assert metric(m, "evenflow:request_success_total") - before == num
        assert metric(m, "evenflow:generation_tokens_total") - gen_before == num * max_tokens
