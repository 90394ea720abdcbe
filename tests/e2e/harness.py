"""Start an engine-core as a real process for end-to-end tests, and stop it (and its workers) by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from evenflow.frontend.clients.engine_client import BlockingEngineClient, EngineError
from evenflow.protocol import Ready


@dataclass
class EngineProcess:
    proc: subprocess.Popen
    address: str
    log_path: Path
    ready: Ready | None = None
    worker_pids: list[int] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the engine-core (it stops its workers), SIGKILL whatever is left; return its code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.worker_pids:  # normally gone already (WorkerShutdown or parent-death watch)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.proc.returncode


def start_engine(model_dir: Path, workdir: Path, *flags: str, name: str = "engine",
                 ready_timeout: float = 120.0) -> EngineProcess:
    """Run ``python -m evenflow.core`` on an ipc:// address in ``workdir``; wait until it answers Hello."""
    workdir.mkdir(parents=True, exist_ok=True)
    address = f"ipc://{workdir}/{name}.sock"
    log_path = workdir / f"{name}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "evenflow.core", "--model", str(model_dir),
                                 "--listen", address, *flags], stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    engine = EngineProcess(proc, address, log_path)
    try:
        deadline = time.monotonic() + ready_timeout
        while engine.ready is None:
            if proc.poll() is not None:
                raise RuntimeError(f"engine-core exited with {proc.returncode}:\n{engine.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine-core not ready in {ready_timeout} s:\n{engine.log()}")
            client = BlockingEngineClient(address, "harness")
            try:
                engine.ready = client.connect(timeout=2.0)
            except EngineError:
                pass
            finally:
                client.close()
        engine.worker_pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except BaseException:
        engine.stop()
        raise
    return engine
