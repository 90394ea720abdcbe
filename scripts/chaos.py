"""Chaos run: steady mixed load on evenflow while faults are injected on a schedule; prints the ledger.

    python scripts/chaos.py --duration 600            # the 10-minute proof (loopback only)
    python scripts/chaos.py --duration 40 --quick     # the short version the test suite runs
    python scripts/chaos.py --stalls 1,4,8,20         # only the stall matrix (evenflow/bench/chaos_stalls.py)

Two phases share the duration. "parts" (70%): one engine-core and --frontends evenflow-frontends,
each on its own port; every --fault-every seconds the next fault of FAULTS strikes while the load
goes on: a frontend SIGKILLed (a new one starts in its place), a burst far above capacity, malformed
HTTP bodies and wire frames at a high rate, a worker SIGKILLed, the worker forward raising (the
test-only hook), the engine-core SIGKILLed; the run restarts the engine-core whenever it exits. The
KV cache is kept small, so bursts and long prompts force preemption storms, and greedy probes
must equal their idle outputs. "serve" (30%): `evenflow serve` with 2 frontends under the same load,
disconnects, a burst and malformed bodies, then its launcher is SIGKILLed: no child may linger.
Clients leave 10% of streams mid-way throughout. Every request ends exactly once (completed,
refused 503, errored with a reason, or left by its client); "lost" is any other end.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

from evenflow.bench.chaos_load import (
    Ledger, burst, client_loop, malformed_http, malformed_wire, metric_value, prober, record_probe_references,
)
from evenflow.bench.chaos_procs import Fleet, Proc, children_of, free_port, listening, wait_healthy
from evenflow.bench.chaos_report import fault_itl, render
from evenflow.protocol.lifeline import RUNTIME_DIR_ENV, runtime_dir

FAULTS = ["worker_kill", "frontend_kill", "forward_fault", "burst", "engine_kill", "malformed"]
FAULT_ENV = "EVENFLOW_TEST_FAIL_FORWARD_AFTER_STEPS"


def engine_flags(args: argparse.Namespace) -> list[str]:
    return ["--served-model-name", "demo", "--max-model-len", "1024", "--max-num-seqs", "16",
            "--max-num-batched-tokens", "128", "--num-kv-blocks", str(args.num_kv_blocks), "--worker-threads", "1",
            "--max-num-queued-reqs", str(args.max_num_queued_reqs), "--request-timeout", "60", *args.engine_args.split()]


class PartsRun:
    """engine-core + N frontends as separate processes, faults on a schedule."""

    def __init__(self, args: argparse.Namespace, model: str, work: Path, fleet: Fleet, ledger: Ledger) -> None:
        self.args, self.model, self.work, self.fleet, self.ledger = args, model, work, fleet, ledger
        self.address = f"ipc://{work}/engine.sock"
        self.ports = [free_port() for _ in range(args.frontends)]
        self.frontends: list[Proc | None] = [None] * args.frontends
        self.engine: Proc | None = None
        self.engine_exits: list[tuple[str, int | None]] = []
        self.faults: list[tuple[str, float]] = []
        self.side_loads: list[asyncio.Future] = []  # bursts and malformed floods run beside the schedule

    def urls(self) -> list[str]:
        """Frontends that are up and listening (a restarted one opens its port once it reached the engine)."""
        live = [f"http://127.0.0.1:{p}" for p, f in zip(self.ports, self.frontends) if f is not None and f.ready]
        return live or [f"http://127.0.0.1:{self.ports[0]}"]

    def start_engine(self, fault_after: int | None = None) -> None:
        env = {FAULT_ENV: str(fault_after)} if fault_after is not None else None
        self.engine = self.fleet.add(Proc("engine-core", ["-m", "evenflow.core.cli", "--model", self.model,
                                                          "--listen", self.address, *engine_flags(self.args)],
                                          self.work / "engine.log", env))

    def start_frontend(self, i: int) -> None:
        self.frontends[i] = self.fleet.add(Proc(f"frontend-{i}", [
            "-m", "evenflow.frontend.cli", "--engine", self.address, "--port", str(self.ports[i]),
            "--frontend-name", f"frontend-{i}", "--no-log-stats"], self.work / f"frontend-{i}.log"))

    async def supervise(self, stop_at: float) -> None:
        """Restart the engine-core whenever it exits (as Restart=on-failure would)."""
        while time.monotonic() < stop_at + 5:
            eng = self.engine
            if eng is not None and not eng.alive():
                code = eng.popen.returncode if eng.popen else None
                self.engine_exits.append((self.faults[-1][0] if self.faults else "?", code))
                self.start_engine()
            for i, f in enumerate(self.frontends):
                if f is not None and not f.alive():
                    self.start_frontend(i)
                elif f is not None and not f.ready:
                    f.ready = listening(self.ports[i])
            self.fleet.sample()
            await asyncio.sleep(0.5)

    async def strike(self, fault: str, seed: int) -> None:
        self.faults.append((fault, time.monotonic()))
        print(f"[chaos] {time.strftime('%H:%M:%S')} fault: {fault}", flush=True)
        if fault == "frontend_kill":
            victim = self.frontends[seed % len(self.frontends)]
            if victim is not None:
                victim.signal(signal.SIGKILL)  # the supervisor starts a new one on its port
        elif fault == "burst":
            self.side_loads.append(asyncio.ensure_future(burst(self.urls(), self.args.burst, self.ledger, seed)))
        elif fault == "malformed":
            self.side_loads += [asyncio.ensure_future(malformed_http(self.urls(), 5.0, self.ledger)),
                                asyncio.ensure_future(malformed_wire(self.address, 5.0, self.ledger))]
        elif fault == "worker_kill":
            for pid in children_of(self.engine) if self.engine is not None else []:
                os.kill(pid, signal.SIGKILL)
        elif fault == "forward_fault":
            self.side_loads.append(asyncio.ensure_future(self._restart_with_forward_fault()))
        elif fault == "engine_kill" and self.engine is not None:
            self.engine.signal(signal.SIGKILL)

    async def _restart_with_forward_fault(self) -> None:
        old, self.engine = self.engine, None  # the supervisor must not restart it without the fault
        if old is not None:
            await asyncio.to_thread(old.stop)
        self.start_engine(fault_after=self.args.fault_steps)

    async def run(self, seconds: float) -> None:
        self.start_engine()
        for i in range(len(self.frontends)):
            self.start_frontend(i)
        for port, f in zip(self.ports, self.frontends):
            await asyncio.to_thread(wait_healthy, f"http://127.0.0.1:{port}", 180,
                                    [p for p in self.fleet.procs if p.alive()])
            assert f is not None
            f.ready = True
        await record_probe_references(self.urls()[0], self.ledger)
        stop_at = time.monotonic() + seconds
        tasks = [asyncio.ensure_future(self.supervise(stop_at)),
                 asyncio.ensure_future(prober(self.urls, stop_at, self.ledger))]
        tasks += [asyncio.ensure_future(client_loop(s, self.urls, stop_at, self.ledger)) for s in range(self.args.clients)]
        n = 0
        while time.monotonic() + self.args.fault_every / 2 < stop_at:
            await asyncio.sleep(self.args.fault_every / 2)
            await self.strike(FAULTS[n % len(FAULTS)], n)
            n += 1
            await asyncio.sleep(max(0.0, min(self.args.fault_every / 2, stop_at - time.monotonic())))
        await asyncio.gather(*tasks[1:], *self.side_loads)
        tasks[0].cancel()
        await asyncio.gather(tasks[0], return_exceptions=True)
        if self.engine is None or not self.engine.alive():
            self.start_engine()
        await asyncio.to_thread(wait_healthy, self.urls()[0], 120, [])


class ServeRun:
    """`evenflow serve` with 2 frontends; its launcher is SIGKILLed at the end."""

    def __init__(self, args: argparse.Namespace, model: str, work: Path, fleet: Fleet, ledger: Ledger) -> None:
        self.args, self.model, self.work, self.fleet, self.ledger = args, model, work, fleet, ledger
        self.url = f"http://127.0.0.1:{free_port()}"
        self.serve: Proc | None = None
        self.faults: list[tuple[str, float]] = []

    async def run(self, seconds: float) -> None:
        port = self.url.rsplit(":", 1)[1]
        self.serve = self.fleet.add(Proc("serve", ["-m", "evenflow.frontend", "serve", "--model", self.model,
                                                   "--port", port, "--frontends", "2", *engine_flags(self.args)],
                                         self.work / "serve.log"))
        await asyncio.to_thread(wait_healthy, self.url, 180, [self.serve])
        if not self.ledger.probe_ref:
            await record_probe_references(self.url, self.ledger)
        stop_at = time.monotonic() + seconds
        urls = lambda: [self.url]  # noqa: E731
        tasks = [asyncio.ensure_future(prober(urls, stop_at, self.ledger))]
        tasks += [asyncio.ensure_future(client_loop(100 + s, urls, stop_at, self.ledger)) for s in range(self.args.clients)]
        for i, fault in enumerate(["burst", "malformed"]):
            await asyncio.sleep(max(0.0, min(seconds / 3, stop_at - time.monotonic() - 2)))
            self.faults.append((f"serve_{fault}", time.monotonic()))
            print(f"[chaos] {time.strftime('%H:%M:%S')} fault: serve_{fault}", flush=True)
            if fault == "burst":
                await burst([self.url], self.args.burst, self.ledger, 1000 + i)
            else:
                await malformed_http([self.url], 5.0, self.ledger)
        while time.monotonic() < stop_at:
            self.fleet.sample()
            await asyncio.sleep(0.5)
        await asyncio.gather(*tasks)


async def quiesce(url: str, num_blocks: int) -> int:
    """After the load: wait until nothing runs or waits, then count KV blocks still held (leaked)."""
    deadline = time.monotonic() + 30
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            text = (await http.get(url + "/metrics")).text
            busy = metric_value(text, "evenflow:num_requests_running") + metric_value(text, "evenflow:num_requests_waiting")
            if busy == 0 or time.monotonic() > deadline:
                await asyncio.sleep(2.5)  # one more stats refresh
                text = (await http.get(url + "/metrics")).text
                return int(round(metric_value(text, "evenflow:kv_cache_usage_perc") * num_blocks))
            await asyncio.sleep(0.5)


async def main_async(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="evenflow-chaos-", dir=runtime_dir()))
    os.environ[RUNTIME_DIR_ENV] = str(work)  # serve's folder and killed engines' sockets stay with the run's logs
    model = args.model
    if model is None:
        from evenflow.frontend.demo_model import ensure_demo_model

        model = str(ensure_demo_model(work / "demo-model"))
    fleet, ledger = Fleet(), Ledger()
    parts = PartsRun(args, model, work, fleet, ledger)
    serve = ServeRun(args, model, work, fleet, ledger)
    leaked: dict[str, int] = {}
    t0 = time.monotonic()
    try:
        await parts.run(args.duration * 0.7)
        leaked["parts"] = await quiesce(parts.urls()[0], args.num_kv_blocks)
        fleet.sample()
        for f in parts.frontends:
            if f is not None:
                await asyncio.to_thread(f.stop)
        if parts.engine is not None:
            await asyncio.to_thread(parts.engine.stop)
        await serve.run(args.duration * 0.3)
        leaked["serve"] = await quiesce(serve.url, args.num_kv_blocks)
        fleet.sample()
        assert serve.serve is not None
        serve.serve.signal(signal.SIGKILL)  # the launcher dies: its children must follow
        orphans = await asyncio.to_thread(fleet.orphans)
    finally:
        fleet.kill_leftovers()
    itl = fault_itl(ledger.streams, parts.faults + serve.faults, window_s=min(10.0, args.fault_every))
    print(render(ledger, leaked, orphans, fleet, itl, parts.engine_exits, time.monotonic() - t0, args))
    bad = ledger.lost + ledger.duplicated + sum(leaked.values()) + len(orphans) + ledger.probe_mismatch
    bad += sum(v for k, v in ledger.malformed_http.items() if k.startswith("bad"))
    return 1 if bad else 0


def stalls_main(args: argparse.Namespace) -> int:
    from evenflow.bench.chaos_stalls import render_stalls, stall_matrix

    work = Path(tempfile.mkdtemp(prefix="evenflow-stalls-", dir=runtime_dir()))
    os.environ[RUNTIME_DIR_ENV] = str(work)
    model = args.model
    if model is None:
        from evenflow.frontend.demo_model import ensure_demo_model

        model = str(ensure_demo_model(work / "demo-model"))
    flags = ["--served-model-name", "demo", "--max-model-len", "2048", "--max-num-seqs", "16",
             "--max-num-batched-tokens", "128", "--num-kv-blocks", "512", "--worker-threads", "1", *args.engine_args.split()]
    rows = stall_matrix(model, work, flags, [float(x) for x in args.stalls.split(",")])
    print(render_stalls(rows))
    return 1 if any(r.failed or r.health_non_200 for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load in all (both phases)")
    p.add_argument("--model", default=None, help="model folder (default: the demo model, written to a temp dir)")
    p.add_argument("--frontends", type=int, default=3)
    p.add_argument("--clients", type=int, default=12, help="concurrent client loops")
    p.add_argument("--fault-every", type=float, default=30.0, help="seconds between faults")
    p.add_argument("--burst", type=int, default=96, help="requests in one burst")
    p.add_argument("--num-kv-blocks", type=int, default=160, help="small on purpose: preemption storms")
    p.add_argument("--max-num-queued-reqs", type=int, default=48)
    p.add_argument("--fault-steps", type=int, default=150, help="forward_fault: steps before the forward raises")
    p.add_argument("--quick", action="store_true", help="short-run settings (the suite): faults every 3 s")
    p.add_argument("--engine-args", default="", help="more engine-core flags, one string (e.g. '--target-itl-ms 20')")
    p.add_argument("--stalls", default=None,
                   help="comma-separated seconds: run only the stall matrix (SIGSTOP of the engine-core, a worker and "
                        "a frontend for each duration under streaming load) and print its table")
    args = p.parse_args(argv)
    if args.stalls:
        return stalls_main(args)
    if args.quick:
        args.fault_every, args.clients, args.burst, args.frontends, args.fault_steps = 3.0, 6, 48, 2, 20
    if args.duration <= 0 or not math.isfinite(args.duration):
        p.error("--duration must be positive")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
