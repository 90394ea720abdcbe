"""Data parallel with real processes: one frontend client, two engine-cores. Prefix affinity, greedy
outputs equal to transformers, aborts reaching the right engine, per-engine stats, and an
engine-core killed (only its requests fail, new ones go to the other) and restarted (it rejoins)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from evenflow.frontend.clients import connection as client_module  # its timing constants
from evenflow.frontend.clients.engine_client import EngineError
from evenflow.frontend.clients.data_parallel import DataParallelClient
from evenflow.frontend.clients.router import RoutingConfig
from evenflow.frontend.metrics import FrontendMetrics
from evenflow.protocol import SamplingParams
from tests.checkpoints import reference_greedy
from tests.e2e.harness import EngineProcess, start_engine

pytestmark = pytest.mark.slow

FLAGS = ("--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
         "--num-kv-blocks", "64", "--worker-threads", "1", "--block-size", "16")
GREEDY = dict(temperature=0.0, ignore_eos=True)


async def _collect(client: DataParallelClient, rid: str, prompt: list[int], sp: SamplingParams) -> tuple[list[int], int]:
    tokens, cached = [], 0
    async for out in client.generate(rid, prompt, sp):
        tokens += out.new_token_ids
        cached = max(cached, out.num_cached_tokens)
    return tokens, cached


def test_two_engine_cores_behind_one_client(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "DEAD_AFTER_S", 2.0)
    monkeypatch.setattr(client_module, "HEARTBEAT_S", 0.5)
    monkeypatch.setattr(client_module, "RECONNECT_MAX_S", 1.0)  # rejoin soon after the restart
    engines: list[EngineProcess] = [start_engine(tiny_llama, tmp_path, *FLAGS, name=f"engine{i}") for i in range(2)]

    async def main() -> None:
        client = DataParallelClient([e.address for e in engines], "dp-test", RoutingConfig("prefix"))
        await client.connect(timeout=30)
        system = list(range(3, 51))  # three full blocks shared by two conversations
        first, cached = await _collect(client, "a", system + [7, 8], SamplingParams(max_tokens=6, **GREEDY))
        assert first == reference_greedy(tiny_llama, system + [7, 8], 6) and cached == 0
        await asyncio.sleep(0.3)  # the engine's stored-blocks report arrives (also routed-there alone suffices)
        second, cached = await _collect(client, "b", system + [9, 9, 9], SamplingParams(max_tokens=6, **GREEDY))
        assert second == reference_greedy(tiny_llama, system + [9, 9, 9], 6)
        assert cached == 48 and client.decisions.get("prefix") == 1  # followed the cache to the same engine

        # Two concurrent new prompts spread over both engines; an abort reaches the right one.
        long = SamplingParams(max_tokens=400, **GREEDY)
        streams = [client.generate(f"long{i}", [100 + i] * 5, long) for i in range(2)]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams))
        assert all(f.new_token_ids for f in firsts)
        assert sorted(client._owner.values()) == [0, 1]
        await client.abort(["long0"])
        reasons = [out.finish_reason async for out in streams[0]]
        assert reasons[-1] == "abort"

        stats = await client.call_utility("get_stats")
        per_engine = client.engine_stats()
        assert set(per_engine) == {"0", "1"}
        generated = stats.result.scheduler.num_generation_tokens
        assert generated == sum(s.scheduler.num_generation_tokens for s in per_engine.values())
        metrics = FrontendMetrics("m")
        metrics.set_engine_stats(stats.result, per_engine=per_engine)
        assert 'evenflow:prefix_cache_hits_total{engine="0",model_name="m"}' in metrics.render()  # labels sorted

        # Kill the engine serving long1: only that request fails; new requests go to the other.
        doomed = client._owner["long1"]
        engines[doomed].proc.send_signal(signal.SIGKILL)
        with pytest.raises(EngineError) as info:
            async for _ in streams[1]:
                pass
        assert info.value.code == "engine_dead" and engines[doomed].address in info.value.message
        for i in range(3):
            tokens, _ = await _collect(client, f"after{i}", [1, 5, 9 + i], SamplingParams(max_tokens=4, **GREEDY))
            assert tokens == reference_greedy(tiny_llama, [1, 5, 9 + i], 4)
        assert client.connected

        # Restart it on the same address: it rejoins and takes requests again (the killed one reaped first,
        # its workers with it).
        await asyncio.to_thread(engines[doomed].stop)
        engines[doomed] = await asyncio.to_thread(start_engine, tiny_llama, tmp_path, *FLAGS, name=f"engine{doomed}")
        deadline = time.monotonic() + 15
        while not client.clients[doomed].connected:
            assert time.monotonic() < deadline, "the restarted engine-core did not rejoin"
            await asyncio.sleep(0.1)
        streams = [client.generate(f"again{i}", [200 + i] * 5, SamplingParams(max_tokens=4, **GREEDY))
                   for i in range(2)]
        await asyncio.gather(*(s.__anext__() for s in streams))
        assert sorted(client._owner.values()) == [0, 1]
        for s in streams:
            await s.aclose()
        await client.close()

    try:
        asyncio.run(main())
    finally:
        for eng in engines:
            eng.stop()
