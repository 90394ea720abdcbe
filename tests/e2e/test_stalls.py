"""Stalls are not deaths, deaths are noticed at once: real engine-core processes paused with SIGSTOP
and killed with SIGKILL under streaming load, and the running clock both ends judge silence by."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from evenflow.frontend.clients.data_parallel import DataParallelClient
from evenflow.frontend.clients.engine_client import EngineClient, EngineError
from evenflow.frontend.clients.router import RoutingConfig
from evenflow.protocol import SamplingParams
from evenflow.protocol.liveness import RunningClock
from tests.checkpoints import reference_greedy
from tests.e2e.harness import start_engine

pytestmark = pytest.mark.slow

FLAGS = ("--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
         "--num-kv-blocks", "64", "--worker-threads", "1")
GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_running_clock_counts_a_pause_as_one_short_step() -> None:
    clock = RunningClock(max_step=0.2)
    start = clock.now()
    time.sleep(0.6)  # a pause: no observation for longer than max_step
    paused = clock.now() - start
    assert 0.19 < paused <= 0.2 + 1e-6 and clock.paused_s >= 0.39
    for _ in range(6):  # a loop that observes often counts real time
        time.sleep(0.05)
        clock.now()
    assert clock.now() - start >= paused + 0.29


def test_engine_core_paused_past_its_client_timeout_loses_no_stream(tiny_llama: Path, tmp_path: Path) -> None:
    # --client-timeout 2 and a 4 s SIGSTOP: on waking the engine must not count its own pause as
    # the client's silence (it used to drop the client and abort every stream).
    engine = start_engine(tiny_llama, tmp_path, *FLAGS, "--client-timeout", "2")
    # Before the loop runs: a blocked loop sends no heartbeats, a real silence the engine would judge.
    references = [reference_greedy(tiny_llama, [5 + i, 9, 2], 120) for i in range(4)]

    async def stream(client: EngineClient, i: int, started: asyncio.Event) -> list[int]:
        tokens: list[int] = []
        async for out in client.generate(f"s{i}", [5 + i, 9, 2], SamplingParams(max_tokens=120, **GREEDY)):
            tokens += out.new_token_ids
            started.set()
            await asyncio.sleep(0.02)  # a steady reader, so the streams outlast the pause
        return tokens

    async def main() -> None:
        client = EngineClient(engine.address, "paused-engine")
        await client.connect(timeout=30)
        started = asyncio.Event()
        tasks = [asyncio.ensure_future(stream(client, i, started)) for i in range(4)]
        await started.wait()
        os.kill(engine.proc.pid, signal.SIGSTOP)
        await asyncio.sleep(4.0)
        os.kill(engine.proc.pid, signal.SIGCONT)
        assert await asyncio.gather(*tasks) == references
        assert client.connected and client.rehellos == 0
        await client.close()

    try:
        asyncio.run(main())
        assert "paused-engine) gone: silent" not in engine.log()
    finally:
        os.kill(engine.proc.pid, signal.SIGCONT)
        engine.stop()


def test_a_stream_failed_past_the_engine_timeout_is_aborted_when_the_engine_core_wakes(tiny_llama: Path,
                                                                                      tmp_path: Path) -> None:
    # The client cannot tell a pause past --engine-timeout from a hang: it fails the stream. The paused
    # engine-core, woken, must not run that request on to its max_tokens for nobody (it used to: all
    # 200 tokens, its seat and KV held); the client aborts what it hears of it, and serves on.
    engine = start_engine(tiny_llama, tmp_path, *FLAGS)
    reference = reference_greedy(tiny_llama, [6, 2, 8], 12)

    async def main() -> None:
        client = EngineClient(engine.address, "impatient", engine_timeout=1.0)
        await client.connect(timeout=30)
        got, paused = 0, False
        with pytest.raises(EngineError) as info:
            async for out in client.generate("orphan", [5, 9, 2], SamplingParams(max_tokens=200, **GREEDY)):
                got += len(out.new_token_ids)
                if got >= 5 and not paused:
                    paused = True
                    os.kill(engine.proc.pid, signal.SIGSTOP)
                    asyncio.get_running_loop().call_later(3.0, os.kill, engine.proc.pid, signal.SIGCONT)
        assert info.value.code == "engine_dead"
        deadline = time.monotonic() + 30
        while not client.connected and time.monotonic() < deadline:  # it answers again once woken
            await asyncio.sleep(0.05)
        tokens: list[int] = []
        async for out in client.generate("after", [6, 2, 8], SamplingParams(max_tokens=12, **GREEDY)):
            tokens += out.new_token_ids
        assert tokens == reference
        stats = (await client.call_utility("get_stats")).result.scheduler
        assert stats.num_running == 0 and stats.num_generation_tokens < 200 // 2, stats
        await client.close()

    try:
        asyncio.run(main())
    finally:
        os.kill(engine.proc.pid, signal.SIGCONT)
        engine.stop()


def test_killed_engine_core_is_noticed_in_milliseconds(tiny_llama: Path, tmp_path: Path) -> None:
    engine = start_engine(tiny_llama, tmp_path, *FLAGS)

    async def main() -> None:
        client = EngineClient(engine.address, "survivor")  # --engine-timeout stays at its 30 s default
        await client.connect(timeout=30)
        killed_at = 0.0
        with pytest.raises(EngineError) as info:
            async for _ in client.generate("doomed", [3, 1, 4], SamplingParams(max_tokens=480, **GREEDY)):
                if not killed_at:
                    engine.proc.send_signal(signal.SIGKILL)
                    killed_at = time.monotonic()
        noticed = time.monotonic() - killed_at
        assert info.value.code == "engine_dead" and "closed its connection" in info.value.message
        assert noticed < 1.0, noticed  # the disconnect event, not the silence timeout
        assert not client.connected
        await client.close()

    try:
        asyncio.run(main())
    finally:
        engine.stop()


def test_data_parallel_kill_resends_requests_without_output_to_the_other_engine(tiny_llama: Path,
                                                                                tmp_path: Path) -> None:
    # One request runs per engine-core; the others wait there without output when one is killed.
    flags = (*FLAGS[:2], "--max-num-seqs", "1", *FLAGS[4:])
    engines = [start_engine(tiny_llama, tmp_path, *flags, name=f"engine{i}") for i in range(2)]
    prompts = [[7 + i, 3, 5] for i in range(6)]
    references = [reference_greedy(tiny_llama, p, 100) for p in prompts]
    first_output: asyncio.Queue[str] = asyncio.Queue()

    async def run(client: DataParallelClient, i: int) -> list[int] | EngineError:
        tokens: list[int] = []
        try:
            async for out in client.generate(f"r{i}", prompts[i], SamplingParams(max_tokens=100, **GREEDY)):
                if not tokens:
                    first_output.put_nowait(f"r{i}")
                tokens += out.new_token_ids
        except EngineError as e:
            return e
        return tokens

    async def main() -> None:
        client = DataParallelClient([e.address for e in engines], "dp-kill", RoutingConfig("round_robin"))
        await client.connect(timeout=30)
        tasks = [asyncio.ensure_future(run(client, i)) for i in range(6)]
        victim = client._owner[await first_output.get()]  # its other two requests wait, without output
        on_victim = {rid for rid, e in client._owner.items() if e == victim}
        engines[victim].proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        while client.clients[victim].connected:
            await asyncio.sleep(0.001)
        left_routing_s = time.monotonic() - killed_at
        results = await asyncio.gather(*tasks)
        lost = [i for i, r in enumerate(results) if isinstance(r, EngineError)]
        # Only the victim's streaming request can fail; everything without output succeeded elsewhere.
        assert len(lost) <= 1 and all(f"r{i}" in on_victim for i in lost), results
        for i, r in enumerate(results):
            if i not in lost:
                assert r == references[i]
        assert client.resent >= 1 and left_routing_s < 0.5, (client.resent, left_routing_s)
        await client.close()

    try:
        asyncio.run(main())
    finally:
        for e in engines:
            e.stop()


def test_paused_worker_is_a_slow_step_then_past_the_step_timeout_a_hang(tiny_llama: Path, tmp_path: Path) -> None:
    engine = start_engine(tiny_llama, tmp_path, *FLAGS, "--step-timeout", "4")
    worker = engine.worker_pids[0]
    reference = reference_greedy(tiny_llama, [4, 4, 2], 60)

    async def main() -> None:
        client = EngineClient(engine.address, "watched")
        await client.connect(timeout=30)
        tokens: list[int] = []
        async for out in client.generate("slow", [4, 4, 2], SamplingParams(max_tokens=60, **GREEDY)):
            if len(tokens) == 10:
                os.kill(worker, signal.SIGSTOP)  # 2 s: a slow step, under the limit
                await asyncio.sleep(2.0)
                os.kill(worker, signal.SIGCONT)
            tokens += out.new_token_ids
        assert tokens == reference
        with pytest.raises(EngineError) as info:
            async for _ in client.generate("hung", [4, 4, 2], SamplingParams(max_tokens=400, **GREEDY)):
                os.kill(worker, signal.SIGSTOP)  # for good: past --step-timeout
        assert info.value.code == "worker_died" and "--step-timeout 4 s" in info.value.message
        await client.close()

    try:
        asyncio.run(main())
        assert engine.proc.wait(30) == 1
        log = engine.log()
        assert "predicted" in log and "tokens of 1 requests" in log  # the slow step, with its shape
    finally:
        engine.stop()
