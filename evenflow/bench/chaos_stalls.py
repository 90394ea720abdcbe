"""The stall matrix of a chaos run: SIGSTOP of the engine-core, a worker and a frontend for each of
several durations under streaming load, SIGCONT, and what it cost.

Two frontends serve one engine-core; streams go to frontend 0 (the one paused in the frontend
rows) and to frontend 1; /health of the frontend that keeps running is probed every 100 ms during
each pause. A row counts the streams that failed (an error event, a cut stream, a non-200) and the
slowest /health answer. Stalls below the configured limits (--client-timeout, --engine-timeout,
--step-timeout: 30, 30 and 600 s by default) must lose nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from evenflow.bench.chaos_procs import Fleet, Proc, free_port, wait_healthy

TARGETS = ("engine-core", "worker", "frontend")


@dataclass
class StallRow:
    target: str
    seconds: float
    streams: int
    failed: int
    health_max_ms: float
    health_non_200: int


async def _stream(http: httpx.AsyncClient, url: str, max_tokens: int) -> bool:
    body = {"prompt": "count with me: one two three", "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    try:
        async with http.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                return False
            events = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
    except httpx.HTTPError:
        return False
    if len(events) < 2 or events[-1] != "[DONE]":
        return False
    last = json.loads(events[-2])
    return "error" not in last and last["choices"][0].get("finish_reason") == "length"


async def _probe(http: httpx.AsyncClient, url: str, until: float) -> tuple[float, int]:
    worst, bad = 0.0, 0
    while time.monotonic() < until:
        t0 = time.monotonic()
        try:
            ok = (await http.get(url + "/health", timeout=5)).status_code == 200
        except httpx.HTTPError:
            ok = False
        worst = max(worst, time.monotonic() - t0)
        bad += not ok
        await asyncio.sleep(0.1)
    return worst * 1000, bad


async def _one(target: str, seconds: float, pids: dict[str, int], urls: list[str], streams: int) -> StallRow:
    async with httpx.AsyncClient() as http:
        tasks = [asyncio.ensure_future(_stream(http, urls[i % 2], 60 + 40 * int(seconds))) for i in range(streams)]
        await asyncio.sleep(1.0)
        os.kill(pids[target], signal.SIGSTOP)
        try:
            health = await _probe(http, urls[1], time.monotonic() + seconds)
        finally:
            os.kill(pids[target], signal.SIGCONT)
        results = await asyncio.gather(*tasks)
    return StallRow(target, seconds, streams, results.count(False), *health)


def stall_matrix(model: str, work: Path, engine_flags: list[str], durations: list[float],
                 streams: int = 6) -> list[StallRow]:
    fleet = Fleet()  # add() starts each process
    address = f"ipc://{work}/stall-engine.sock"
    engine = fleet.add(Proc("engine-core", ["-m", "evenflow.core.cli", "--model", model, "--listen", address,
                                            *engine_flags], work / "stall-engine.log"))
    ports = [free_port(), free_port()]
    frontends = [fleet.add(Proc(f"frontend-{i}", ["-m", "evenflow.frontend.cli", "--engine", address, "--port",
                                                  str(port), "--no-log-stats"], work / f"stall-frontend-{i}.log"))
                 for i, port in enumerate(ports)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url in urls:
            wait_healthy(url, 180, [engine, *frontends])
        worker = psutil.Process(engine.pid).children(recursive=True)[0].pid
        pids = {"engine-core": engine.pid, "worker": worker, "frontend": frontends[0].pid}
        rows = []
        for seconds in durations:
            for target in TARGETS:
                rows.append(asyncio.run(_one(target, seconds, pids, urls, streams)))
                print(f"stall {target} {seconds:g} s: {rows[-1].failed} of {streams} streams failed, /health max "
                      f"{rows[-1].health_max_ms:.0f} ms", flush=True)
        return rows
    finally:
        for p in (*frontends, engine):
            if p.alive():
                os.kill(p.pid, signal.SIGCONT)
            p.stop()


def render_stalls(rows: list[StallRow]) -> str:
    out = ["| paused | for (s) | streams | failed | /health of the running frontend: slowest (ms) | non-200 |",
           "|---|---|---|---|---|---|"]
    out += [f"| {r.target} | {r.seconds:g} | {r.streams} | {r.failed} | {r.health_max_ms:.0f} | {r.health_non_200} |"
            for r in rows]
    return "\n".join(out)
