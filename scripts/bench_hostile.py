"""Hostile clients against one engine-core + one frontend (demo model, loopback), with the defaults:
what each got, how long it took, and what a normal user saw meanwhile. Prints a table.

    python scripts/bench_hostile.py [--slowloris 500] [--slow-readers 20] [--read-wait 30]

Rows: slowloris (a header byte every 2 s), silent sockets, a 100 KB header, 10,000 headers, a 1 MB
header, JSON nested 1000 deep, 100,000 one-token prompts, 100,000 empty chat messages, and slow
readers (n=4, logprobs 20, 2000 tokens, reading nothing). "normal" is the slowest of the normal
requests sent during the row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from evenflow.bench.chaos_procs import Fleet, Proc, free_port, wait_healthy  # noqa: E402
from evenflow.frontend.demo_model import ensure_demo_model  # noqa: E402


async def _normal(url: str, done: asyncio.Event) -> float:
    """The slowest of normal requests sent one after another until ``done``."""
    worst = 0.0
    async with httpx.AsyncClient(timeout=120) as http:
        while not done.is_set():
            t0 = time.monotonic()
            r = await http.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
            worst = max(worst, time.monotonic() - t0 if r.status_code == 200 else float("inf"))
            await asyncio.sleep(0.3)
    return worst


def _raw(port: int, head: bytes, body: bytes = b"") -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            s.sendall(head + body)
            reply = s.recv(200)
        except OSError as e:
            return type(e).__name__
    return reply.split(b"\r\n", 1)[0].decode(errors="replace") or "closed"


async def _slowloris(port: int, n: int, seconds: float, silent: bool) -> str:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        socks.append(s)
    t0 = time.monotonic()
    closed_at: dict[int, float] = {}
    while time.monotonic() - t0 < seconds and len(closed_at) < n:
        for i, s in enumerate(socks):
            if i in closed_at:
                continue
            try:
                if not silent:
                    s.send(b"G")
                data = s.recv(200)
                if data or data == b"":
                    closed_at[i] = time.monotonic() - t0
            except BlockingIOError:
                pass
            except OSError:
                closed_at[i] = time.monotonic() - t0
        await asyncio.sleep(2.0 if not silent else 0.5)
    for s in socks:
        s.close()
    if not closed_at:
        return f"0 of {n} closed in {seconds:.0f} s"
    return f"{len(closed_at)} of {n} answered 408/closed, the last at {max(closed_at.values()):.1f} s"


async def _post_timed(url: str, path: str, body: bytes) -> str:
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=300) as http:
        r = await http.post(url + path, content=body, headers={"content-type": "application/json"})
    message = r.json().get("error", {}).get("message", "")[:60] if r.status_code != 200 else ""
    return f"{r.status_code} in {time.monotonic() - t0:.2f} s {message}".strip()


async def _slow_readers(url: str, port: int, n: int, wait_s: float, frontend: psutil.Process) -> str:
    rss0 = frontend.memory_info().rss / 2**20
    body = json.dumps({"prompt": "tell me a story", "n": 4, "logprobs": 20, "max_tokens": 2000, "stream": True,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(head + body)
        socks.append(s)  # never read
    await asyncio.sleep(wait_s)
    async with httpx.AsyncClient(timeout=30) as http:
        metrics = (await http.get(url + "/metrics")).text
    kv = next((ln.split()[-1] for ln in metrics.splitlines()
               if ln.startswith("evenflow:kv_cache_usage_perc") and 'engine="' not in ln), "?")
    rss1 = frontend.memory_info().rss / 2**20
    for s in socks:
        s.close()
    await asyncio.sleep(3)
    rss2 = frontend.memory_info().rss / 2**20
    return (f"frontend RSS {rss0:.0f} -> {rss1:.0f} MB after {wait_s:.0f} s, {rss2:.0f} MB after they closed; "
            f"KV usage {kv}")


async def run(args: argparse.Namespace) -> list[tuple[str, str, float]]:
    work = Path(tempfile.mkdtemp(prefix="evenflow-hostile-"))
    model = str(ensure_demo_model(work / "demo-model"))
    fleet = Fleet()
    address = f"ipc://{work}/engine.sock"
    engine = fleet.add(Proc("engine-core", ["-m", "evenflow.core.cli", "--model", model, "--listen", address,
                                            "--max-model-len", "2048", "--num-kv-blocks", "2048",
                                            "--max-num-batched-tokens", "256", "--worker-threads", "1"],
                            work / "engine.log"))
    port = free_port()
    front = fleet.add(Proc("frontend", ["-m", "evenflow.frontend.cli", "--engine", address, "--port", str(port),
                                        "--stuck-reader-timeout", str(args.read_wait + 30)], work / "frontend.log"))
    url = f"http://127.0.0.1:{port}"
    rows: list[tuple[str, str, float]] = []
    try:
        await asyncio.to_thread(wait_healthy, url, 180, [engine, front])
        big = b"x-big: " + b"a" * 100_000 + b"\r\n"
        many = b"".join(b"x-h%d: v\r\n" % i for i in range(10_000))
        huge = b"x-big: " + b"a" * 1_000_000 + b"\r\n"
        get = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n"
        cases = [
            ("slowloris", lambda: _slowloris(port, args.slowloris, 20, silent=False)),
            ("silent sockets", lambda: _slowloris(port, args.slowloris, 20, silent=True)),
            ("100 KB header", lambda: asyncio.to_thread(_raw, port, get + big + b"\r\n")),
            ("10,000 headers", lambda: asyncio.to_thread(_raw, port, get + many + b"\r\n")),
            ("1 MB header", lambda: asyncio.to_thread(_raw, port, get + huge + b"\r\n")),
            ("JSON nested 1000 deep", lambda: _post_timed(url, "/v1/completions", b'{"prompt":"x","structured_outputs":'
                                                          b'{"json":' + b"[" * 1000 + b"]" * 1000 + b"}}")),
            ("100,000 one-token prompts", lambda: _post_timed(url, "/v1/completions", json.dumps(
                {"prompt": [[5]] * 100_000, "max_tokens": 1}).encode())),
            ("100,000 empty chat messages", lambda: _post_timed(url, "/v1/chat/completions", json.dumps(
                {"messages": [{"role": "user", "content": ""}] * 100_000, "max_tokens": 1}).encode())),
            (f"{args.slow_readers} slow readers", lambda: _slow_readers(url, port, args.slow_readers, args.read_wait,
                                                                        psutil.Process(front.pid))),
        ]
        for name, case in cases:
            done = asyncio.Event()
            normal = asyncio.ensure_future(_normal(url, done))
            outcome = await case()
            done.set()
            worst = await normal
            rows.append((name, outcome, worst))
            print(f"{name}: {outcome}; slowest normal request meanwhile: {worst * 1000:.0f} ms", flush=True)
    finally:
        fleet.kill_leftovers()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slowloris", type=int, default=500)
    ap.add_argument("--slow-readers", type=int, default=20)
    ap.add_argument("--read-wait", type=float, default=30.0)
    args = ap.parse_args()
    rows = asyncio.run(run(args))
    print("\n| hostile client | what the server answered | slowest normal request meanwhile (ms) |\n|---|---|---|")
    for name, outcome, worst in rows:
        print(f"| {name} | {outcome} | {worst * 1000:.0f} |")


if __name__ == "__main__":
    main()
