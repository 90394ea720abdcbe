"""Faults across real processes: a worker whose forward raises (the test-only injection hook),
the engine-core gone and back behind a live HTTP frontend, and a launcher that dies by SIGKILL."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.harness import start_engine
from .live import start, stop, tail, wait_for
from tests.ports import free_port

pytestmark = pytest.mark.slow

FLAGS = ("--max-model-len", "256", "--num-kv-blocks", "64", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
         "--worker-threads", "1")
# Room for three 600-token streams side by side, so the injected fault can come late (FAULT_STEP): each of
# them must have started before it, and a stream that reaches a dead engine gets a 503 instead.
LONG_FLAGS = ("--max-model-len", "1024", "--num-kv-blocks", "160", *FLAGS[4:])
FAULT_STEP, STREAM_TOKENS = 300, 600


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _stream(url: str, max_tokens: int) -> tuple[int, list[str]]:
    body = {"prompt": "count with me: one two three", "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        return r.status_code, [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]


def test_forward_fault_fails_every_stream_with_its_cause_then_the_frontend_recovers(
        demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Mid-stream for all three (decoded side by side), and late enough that the last of them has arrived on a
    # loaded machine: at 40 and at 120 steps of 200-token streams one stream reached a dead engine (503) in
    # clean CI runs.
    monkeypatch.setenv("EVENFLOW_TEST_FAIL_FORWARD_AFTER_STEPS", str(FAULT_STEP))
    engine = start_engine(demo_model_dir, tmp_path, *LONG_FLAGS, name="engine")
    monkeypatch.delenv("EVENFLOW_TEST_FAIL_FORWARD_AFTER_STEPS")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "frontend.log"
    frontend = start(["-m", "evenflow.frontend.cli", "--engine", engine.address, "--port", str(port)], log)
    engines = [engine]
    try:
        wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 120, [frontend], [log])
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda _: _stream(url, STREAM_TOKENS), range(3)))
        for status, events in results:
            assert status == 200 and events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == 503 and "injected test fault" in error["message"]
        assert engine.proc.wait(15) not in (0, None), engine.log()
        assert not _alive(engine.worker_pids), "a worker outlived its failed engine-core"
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        gone = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert gone.status_code == 503 and gone.headers["retry-after"] and "engine" in gone.json()["error"]["message"]
        # A new engine-core on the same address: the frontend reconnects by itself.
        engines.append(start_engine(demo_model_dir, tmp_path, *LONG_FLAGS, name="engine"))
        wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 60, [frontend], [log])
        status, events = _stream(url, 5)
        assert status == 200 and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    finally:
        stop([frontend])
        for eng in engines:
            eng.stop()


def test_children_of_a_killed_launcher_do_not_linger(demo_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    serve = start(["-m", "evenflow.frontend", "serve", "--model", str(demo_model_dir), "--port", str(port),
                   "--frontends", "2", *FLAGS], log)
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200, 120, [serve],
                 [log])
        children = [c.pid for c in psutil.Process(serve.pid).children(recursive=True)]
        assert len(children) >= 4, children  # engine-core, its worker, two frontends
        os.kill(serve.pid, signal.SIGKILL)
        serve.wait()
        deadline = time.monotonic() + 20
        while _alive(children):
            assert time.monotonic() < deadline, f"children outlived the launcher: {_alive(children)}\n{tail([log])}"
            time.sleep(0.2)
    finally:
        if serve.poll() is None:
            stop([serve])
        try:
            os.killpg(serve.pid, signal.SIGKILL)  # anything left in its session
        except ProcessLookupError:
            pass
