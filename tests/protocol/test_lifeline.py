"""stop_processes: SIGTERM first, SIGKILL after the shared deadline, the group when asked."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from evenflow.protocol.lifeline import stop_processes

# Prints once its handler is in place, so the test never signals it before it can ignore SIGTERM.
IGNORES_SIGTERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print(1, flush=True); time.sleep(60)")


def _start(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline()
    return proc


def test_a_child_that_exits_on_sigterm_is_not_killed() -> None:
    polite = _start("import time; print(1, flush=True); time.sleep(60)")
    start = time.monotonic()
    stop_processes([polite], timeout=10)
    assert polite.returncode == -signal.SIGTERM and time.monotonic() - start < 5


def test_children_that_ignore_sigterm_are_killed_after_one_shared_deadline() -> None:
    stubborn = [_start(IGNORES_SIGTERM) for _ in range(2)]
    start = time.monotonic()
    stop_processes(stubborn, timeout=1.0)
    elapsed = time.monotonic() - start
    assert [p.returncode for p in stubborn] == [-signal.SIGKILL] * 2
    assert 1.0 <= elapsed < 1.0 + 0.1 + 3  # one deadline for both, then at most 0.1 s for the second


def test_kill_group_also_kills_the_grandchild() -> None:
    # The child leads a new session and starts a grandchild that ignores SIGTERM too.
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"g = subprocess.Popen([sys.executable, '-c', {IGNORES_SIGTERM!r}], stdout=subprocess.PIPE); "
            "g.stdout.readline(); print(g.pid, flush=True); time.sleep(60)")
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert leader.stdout is not None
    grandchild = int(leader.stdout.readline())
    stop_processes([leader], timeout=0.5, kill_group=True)
    assert leader.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(grandchild):
        time.sleep(0.05)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, killed and waiting for its reaper, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_runtime_dir_is_the_launchers_folder_when_a_socket_fits_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from evenflow.protocol.lifeline import RUNTIME_DIR_ENV, RUNTIME_DIR_MAX_LEN, runtime_dir

    folder = Path(tempfile.mkdtemp(prefix="ef-", dir="/tmp"))  # short: pytest's folders grow with the user name
    try:
        monkeypatch.setenv(RUNTIME_DIR_ENV, str(folder))
        assert runtime_dir() == str(folder)
        deep = folder / ("d" * RUNTIME_DIR_MAX_LEN)
        deep.mkdir()
        monkeypatch.setenv(RUNTIME_DIR_ENV, str(deep))  # a socket two folders down would not fit in 107 bytes
        assert runtime_dir() is None
        monkeypatch.setenv(RUNTIME_DIR_ENV, str(folder / "gone"))
        assert runtime_dir() is None
        monkeypatch.delenv(RUNTIME_DIR_ENV)
        assert runtime_dir() is None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
