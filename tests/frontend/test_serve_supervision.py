"""`evenflow serve` supervises: a SIGKILLed frontend or engine-core is restarted with backoff while
the rest keeps serving, and serve exits only when asked (or when a child keeps dying)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from evenflow.frontend.supervisor import Child, Supervisor
from evenflow.protocol.lifeline import RUNTIME_DIR_MAX_LEN
from .live import start, stop, wait_for
from tests.ports import free_port

pytestmark = pytest.mark.slow


def _children(serve_pid: int, marker: str) -> list[int]:
    return [p.pid for p in psutil.Process(serve_pid).children() if marker in " ".join(p.cmdline())]


def _complete(url: str) -> int:
    body = {"prompt": "def f(x):", "max_tokens": 8}
    try:
        return httpx.post(url + "/v1/completions", json=body, timeout=60).status_code
    except httpx.HTTPError:
        return -1


def _stream(url: str) -> tuple[int, str]:
    """(status, finish reason); a stream of the killed frontend is cut: (-1, "cut")."""
    body = {"prompt": "count:", "max_tokens": 120, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    except httpx.HTTPError:
        return -1, "cut"
    if len(events) < 2 or events[-1] != "[DONE]":
        return -1, "cut"
    return r.status_code, json.loads(events[-2])["choices"][0].get("finish_reason") or "error"


def test_killed_frontend_and_engine_core_are_restarted_while_serving(demo_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    proc = start(["-m", "evenflow.frontend", "serve", "--model", str(demo_model_dir), "--port", str(port),
                  "--frontends", "2", "--max-model-len", "256", "--num-kv-blocks", "128", "--worker-threads", "1"], log)
    try:
        wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 180, [proc], [log])
        wait_for(lambda: len(_children(proc.pid, "evenflow.frontend.cli")) == 2, 60, [proc], [log])
        # The engine-core link is an ipc socket in a folder only this user can enter (no API key there).
        engine_cmd = psutil.Process(_children(proc.pid, "evenflow.core.cli")[0]).cmdline()
        address = engine_cmd[engine_cmd.index("--listen") + 1]
        assert address.startswith("ipc://") and os.stat(os.path.dirname(address[6:])).st_mode & 0o077 == 0
        victim = _children(proc.pid, "frontend-0")[0]
        # Streams land on both frontends (the kernel spreads connections by a hash of each one's
        # ports: with 6 streams all of them went to the victim in one CI run, as 1 in 64 runs would;
        # with 12, 1 in 4,096); then frontend-0 is killed.
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            streams = [pool.submit(_stream, url) for _ in range(12)]
            time.sleep(0.5)
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            # A connection the kernel queued on the victim's listener in the instant it died is reset
            # (SO_REUSEPORT spreads connections over listeners; nothing moves them): wait for its exit.
            wait_for(lambda: not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE,
                     10, [proc], [log])
            # New requests keep succeeding: the live frontend takes every new connection.
            during = [_complete(url) for _ in range(5)]
            outcomes = [s.result() for s in streams]
        assert during == [200] * 5, during
        assert any(o == (200, "length") for o in outcomes), outcomes  # the other frontend's streams lived
        wait_for(lambda: any(p != victim for p in _children(proc.pid, "frontend-0")), 60, [proc], [log])
        back_s = time.monotonic() - killed
        assert back_s < 30 and "frontend-0 restarted" in log.read_text()

        engine = _children(proc.pid, "evenflow.core.cli")[0]
        workdir = os.path.dirname(address[6:])
        workers_dirs = [d for d in os.listdir(workdir) if d.startswith("evenflow-workers-")]
        if len(workdir) <= RUNTIME_DIR_MAX_LEN:  # a socket fits there: the engine-core's worker sockets live in it
            assert len(workers_dirs) == 1, workers_dirs
        os.kill(engine, signal.SIGKILL)
        wait_for(lambda: _complete(url) == 200, 120, [proc], [log])
        assert "engine-core 0 restarted" in log.read_text() and proc.poll() is None
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert not os.path.exists(workdir)  # with the killed engine-core's sockets in it
    finally:
        if proc.poll() is None:
            stop([proc])


def test_a_child_that_keeps_dying_ends_supervision(tmp_path: Path) -> None:
    child = Child("flaky", [sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ))
    sup = Supervisor([child], max_restarts=2, window_s=60, backoff_min_s=0.05, backoff_max_s=0.05)
    sup.start_all()
    deadline = time.monotonic() + 30
    code = None
    while code is None and time.monotonic() < deadline:
        code = sup.poll(time.monotonic())
        time.sleep(0.02)
    assert code == 1 and sup.restarts == 2 and len(child.deaths) == 3
    refused = Child("refused", [sys.executable, "-c", "raise SystemExit(2)"], dict(os.environ))
    sup = Supervisor([refused])
    sup.start_all()
    assert isinstance(refused.proc, subprocess.Popen) and refused.proc.wait(30) == 2
    assert sup.poll(time.monotonic()) == 2 and sup.restarts == 0  # a refused flag is not restarted
