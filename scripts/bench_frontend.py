"""Frontend cost per streamed token (HTTP + detokenization + SSE), with 1 and 2 frontends, in one run.

Many concurrent streams (fixed max_tokens) pull tokens through 1 frontend, then through 2
frontends sharing one port (SO_REUSEPORT). For each we report tokens delivered per second and the
frontends' CPU time per delivered token (psutil on the frontend PIDs).

The engine must not be the bottleneck. By default it is a protocol-level stand-in
(``--fake-engine``, in this file): a ZMQ ROUTER that speaks the real wire protocol and emits one
token per live request every ``--step-ms`` (real token ids of real text, so detokenization does
real work). ``--real`` uses a real engine-core on the tiny demo model instead (on a small CPU box
its forward pass, not the frontend, then sets the pace).

    python scripts/bench_frontend.py [--real] [--streams 64] [--requests 256] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from evenflow.protocol.lifeline import stop_processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, **env})


def stop(procs: list[subprocess.Popen]) -> None:
    stop_processes(procs, timeout=20)


def wait_ready(logs: list[Path], port: int, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process exited:\n" + "\n".join(log.read_text()[-2000:] for log in logs))
        if all("serving" in log.read_text(errors="replace") for log in logs):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(0.3)
    raise TimeoutError("frontends not ready")


async def one_stream(port: int, body: bytes) -> int:
    """POST one streaming completion over a raw socket; return the number of SSE events read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    data = await reader.read()  # until the server closes: the whole stream
    writer.close()
    if b"data: [DONE]" not in data or b'"finish_reason":"length"' not in data:
        raise RuntimeError(f"incomplete stream: {data[-300:]!r}")
    return data.count(b"data: ")


async def drive(port: int, streams: int, requests: int, max_tokens: int) -> float:
    body = json.dumps({"prompt": "def main():", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                       "temperature": 1.0}).encode()
    sem = asyncio.Semaphore(streams)

    async def guarded() -> int:
        async with sem:
            return await one_stream(port, body)

    t0 = time.perf_counter()
    await asyncio.gather(*(guarded() for _ in range(requests)))
    return time.perf_counter() - t0


