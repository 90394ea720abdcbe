"""Drive one workload against one server: warm up, send on schedule, drain, collect, scrape.

Bounded in time: arrivals stop at ``duration_s``; whatever still streams ``drain_timeout_s`` later
is cancelled and counted as failed. Steady streams restart only while the arrival window is open.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from evenflow.bench.client import CompletionClient, RequestRecord, fetch_model_info
from evenflow.bench.metrics import EngineNumbers, MetricsWatcher
from evenflow.bench.stats import SLO, RunStats, run_stats
from evenflow.bench.workload import PlannedRequest, PromptMaker, Workload

WARMUP_PROMPT_LEN = 32
WARMUP_OUTPUT_LEN = 4

Send = Callable[[list[int], int, str], Awaitable[None]]  # (prompt ids, output length, kind)


@dataclass
class RunOptions:
    """How to run a workload (not what it is)."""

    base_url: str
    model: str | None = None  # None: the first id at /v1/models
    slo: SLO = field(default_factory=SLO)
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 60.0
    warmup_requests: int = 2
    metrics_interval_s: float = 1.0
    progress: bool = True


@dataclass
class BenchResult:
    """One run: its statistics, the engine's own numbers, and (optionally kept) every record."""

    workload: str
    base_url: str
    model: str
    stats: RunStats
    engine: EngineNumbers
    records: list[RequestRecord]
    started_unix_s: float = 0.0  # wall clock at the records' time 0: ties them to an engine's trace


class Progress:
    """A one-line progress bar on stderr (a line every 10 s when stderr is not a terminal)."""

    def __init__(self, duration_s: float, enabled: bool) -> None:
        self._duration_s = duration_s
        self._enabled = enabled
        self._tty = sys.stderr.isatty()
        self._last = 0.0
        self.done = self.failed = self.inflight = 0

    def show(self, elapsed_s: float, final: bool = False) -> None:
        if not self._enabled:
            return
        if not final and elapsed_s - self._last < (0.5 if self._tty else 10.0):
            return
        self._last = elapsed_s
        frac = min(1.0, elapsed_s / self._duration_s) if self._duration_s > 0 else 1.0
        bar = "#" * int(frac * 30)
        line = f"[{bar:<30}] {elapsed_s:6.1f}s  done {self.done}  failed {self.failed}  in flight {self.inflight}"
        end = "\n" if (final or not self._tty) else ""
        sys.stderr.write(("\r" if self._tty else "") + line + end)
        sys.stderr.flush()


async def _warmup(client: CompletionClient, count: int, vocab_size: int, seed: int) -> None:
    """A few short requests so one-time costs (compilation, first allocations) stay out of the run."""
    maker = PromptMaker(vocab_size, seed + 1_000_003)
    t0 = time.perf_counter()
    recs = await asyncio.gather(
        *(client.complete(maker.ids(WARMUP_PROMPT_LEN), WARMUP_OUTPUT_LEN, "warmup", t0) for _ in range(count))
    )
    bad = [r.error for r in recs if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up requests failed: {bad[0]}")


async def run_workload(workload: Workload, opts: RunOptions) -> BenchResult:
    """Run ``workload`` against ``opts.base_url`` and return its statistics."""
    model = opts.model or (await fetch_model_info(opts.base_url)).id
    progress = Progress(workload.duration_s, opts.progress)
    records: list[RequestRecord] = []
    async with CompletionClient(opts.base_url, model, opts.request_timeout_s) as client:
        if opts.warmup_requests:
            await _warmup(client, opts.warmup_requests, workload.vocab_size, workload.seed)
        watcher = MetricsWatcher(opts.base_url, opts.metrics_interval_s)
        await watcher.start()
        t0, started_unix_s = time.perf_counter(), time.time()

        async def send(prompt_ids: list[int], output_len: int, kind: str) -> None:
            progress.inflight += 1
            rec = await client.complete(prompt_ids, output_len, kind, t0)
            progress.inflight -= 1
            progress.done += rec.ok
            progress.failed += not rec.ok
            records.append(rec)

        senders = [asyncio.create_task(_send_schedule(workload, send, t0))]
        if workload.steady is not None:
            spec = workload.steady
            for i in range(spec.count):
                maker = PromptMaker(workload.vocab_size, workload.seed * 7919 + i + 1)
                stream = _steady_stream(maker, spec.prompt_len, spec.output_len, send, t0, workload.duration_s)
                senders.append(asyncio.create_task(stream))
        deadline = t0 + workload.duration_s + opts.drain_timeout_s
        pending = set(senders)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=0.25)
            progress.show(time.perf_counter() - t0)
            if time.perf_counter() > deadline:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                break
        progress.show(time.perf_counter() - t0, final=True)
        engine = await watcher.stop()
    return BenchResult(workload.name, opts.base_url, model, run_stats(records, opts.slo), engine, records,
                       started_unix_s)


async def _send_schedule(workload: Workload, send: Send, t0: float) -> None:
    """Send each planned request at its arrival time; wait for all of them to finish."""
    maker = PromptMaker(workload.vocab_size, workload.seed)
    prefix = maker.ids(workload.shared_prefix_len) if workload.shared_prefix_len else []
    inflight: list[asyncio.Task[None]] = []
    try:
        for planned in workload.schedule:
            delay = t0 + planned.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            inflight.append(asyncio.create_task(send(_prompt(maker, prefix, planned), planned.output_len, planned.kind)))
        await asyncio.gather(*inflight)
    finally:
        # Cancelled at the drain deadline: pass it on to the requests still streaming.
        for task in inflight:
            task.cancel()
        await asyncio.gather(*inflight, return_exceptions=True)


def _prompt(maker: PromptMaker, prefix: list[int], planned: PlannedRequest) -> list[int]:
    return prefix + maker.ids(max(1, planned.prompt_len - len(prefix)))


async def _steady_stream(
    maker: PromptMaker, prompt_len: int, output_len: int, send: Send, t0: float, duration_s: float
) -> None:
    """Keep one stream decoding: a new request as soon as the last ends, while the window is open."""
    while time.perf_counter() - t0 < duration_s:
        await send(maker.ids(prompt_len), output_len, "steady")
