"""Die with the launcher: a process started by ``evenflow serve`` (or any launcher that asks) must
not outlive it, even when the launcher is SIGKILLed and has no chance to stop its children.

The launcher puts its pid in ``EVENFLOW_PARENT_PID``; the child calls ``die_with_parent()`` first
thing. On Linux the kernel does it (``PR_SET_PDEATHSIG``: a signal when the parent exits); elsewhere
a daemon thread polls the parent pid. Processes started by hand (no variable) are left alone, so a
service manager or a shell stays in charge of them.

``stop_processes`` is the other end: how a launcher stops the children it started. A launcher also
names its own folder in ``EVENFLOW_RUNTIME_DIR``: its children make their temporary folders (sockets)
there (``runtime_dir``), so a child killed before it could clean up leaves nothing once the launcher
removes its folder (a supervisor restarting a SIGKILLed engine-core left one folder a restart).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

PARENT_PID_ENV = "EVENFLOW_PARENT_PID"
RUNTIME_DIR_ENV = "EVENFLOW_RUNTIME_DIR"
RUNTIME_DIR_MAX_LEN = 64  # leaves 43 bytes for a folder made in it and a socket in that
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that must die with this process."""
    return {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid())}


def with_runtime_dir(env: dict[str, str], folder: str) -> dict[str, str]:
    """``env`` naming ``folder`` as the children's runtime folder (``runtime_dir``)."""
    return {**env, RUNTIME_DIR_ENV: folder}


def runtime_dir() -> str | None:
    """Where this process makes its temporary folders: its launcher's folder, if it names one that
    exists and is short enough (None: the system's temporary folder). A socket's path must fit in
    107 bytes (``sockaddr_un``): a launcher's folder nested in another's exceeded that once."""
    path = os.environ.get(RUNTIME_DIR_ENV)
    return path if path and len(path) <= RUNTIME_DIR_MAX_LEN and os.path.isdir(path) else None


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """If launched with ``EVENFLOW_PARENT_PID``: get ``sig`` when that parent dies (now, if it is
    already gone). Returns whether a watch was set up."""
    text = os.environ.pop(PARENT_PID_ENV, None)  # popped: our own children get their own value
    if not text or not text.isdigit():
        return False
    parent = int(text)
    armed = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # the parent died before the watch was armed
        os.kill(os.getpid(), sig)
        return True
    if not armed:
        def poll() -> None:
            while os.getppid() == parent:
                time.sleep(_POLL_S)
            os.kill(os.getpid(), sig)

        threading.Thread(target=poll, name="parent-watch", daemon=True).start()
    return True


def stop_processes(procs: Sequence[subprocess.Popen], timeout: float, kill_group: bool = False) -> None:
    """SIGTERM every one still running (by PID), wait ``timeout`` seconds for them all together,
    then SIGKILL each that lingers: its process group with ``kill_group`` (it was started as the
    leader of one, so its own children go too)."""
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if kill_group:
                os.killpg(p.pid, signal.SIGKILL)
            else:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
