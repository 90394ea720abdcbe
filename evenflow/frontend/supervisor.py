"""``evenflow serve``'s children, kept running: a child that dies is started again with backoff.

The others keep serving meanwhile: frontends share the port with SO_REUSEPORT, so the kernel sends
new connections to the live ones, and a restarted engine-core binds the same address, where the
frontends' clients find it again (evenflow/frontend/clients/engine_client.py). Supervision ends when
a child keeps failing (more than ``max_restarts`` deaths within ``window_s``) or exits with 2 (a
refused flag: starting it again cannot help).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable

EXIT_CONFIG = 2  # a child's code for a refused flag


@dataclass
class Child:
    """One supervised process: how to start it, and its recent deaths."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    preexec_fn: Callable[[], None] | None = None
    proc: subprocess.Popen | None = None
    deaths: list[float] = field(default_factory=list)  # monotonic times, within the window
    restart_at: float | None = None

    def start(self) -> subprocess.Popen:
        self.proc = subprocess.Popen(self.cmd, env=self.env, preexec_fn=self.preexec_fn)
        return self.proc


@dataclass
class Supervisor:
    children: list[Child]
    max_restarts: int = 5
    window_s: float = 60.0
    backoff_min_s: float = 0.5
    backoff_max_s: float = 10.0
    restarts: int = 0

    def start_all(self) -> None:
        for child in self.children:
            child.start()

    def poll(self, now: float) -> int | None:
        """Restart what died (once its backoff passed); an exit code when supervision must end."""
        for child in self.children:
            if child.proc is not None and (code := child.proc.poll()) is not None:
                pid, child.proc = child.proc.pid, None
                if code == EXIT_CONFIG:  # the child named the refused flag in one line already
                    return EXIT_CONFIG
                child.deaths = [t for t in child.deaths if now - t < self.window_s] + [now]
                if len(child.deaths) > self.max_restarts:
                    _say(f"{child.name} (pid {pid}) exited with code {code}, its {len(child.deaths)}th death in "
                         f"{self.window_s:g} s; giving up and stopping everything")
                    return 1
                delay = min(self.backoff_min_s * 2 ** (len(child.deaths) - 1), self.backoff_max_s)
                _say(f"{child.name} (pid {pid}) exited with code {code}; restarting it in {delay:g} s "
                     f"(death {len(child.deaths)} of at most {self.max_restarts + 1} in {self.window_s:g} s); "
                     f"the others keep serving")
                child.restart_at = now + delay
            elif child.proc is None and child.restart_at is not None and now >= child.restart_at:
                child.restart_at = None
                proc = child.start()
                self.restarts += 1
                _say(f"{child.name} restarted (pid {proc.pid})")
        return None


def _say(text: str) -> None:
    print(f"evenflow: {text}", file=sys.stderr, flush=True)
