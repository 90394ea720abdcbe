"""EngineClient against in-process fake engines: unreachable, version refusal, silent death, fatal errors."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Callable

import msgspec
import pytest
import zmq

from evenflow.frontend import client as client_module
from evenflow.frontend.client import BlockingEngineClient, EngineClient, EngineError
from evenflow.protocol import (
    PROTOCOL_VERSION, Codec, Error, FrontendToEngine, Hello, Outputs, Ready, RequestOutput, SamplingParams,
)

READY = Ready(PROTOCOL_VERSION, "m", "/m", 64, 100, [2], 16, 32, 256, "fake")


class FakeEngine:
    """A ROUTER on a thread that answers each decoded message with ``respond(msg) -> [replies]``."""

    def __init__(self, address: str, respond: Callable[[msgspec.Struct], list[msgspec.Struct]]) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(address)
        self.respond = respond
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        codec: Codec = Codec(FrontendToEngine)
        while not self.stop.is_set():
            if self.sock.poll(50):
                identity, frame = self.sock.recv_multipart()
                for reply in self.respond(codec.decode(frame)):
                    self.sock.send_multipart([identity, codec.encode(reply)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def address(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/fake.sock"


def test_unreachable_engine_times_out_cleanly(address: str) -> None:
    async def main() -> None:
        client = EngineClient(address)
        t0 = time.monotonic()
        with pytest.raises(EngineError) as info:
            await client.connect(timeout=0.5)
        assert info.value.code == "connect_timeout" and time.monotonic() - t0 < 2

    asyncio.run(main())


def test_version_refusal_raises_with_the_engines_message(address: str) -> None:
    engine = FakeEngine(address, lambda m: [Error("version_mismatch", "client speaks 1, engine speaks 2", fatal=True)])
    try:
        client = BlockingEngineClient(address)
        with pytest.raises(EngineError, match="engine speaks 2") as info:
            client.connect(timeout=5)
        assert info.value.code == "version_mismatch"
        client.close()
    finally:
        engine.close()


def test_silent_engine_fails_pending_requests(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "DEAD_AFTER_S", 1.0)
    monkeypatch.setattr(client_module, "HEARTBEAT_S", 0.2)
    # Answers Hello, streams one token, then never speaks again (a hung or unplugged engine).
    engine = FakeEngine(address, lambda m: [READY] if isinstance(m, Hello) else
                        [Outputs([RequestOutput(m.request_id, [7])])] if hasattr(m, "prompt_token_ids") else [])

    async def main() -> None:
        client = EngineClient(address)
        await client.connect(timeout=5)
        got = []
        t0 = time.monotonic()
        with pytest.raises(EngineError) as info:
            async for out in client.generate("r", [1, 2], SamplingParams()):
                got += out.new_token_ids
        assert info.value.code == "engine_dead" and got == [7] and time.monotonic() - t0 < 3
        with pytest.raises(EngineError):  # the client stays failed
            async for _ in client.generate("r2", [1], SamplingParams()):
                pass
        await client.close()

    try:
        asyncio.run(main())
    finally:
        engine.close()


def test_fatal_error_reaches_every_stream_and_errors_reach_their_request(address: str) -> None:
    def respond(m: msgspec.Struct) -> list[msgspec.Struct]:
        if isinstance(m, Hello):
            return [READY]
        if getattr(m, "request_id", None) == "bad":
            return [Error("invalid_request", "prompt is empty", "bad")]
        if getattr(m, "request_id", None) == "b":
            return [Error("worker_died", "worker rank 0 was killed by signal SIGKILL", fatal=True)]
        return []
    engine = FakeEngine(address, respond)

    async def main() -> None:
        client = EngineClient(address)
        await client.connect(timeout=5)
        with pytest.raises(EngineError, match="prompt is empty"):
            async for _ in client.generate("bad", [1], SamplingParams()):
                pass
        async def consume(rid: str) -> None:
            async for _ in client.generate(rid, [1], SamplingParams()):
                pass
        a = asyncio.ensure_future(consume("a"))
        await asyncio.sleep(0.1)
        results = await asyncio.gather(a, consume("b"), return_exceptions=True)
        assert all(isinstance(r, EngineError) and r.code == "worker_died" for r in results), results
        await client.close()

    try:
        asyncio.run(main())
    finally:
        engine.close()
