"""Admission limits and deadlines in a real engine-core: refusals are immediate, carry the limit's
name and leave the engine serving; an expired request is aborted, its blocks freed, its client told."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Iterator

import pytest

from evenflow.frontend.clients.engine_client import EngineClient, EngineError
from evenflow.protocol import SamplingParams
from tests.e2e.harness import EngineProcess, start_engine

pytestmark = pytest.mark.slow

LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


FLAGS = ("--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--worker-threads", "1",
         "--num-kv-blocks", "128")


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    eng = start_engine(tiny_llama, tmp_path_factory.mktemp("overload"), *FLAGS,
                       "--max-num-queued-reqs", "3", "--max-num-queued-tokens", "300")
    yield eng
    eng.stop()


async def _first(client: EngineClient, rid: str, prompt: list[int], sp: SamplingParams = LONG,
                 timeout_s: float = 0.0):  # noqa: ANN202
    agen = client.generate(rid, prompt, sp, timeout_s=timeout_s)
    await agen.__anext__()
    return agen


def test_request_limit_refuses_new_requests_only_while_full(engine: EngineProcess) -> None:
    async def main() -> None:
        client = EngineClient(engine.address, "overload")
        await client.connect()
        held = [await _first(client, f"h{i}", [3, 1, 4, i + 1]) for i in range(3)]
        t0 = time.monotonic()
        with pytest.raises(EngineError) as info:
            await _first(client, "over", [5, 6])
        assert time.monotonic() - t0 < 1.0  # refused at arrival, not after queueing
        assert info.value.code == "overloaded" and info.value.message.startswith("max_num_queued_reqs:")
        await held[0].aclose()  # one leaves: room for exactly one more
        await asyncio.sleep(0.1)
        held[0] = await _first(client, "again", [5, 6])
        for agen in held:
            await agen.aclose()
        await client.close()

    asyncio.run(main())


def test_token_limit_refuses_a_prompt_that_would_queue_too_much(engine: EngineProcess) -> None:
    async def main() -> None:
        client = EngineClient(engine.address, "tokens")
        await client.connect()
        with pytest.raises(EngineError) as info:
            await _first(client, "big", [7] * 301, SamplingParams(max_tokens=2))
        assert info.value.code == "overloaded" and info.value.message.startswith("max_num_queued_tokens:")
        small = await _first(client, "fits", [7] * 300, SamplingParams(max_tokens=2))
        await small.aclose()
        await client.close()

    asyncio.run(main())


def test_expired_requests_are_aborted_freed_and_told_why(tiny_llama: Path, tmp_path: Path) -> None:
    engine = start_engine(tiny_llama, tmp_path, *FLAGS, "--request-timeout", "0.15")
    try:
        _expiry(engine)
    finally:
        engine.stop()


def _expiry(engine: EngineProcess) -> None:
    async def main() -> None:
        client = EngineClient(engine.address, "deadline")
        await client.connect()

        async def run(rid: str, timeout_s: float) -> tuple[EngineError, float]:
            t0 = time.monotonic()
            with pytest.raises(EngineError) as info:
                async for _ in client.generate(rid, [9, 8, 7], SamplingParams(max_tokens=480, temperature=0.0,
                                                                                ignore_eos=True), timeout_s=timeout_s):
                    pass
            return info.value, time.monotonic() - t0

        (own, own_s), (default, default_s) = await asyncio.gather(run("own", 0.05), run("default", 0.0))
        # Deadlines far below the ~0.5 s+ that 480 tokens take even on an idle machine.
        assert own.code == "request_timeout" and "0.05 s" in own.message and 0.04 < own_s < 3.0
        assert default.code == "request_timeout" and "0.15 s" in default.message and 0.12 < default_s < 4.0
        await asyncio.sleep(0.3)
        stats = (await client.call_utility("get_stats")).result
        assert stats.scheduler.num_running == 0 and stats.scheduler.num_waiting == 0 and stats.kv_cache.usage == 0.0
        # The engine keeps serving, and a finished request's old deadline never hits a reused id.
        agen = client.generate("own", [1, 2], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert [o.finish_reason async for o in agen][-1] == "length"
        await client.close()

    asyncio.run(main())
