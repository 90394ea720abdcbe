"""Processes of a chaos run: start/kill/restart by PID, RSS sampling, orphan check, HTTP waits."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from evenflow.bench.server import evenflow_process_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    role: str  # "engine-core", "frontend-0", "serve", ...
    argv: list[str]
    log: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen | None = None
    ready: bool = False  # a frontend: its HTTP port accepts connections

    def start(self) -> None:
        with open(self.log, "ab") as f:
            self.popen = subprocess.Popen([sys.executable, *self.argv], stdout=f, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL,
                                          env=evenflow_process_env(self.env))

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.popen is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            return self.popen.wait()


@dataclass
class Fleet:
    """Every process a run started, with their descendants (workers) as last seen, and RSS."""

    procs: list[Proc] = field(default_factory=list)
    seen: dict[int, str] = field(default_factory=dict)  # pid -> role, everything ever observed
    rss_peak: dict[str, float] = field(default_factory=dict)  # role -> MiB
    rss_end: dict[str, float] = field(default_factory=dict)

    def add(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        proc.start()
        self.seen[proc.pid] = proc.role
        return proc

    def sample(self) -> None:
        """Record RSS of every live process and its descendants (workers under their engine's role)."""
        for proc in self.procs:
            if not proc.alive():
                continue
            try:
                root = psutil.Process(proc.pid)
                family = [(proc.role, root)] + [(f"{proc.role}/child", c) for c in root.children(recursive=True)]
                for role, p in family:
                    self.seen.setdefault(p.pid, role)
                    mib = p.memory_info().rss / 2**20
                    self.rss_peak[role] = max(self.rss_peak.get(role, 0.0), mib)
                    self.rss_end[role] = mib
            except psutil.Error:
                continue

    def orphans(self, grace_s: float = 15.0) -> list[str]:
        """Processes this run started (or their children) still alive after ``grace_s``."""
        deadline = time.monotonic() + grace_s
        while True:
            left = []
            for pid, role in self.seen.items():
                try:
                    if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                        left.append(f"{role} (pid {pid})")
                except psutil.Error:
                    pass
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def kill_leftovers(self) -> None:
        for pid in self.seen:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def wait_healthy(url: str, timeout: float, procs: list[Proc]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.popen is not None and p.popen.poll() is not None:
                raise RuntimeError(f"{p.role} exited with {p.popen.returncode}; see {p.log}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy within {timeout} s")


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.05):
            return True
    except OSError:
        return False


def children_of(proc: Proc) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        return []
