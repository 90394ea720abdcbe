"""Helpers for live tests: start processes with logs, wait for HTTP, stop them by PID."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from evenflow.protocol.lifeline import stop_processes


def start(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m ...`` with stdout+stderr to ``log``, in its own session (so teardown can reach it)."""
    f = open(log, "wb")
    return subprocess.Popen([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def stop(procs: list[subprocess.Popen], timeout: float = 20.0) -> None:
    """SIGTERM each by PID, then SIGKILL its process group if it lingers (it started that group)."""
    stop_processes(procs, timeout, kill_group=True)


def wait_for(predicate, timeout: float, procs: list[subprocess.Popen], logs: list[Path]) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"process {p.args} exited with {p.returncode}:\n" + tail(logs))
        try:
            if predicate():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError("not ready in time:\n" + tail(logs))


def tail(logs: list[Path], n: int = 25) -> str:
    out = []
    for log in logs:
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        out.append(f"--- {log.name}\n" + "\n".join(lines[-n:]))
    return "\n".join(out)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels`` (parsed as Prometheus does)."""
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())