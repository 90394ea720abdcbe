"""An engine-core and an HTTP frontend, as documented, each paused 4 s (SIGSTOP) under streaming load
with the default timeouts: no stream fails, and /health of the running frontend answers at once."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.harness import start_engine
from .live import start, stop, wait_for
from tests.ports import free_port

pytestmark = pytest.mark.slow

FLAGS = ("--max-model-len", "256", "--num-kv-blocks", "64", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
         "--worker-threads", "1")
STREAMS = 4


def _stream(url: str) -> tuple[int, list[str]]:
    body = {"prompt": "count with me: one two three", "max_tokens": 150, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                time.sleep(0.02)  # a steady reader: the streams outlast the pause
        return r.status_code, events


def _paused_under_load(url: str, pid: int, seconds: float) -> list[tuple[int, list[str]]]:
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(_stream, url) for _ in range(STREAMS)]
        time.sleep(1.0)  # every stream is at HTTP 200 and streaming
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        return [f.result() for f in futures]


def _assert_all_complete(results: list[tuple[int, list[str]]]) -> None:
    for status, events in results:
        assert status == 200 and events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_engine_core_and_frontend_paused_4s_lose_nothing(demo_model_dir: Path, tmp_path: Path) -> None:
    engine = start_engine(demo_model_dir, tmp_path, *FLAGS)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "frontend.log"
    frontend: subprocess.Popen = start(["-m", "evenflow.frontend.cli", "--engine", engine.address,
                                        "--port", str(port)], log)
    try:
        wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 120, [frontend], [log])
        with concurrent.futures.ThreadPoolExecutor(1) as probe:
            health = probe.submit(_health_latencies, url, 3.0, 1.5)
            _assert_all_complete(_paused_under_load(url, engine.proc.pid, 4.0))
            latencies = health.result()
        # The running frontend answers /health from its own state while the engine-core is paused.
        assert latencies and all(code == 200 for code, _ in latencies), latencies
        assert max(t for _, t in latencies) < 0.5, latencies
        _assert_all_complete(_paused_under_load(url, frontend.pid, 4.0))
        assert "gone: silent" not in engine.log() and "engine_dead" not in log.read_text()
    finally:
        os.kill(engine.proc.pid, signal.SIGCONT)
        stop([frontend])
        engine.stop()


def _health_latencies(url: str, seconds: float, delay: float) -> list[tuple[int, float]]:
    time.sleep(delay)
    out = []
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=5) as http:
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            code = http.get(url + "/health").status_code
            out.append((code, time.monotonic() - t0))
            time.sleep(0.1)
    return out
