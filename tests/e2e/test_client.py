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

from evenflow.frontend.clients import connection as client_module  # its timing constants
from evenflow.frontend.clients.engine_client import BlockingEngineClient, EngineClient, EngineError
from evenflow.protocol import (
    PROTOCOL_VERSION, AddRequest, Codec, Error, FrontendToEngine, Heartbeat, Hello, Outputs, Ready, RequestOutput,
    SamplingParams,
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
        with pytest.raises(EngineError):  # fails fast until an engine answers a re-sent Hello
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


def _fast_liveness(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "DEAD_AFTER_S", 1.0)
    monkeypatch.setattr(client_module, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(client_module, "RECONNECT_MIN_S", 0.1)
    monkeypatch.setattr(client_module, "RECONNECT_MAX_S", 0.4)


async def _wait_connected(client: EngineClient, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not client.connected:
        assert time.monotonic() < deadline, "the client did not reconnect"
        await asyncio.sleep(0.05)


async def _tokens(client: EngineClient, rid: str, prompt: list[int]) -> list[int]:
    return [t async for out in client.generate(rid, prompt, SamplingParams()) for t in out.new_token_ids]


def test_client_reconnects_when_a_silent_engine_answers_again(address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _fast_liveness(monkeypatch)
    state = {"alive": True, "engine_id": "fake"}

    def respond(m: msgspec.Struct) -> list[msgspec.Struct]:
        if not state["alive"]:
            return []
        if isinstance(m, Hello):
            return [msgspec.structs.replace(READY, engine_id=state["engine_id"])]
        if isinstance(m, Heartbeat):
            return [Outputs([])]
        if isinstance(m, AddRequest) and m.request_id == "hang":  # one token, then the engine is gone
            state["alive"] = False
            return [Outputs([RequestOutput(m.request_id, [7])])]
        if isinstance(m, AddRequest):
            return [Outputs([RequestOutput(m.request_id, [7], "length")])]
        return []
    engine = FakeEngine(address, respond)

    async def main() -> None:
        client = EngineClient(address)
        await client.connect(timeout=5)
        assert client.connected and client.rehellos == 0
        got: list[int] = []
        with pytest.raises(EngineError) as info:
            async for out in client.generate("hang", [1], SamplingParams()):
                got += out.new_token_ids
        assert info.value.code == "engine_dead" and got == [7] and not client.connected
        with pytest.raises(EngineError, match="engine_dead"):
            await client.call_utility("get_stats", timeout=1)
        await asyncio.sleep(1.0)  # still down: Hellos keep going out with backoff
        assert not client.connected and client.rehellos >= 2
        state.update(alive=True, engine_id="fake2")  # a restarted engine-core on the same address
        await _wait_connected(client)
        assert client.ready is not None and client.ready.engine_id == "fake2" and client.reconnects == 1
        assert await _tokens(client, "after", [1]) == [7]
        await client.close()
        assert not client.connected

    try:
        asyncio.run(main())
    finally:
        engine.close()


def test_after_a_fatal_error_only_another_engine_revives_the_client(address: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _fast_liveness(monkeypatch)
    state = {"engine_id": "fake"}

    def respond(m: msgspec.Struct) -> list[msgspec.Struct]:
        if isinstance(m, Hello):  # a dying engine may still answer Hello while it flushes
            return [msgspec.structs.replace(READY, engine_id=state["engine_id"])]
        if isinstance(m, Heartbeat):
            return [Outputs([])]
        if isinstance(m, AddRequest):
            if m.request_id == "boom":
                return [Error("engine_shutdown", "engine-core is shutting down (SIGTERM)", fatal=True)]
            return [Outputs([RequestOutput(m.request_id, [5], "length")])]
        return []
    engine = FakeEngine(address, respond)

    async def main() -> None:
        client = EngineClient(address)
        await client.connect(timeout=5)
        with pytest.raises(EngineError, match="shutting down"):
            await _tokens(client, "boom", [1])
        await asyncio.sleep(0.8)
        assert not client.connected and client.rehellos >= 1  # answered, but by the engine that left
        with pytest.raises(EngineError, match="engine_shutdown"):
            await _tokens(client, "x", [1])
        state["engine_id"] = "fake2"
        await _wait_connected(client)
        assert await _tokens(client, "y", [1]) == [5]
        await client.close()

    try:
        asyncio.run(main())
    finally:
        engine.close()


def test_request_over_the_engines_frame_limit_fails_alone_without_being_sent(address: str) -> None:
    received: list[msgspec.Struct] = []

    def respond(m: msgspec.Struct) -> list[msgspec.Struct]:
        received.append(m)
        if isinstance(m, Hello):
            return [msgspec.structs.replace(READY, max_frame_bytes=512)]
        if isinstance(m, AddRequest):
            return [Outputs([RequestOutput(m.request_id, [3], "length")])]
        return []
    engine = FakeEngine(address, respond)

    async def main() -> None:
        client = EngineClient(address)
        await client.connect(timeout=5)
        assert client.ready is not None and client.ready.max_frame_bytes == 512
        with pytest.raises(EngineError) as info:
            await _tokens(client, "big", [1] * 600)
        assert info.value.code == "invalid_request" and info.value.request_id == "big"
        assert "512" in info.value.message and "bytes" in info.value.message
        assert await _tokens(client, "small", [1] * 10) == [3]  # the client is unharmed
        assert client.connected
        await client.close()

    try:
        asyncio.run(main())
    finally:
        engine.close()
    assert [m.request_id for m in received if isinstance(m, AddRequest)] == ["small"]
