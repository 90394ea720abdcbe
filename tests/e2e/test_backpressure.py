"""Backpressure with a real engine-core: a reader that stops reading makes the engine hold its
request (nothing more is generated, the buffer stays bounded), reading again resumes it with the
same greedy tokens; a reader stuck past the timeout has its request aborted and its KV freed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from evenflow.frontend.clients.backpressure import HOLD_AFTER
from evenflow.frontend.clients.engine_client import EngineClient, EngineError
from evenflow.protocol import SamplingParams
from tests.checkpoints import reference_greedy
from tests.e2e.harness import start_engine

pytestmark = pytest.mark.slow

FLAGS = ("--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
         "--num-kv-blocks", "64", "--worker-threads", "1")
GREEDY = dict(temperature=0.0, ignore_eos=True)


async def _stats(client: EngineClient):  # type: ignore[no-untyped-def]
    return (await client.call_utility("get_stats")).result


def test_a_reader_that_stops_holds_its_request_and_a_stuck_one_is_aborted(tiny_llama: Path, tmp_path: Path) -> None:
    engine = start_engine(tiny_llama, tmp_path, *FLAGS)
    reference = reference_greedy(tiny_llama, [2, 7, 1], 300)

    async def main() -> None:
        client = EngineClient(engine.address, "slow-reader", stuck_reader_timeout=3.0)
        await client.connect(timeout=30)
        stream = client.generate("slow", [2, 7, 1], SamplingParams(max_tokens=300, **GREEDY))
        tokens = list((await stream.__anext__()).new_token_ids)
        for _ in range(100):  # not reading: the outputs pile up to the hold, then stop
            await asyncio.sleep(0.1)
            if client.holds:
                break
        await asyncio.sleep(0.5)
        buffered = client._streams["slow"].queue.qsize()
        generated = (await _stats(client)).scheduler.num_generation_tokens
        await asyncio.sleep(1.0)
        assert client.holds == 1 and HOLD_AFTER <= buffered <= HOLD_AFTER + 3, buffered
        assert (await _stats(client)).scheduler.num_generation_tokens == generated  # held: nothing generated
        async for out in stream:  # reading again releases it
            tokens += out.new_token_ids
        assert tokens == reference

        stuck = client.generate("stuck", [2, 7, 1], SamplingParams(max_tokens=300, **GREEDY))
        await stuck.__anext__()
        await asyncio.sleep(5.0)  # held, then past the 3 s stuck-reader timeout: aborted
        stats = await _stats(client)
        assert stats.scheduler.num_running == 0 and stats.kv_cache.usage == 0.0
        with pytest.raises(EngineError) as info:
            async for _ in stuck:
                pass
        assert info.value.code == "request_timeout" and "took no output" in info.value.message
        await client.close()

    try:
        asyncio.run(main())
    finally:
        engine.stop()
