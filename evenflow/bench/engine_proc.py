"""An engine-core process started by a benchmark (stopped by its PID) and an EngineClient on it,
with a runner that sends requests at a fixed concurrency and records each one's timings."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from evenflow.bench.server import evenflow_process_env
from evenflow.frontend.clients.engine_client import EngineClient
from evenflow.protocol import SamplingParams, SchedulerStats
from evenflow.protocol.lifeline import stop_processes


@dataclass
class RequestResult:
    token_ids: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    latency_s: float = 0.0


@dataclass
class Batch:
    seconds: float
    results: list[RequestResult]

    @property
    def output_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.results)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds


class EngineProc:
    def __init__(self, model: str, workdir: Path, name: str, flags: list[str]) -> None:
        self.address = f"ipc://{workdir}/{name}.sock"
        argv = [sys.executable, "-m", "evenflow.core.cli", "--model", model, "--listen", self.address, *flags]
        self.log = open(workdir / f"{name}.log", "wb")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=evenflow_process_env())
        self.client = EngineClient(self.address, client_name=f"bench-{name}")
        self._ids = 0

    async def start(self, timeout: float = 600) -> None:
        await self.client.connect(timeout=timeout)

    async def stats(self) -> SchedulerStats:
        result = await self.client.call_utility("get_stats")
        assert isinstance(result.result, SchedulerStats)
        return result.result

    async def run(self, requests: list[tuple[list[int], SamplingParams]], concurrency: int) -> Batch:
        gate = asyncio.Semaphore(concurrency)
        results = [RequestResult() for _ in requests]

        async def one(i: int, prompt: list[int], params: SamplingParams) -> None:
            async with gate:
                self._ids += 1
                start = time.perf_counter()
                async for out in self.client.generate(f"r{self._ids}", prompt, params):
                    if not results[i].token_ids and out.new_token_ids:
                        results[i].ttft_s = time.perf_counter() - start
                    results[i].token_ids.extend(out.new_token_ids)
                results[i].latency_s = time.perf_counter() - start

        start = time.perf_counter()
        await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(requests)))
        return Batch(time.perf_counter() - start, results)

    async def close(self) -> None:
        await self.client.close()
        stop_processes([self.proc], timeout=15)
        self.log.close()
