"""``evenflow serve``: one engine-core and N frontend processes behind one HTTP port.

The parent reserves the port with a bound (never listening) SO_REUSEPORT socket, so ``--port 0``
works and nobody else takes it; each frontend binds its own SO_REUSEPORT listener on it after it
has connected to the engine, and the kernel spreads connections over them. Frontends publish
metrics to a shared temp folder (EVENFLOW_METRICS_DIR) so ``/metrics`` counts each request once.
Ctrl-C (or SIGTERM, or any child dying) stops every child by PID.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from evenflow.protocol.lifeline import child_env

from .cli import add_frontend_flags

DEMO_NAME = "demo"


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="evenflow serve",
        allow_abbrev=False,  # an abbreviation must not swallow an engine-core flag
        description="Start one engine-core and N frontends. Flags not listed here go to engine-core "
        "(see `engine-core --help`).",
    )
    p.add_argument("--model", default=None, help="model folder (default: the built-in demo model, random weights)")
    p.add_argument("--frontends", type=int, default=1, help="HTTP frontend processes sharing the port")
    p.add_argument("--engine-listen", default=None, help="engine-core address (default: ipc:// in a temp folder)")
    add_frontend_flags(p)
    return p


def _reserve_port(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))  # bound, not listening: it reserves the port but takes no connections
    return sock


def _stop(procs: list[subprocess.Popen], timeout: float = 15.0) -> None:
    """SIGTERM every live child, wait, then SIGKILL the stragglers (by PID, children only)."""
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()


def serve_main(argv: Sequence[str]) -> int:
    args, engine_flags = serve_parser().parse_known_args(list(argv))
    if args.frontends < 1:
        print("evenflow serve: --frontends must be >= 1", file=sys.stderr)
        return 2
    served_name = args.served_model_name
    note = ""
    model = args.model
    if model is None:
        from .demo_model import RANDOM_WEIGHTS_NOTE, default_demo_dir, ensure_demo_model

        if not (default_demo_dir() / "config.json").exists():
            print(f"evenflow: writing the demo model to {default_demo_dir()} (first use) ...", flush=True)
        model = str(ensure_demo_model())
        served_name = served_name or DEMO_NAME
        note = f"\n  NOTE: {RANDOM_WEIGHTS_NOTE} (pass --model DIR for a real model)"
    workdir = tempfile.mkdtemp(prefix="evenflow-serve-")
    engine_addr = args.engine_listen or f"ipc://{workdir}/engine.sock"
    metrics_dir = os.path.join(workdir, "metrics")
    os.makedirs(metrics_dir)
    reserved = _reserve_port(args.host, args.port)
    port = reserved.getsockname()[1]
    # Children get SIGTERM if this launcher dies, even by SIGKILL (protocol/lifeline.py).
    env = child_env(dict(os.environ, EVENFLOW_METRICS_DIR=metrics_dir))
    if args.api_key:  # through the environment: a command line is visible to every user in `ps`
        env["EVENFLOW_API_KEY"] = args.api_key
    py = sys.executable
    engine_cmd = [py, "-m", "evenflow.core.cli", "--model", model, "--listen", engine_addr, *engine_flags]
    if served_name:
        engine_cmd += ["--served-model-name", served_name]
    procs: list[subprocess.Popen] = [subprocess.Popen(engine_cmd, env=env)]
    for i in range(args.frontends):
        cmd = [py, "-m", "evenflow.frontend.cli", "--engine", engine_addr, "--host", args.host, "--port", str(port),
               "--frontend-name", f"frontend-{i}"]
        for flag in ("served_model_name", "chat_template", "tokenizer", "max_request_body_bytes"):
            value = getattr(args, flag)
            if value:
                cmd += ["--" + flag.replace("_", "-"), str(value)]
        if i > 0:
            cmd.append("--no-log-stats")  # one throughput log line per interval, not N copies
        procs.append(subprocess.Popen(cmd, env=env))
    print(f"evenflow: serving {served_name or model} on http://{args.host}:{port} with {args.frontends} "
          f"frontend(s); engine-core at {engine_addr} (pid {procs[0].pid}){note}", flush=True)

    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        while not stopping:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                print(f"evenflow: process {dead[0].pid} ({' '.join(dead[0].args[2:4])}) exited with code "
                      f"{dead[0].returncode}; stopping everything", file=sys.stderr, flush=True)
                code = 1
                break
            time.sleep(0.2)
    finally:
        # Frontends first (they drain and close their engine connections), then the engine-core.
        _stop(procs[1:])
        _stop(procs[:1])
        reserved.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return code