def fake_engine(address: str, model_dir: str, step_ms: float) -> None:
    """A stand-in engine-core: Hello -> Ready; every step, one token per live request, per client."""
    import zmq

    from evenflow.frontend.tokenizer import Tokenizer
    from evenflow.protocol import (PROTOCOL_VERSION, Abort, AddRequest, Heartbeat, Hello, Outputs, Ready, RequestOutput,
                                   SchedulerStats, UtilityCall, UtilityResult)
    from evenflow.protocol.codec import engine_codec

    tok = Tokenizer.from_dir(model_dir)
    script = tok.encode(Path(json.__file__).read_text() * 2, add_special_tokens=False)  # real code text
    codec = engine_codec()
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(address)
    live: dict[bytes, dict[str, list[int]]] = {}  # client -> request id -> [produced, max_tokens]
    stats = SchedulerStats()
    next_step = time.perf_counter()
    while True:
        timeout = max(0.0, next_step - time.perf_counter())
        while sock.poll(int(timeout * 1000)):
            ident, frame = sock.recv_multipart()
            msg = codec.decode(frame)
            if isinstance(msg, Hello):
                live.setdefault(ident, {})
                ready = Ready(PROTOCOL_VERSION, "demo", model_dir, 4096, tok.vocab_size, [1], 16, 100000, 8192, "fake")
                sock.send_multipart([ident, codec.encode(ready)])
            elif isinstance(msg, AddRequest):
                live.setdefault(ident, {})[msg.request_id] = [0, msg.sampling_params.max_tokens]
            elif isinstance(msg, Abort):
                for rid in msg.request_ids:
                    live.get(ident, {}).pop(rid, None)
            elif isinstance(msg, Heartbeat):
                sock.send_multipart([ident, codec.encode(Outputs([], stats, time.time()))])
            elif isinstance(msg, UtilityCall):
                sock.send_multipart([ident, codec.encode(UtilityResult(msg.call_id, True, stats))])
            timeout = 0.0
        next_step = time.perf_counter() + step_ms / 1000
        for ident, reqs in live.items():
            if not reqs:
                continue
            outs = []
            for rid, state in list(reqs.items()):
                produced, max_tokens = state
                state[0] = produced + 1
                done = state[0] >= max_tokens
                outs.append(RequestOutput(rid, [script[(produced * 7 + len(rid)) % len(script)]],
                                          "length" if done else None))
                if done:
                    del reqs[rid]
            sock.send_multipart([ident, codec.encode(Outputs(outs, stats, time.time()))])


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def run_config(n_frontends: int, engine_addr: str, tmp: Path, args: argparse.Namespace) -> dict:
    port = free_port()
    logs = [tmp / f"fe{n_frontends}-{i}.log" for i in range(n_frontends)]
    procs = [spawn(["-m", "evenflow.frontend.cli", "--engine", engine_addr, "--port", str(port), "--no-log-stats",
                    "--frontend-name", f"bench{n_frontends}-{i}"], logs[i], {}) for i in range(n_frontends)]
    try:
        wait_ready(logs, port, procs)
        # Warm-up at full concurrency: the engine's first large batches are slow (allocation, kernels).
        asyncio.run(drive(port, args.streams, args.streams, 16))
        pids = [p.pid for p in procs]
        cpu0 = cpu_seconds(pids)
        wall = asyncio.run(drive(port, args.streams, args.requests, args.max_tokens))
        cpu = cpu_seconds(pids) - cpu0
    finally:
        stop(procs)
    tokens = args.requests * args.max_tokens
    return {"frontends": n_frontends, "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1), "frontend_cpu_s": round(cpu, 3),
            "frontend_cpu_us_per_token": round(cpu / tokens * 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the tiny demo model)")
    p.add_argument("--real", action="store_true", help="a real engine-core instead of the protocol stand-in")
    p.add_argument("--step-ms", type=float, default=2.0, help="stand-in engine: milliseconds per step")
    p.add_argument("--fake-engine", default=None, help=argparse.SUPPRESS)  # internal: run the stand-in
    p.add_argument("--streams", type=int, default=64, help="concurrent streams")
    p.add_argument("--requests", type=int, default=256, help="streams in total per configuration")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--engine-flags", default="--max-num-seqs 128 --max-model-len 512",
                   help="extra engine-core flags (one string)")
    args = p.parse_args()
    model = args.model
    if model is None:
        from evenflow.frontend.demo_model import ensure_demo_model

        model = str(ensure_demo_model())
    if args.fake_engine:
        fake_engine(args.fake_engine, model, args.step_ms)
        return
    with tempfile.TemporaryDirectory(prefix="bench-frontend-") as d:
        tmp = Path(d)
        engine_addr = f"ipc://{tmp}/engine.sock"
        if args.real:
            engine = spawn(["-m", "evenflow.core.cli", "--model", model, "--listen", engine_addr,
                            *args.engine_flags.split()], tmp / "engine.log", {})
        else:
            engine = spawn([__file__, "--fake-engine", engine_addr, "--model", model, "--step-ms", str(args.step_ms)],
                           tmp / "engine.log", {})
        try:
            results = [run_config(n, engine_addr, tmp, args) for n in (1, 2)]
        finally:
            stop([engine])
    print(f"engine: {'engine-core on ' + model if args.real else f'protocol stand-in, {args.step_ms} ms/step'}; "
          f"{args.streams} concurrent streams, {args.requests} x {args.max_tokens} tokens per configuration")
    print(f"{'frontends':>9} {'tokens/s':>10} {'frontend CPU us/token':>22} {'wall s':>8}")
    for r in results:
        print(f"{r['frontends']:>9} {r['tokens_per_s']:>10} {r['frontend_cpu_us_per_token']:>22} {r['wall_s']:>8}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
