"""The frontend <-> engine-core link across failures, with real processes: an engine-core killed and
restarted under a live client, a request over the engine's frame limit, and the offline LLM's
client kept alive between generate() calls."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import pytest

from evenflow.frontend import LLM
from evenflow.frontend import SamplingParams as LLMSamplingParams
from evenflow.frontend.clients import connection as client_module  # its timing constants
from evenflow.frontend.api.context import ServingContext
from evenflow.frontend.api.server import ServerConfig, build_app
from evenflow.frontend.clients.engine_client import EngineClient, EngineError
from evenflow.frontend.demo_model import ensure_demo_model
from evenflow.frontend.metrics import FrontendMetrics
from evenflow.protocol import SamplingParams
from tests.checkpoints import reference_greedy
from tests.e2e.harness import EngineProcess, start_engine

pytestmark = pytest.mark.slow

FLAGS = ("--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
         "--num-kv-blocks", "64", "--worker-threads", "1")
GREEDY = dict(temperature=0.0, ignore_eos=True)


async def _collect(client: EngineClient, rid: str, prompt: list[int], sp: SamplingParams) -> list[int]:
    return [t async for out in client.generate(rid, prompt, sp) for t in out.new_token_ids]


async def _health(app: object) -> int:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://frontend") as http:
        return (await http.get("/health")).status_code


def test_client_serves_again_after_the_engine_core_is_killed_and_restarted(
        tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "DEAD_AFTER_S", 2.0)  # a silence would count only after 2 s (the kill is seen at once)
    monkeypatch.setattr(client_module, "HEARTBEAT_S", 0.5)
    engines: list[EngineProcess] = [start_engine(tiny_llama, tmp_path, *FLAGS)]

    async def main() -> None:
        client = EngineClient(engines[0].address, "survivor")
        ready = await client.connect()
        app = build_app(ServerConfig(engine_address=engines[0].address))
        app.state.ctx = ServingContext(client, None, "m", ready.max_model_len, ready.vocab_size,  # type: ignore[arg-type]
                                       FrontendMetrics("m", None, None))
        assert await _health(app) == 200
        got: list[int] = []
        with pytest.raises(EngineError) as info:
            async for out in client.generate("doomed", [3, 1, 4], SamplingParams(max_tokens=480, **GREEDY)):
                if not got:
                    engines[0].proc.send_signal(signal.SIGKILL)
                got += out.new_token_ids
        assert info.value.code == "engine_dead" and 0 < len(got) < 480
        assert not client.connected and await _health(app) == 503
        with pytest.raises(EngineError, match="engine_dead"):
            await _collect(client, "while-down", [1], SamplingParams(max_tokens=2))

        # A new engine-core on the same address (started off the loop, which keeps serving).
        engines.append(await asyncio.to_thread(start_engine, tiny_llama, tmp_path, *FLAGS, "--max-frame-bytes", "4096"))
        deadline = time.monotonic() + 15
        while not client.connected:
            assert time.monotonic() < deadline, "the client did not reconnect to the new engine-core"
            await asyncio.sleep(0.1)
        assert client.ready is not None and client.ready.engine_id not in (ready.engine_id, "")
        assert client.ready.max_frame_bytes == 4096 and client.reconnects == 1
        assert await _health(app) == 200
        tokens = await _collect(client, "after-restart", [1, 5, 9], SamplingParams(max_tokens=8, **GREEDY))
        assert tokens == reference_greedy(tiny_llama, [1, 5, 9], 8)
        await client.close()

    try:
        asyncio.run(main())
    finally:
        for eng in engines:
            eng.stop()


def test_request_over_the_engines_frame_limit_fails_alone(tiny_llama: Path, tmp_path: Path) -> None:
    eng = start_engine(tiny_llama, tmp_path, *FLAGS, "--max-frame-bytes", "2048")

    async def main() -> None:
        client = EngineClient(eng.address, "big-frames")
        ready = await client.connect()
        assert ready.max_frame_bytes == 2048
        small = asyncio.ensure_future(_collect(client, "small", [1, 5, 9], SamplingParams(max_tokens=24, **GREEDY)))
        # Valid in every field, but 1500 two-byte stop ids make a frame the engine would refuse.
        big = SamplingParams(max_tokens=4, stop_token_ids=[200] * 1500)
        with pytest.raises(EngineError) as info:
            await _collect(client, "big", [1, 2, 3], big)
        assert (info.value.code, info.value.request_id) == ("invalid_request", "big")
        assert "2048" in info.value.message and "30" in info.value.message  # both sizes (~3000 bytes)
        assert await asyncio.wait_for(small, 30) == reference_greedy(tiny_llama, [1, 5, 9], 24)
        assert client.connected and client.rehellos == 0
        await client.close()

    try:
        asyncio.run(main())
        assert "bad frame" not in eng.log()  # refused before it was sent
    finally:
        eng.stop()


def test_llm_keeps_its_client_alive_between_generate_calls(tmp_path: Path) -> None:
    llm = LLM(model=str(ensure_demo_model(tmp_path / "demo-model")), max_model_len=256, num_kv_blocks=64,
              max_num_batched_tokens=128, max_num_seqs=8)
    try:
        greedy = LLMSamplingParams(max_tokens=4, temperature=0.0)
        first = llm.generate("def f(x):", greedy, use_tqdm=False)[0]
        time.sleep(4.5)  # longer than the engine's 3 s client timeout, with no call in flight
        second = llm.generate("def f(x):", greedy, use_tqdm=False)[0]
        assert second.token_ids == first.token_ids and len(first.token_ids) == 4
        client = llm._client.async_client
        assert client.rehellos == 0 and client.reconnects == 0  # never dropped, never re-Helloed
        log = llm.log_path.read_text(errors="replace")
        assert "connected (llm-" in log and " gone: " not in log, log
    finally:
        llm.shutdown()
