"""EngineClient: a frontend's connection to one engine-core (asyncio, uvloop-friendly).

One DEALER socket carries everything (see evenflow/protocol/README.md). ``connect()`` does the
Hello/Ready handshake; ``generate()`` submits a request and yields its RequestOutputs as they stream
back; ``abort()`` and ``call_utility()`` do what they say. The socket side under them (the
handshake, the tasks that route frames, send heartbeats and watch the connection, failing pending
requests when the engine dies, hangs or goes away, and saying Hello again until it is back) is
``EngineConnection`` in evenflow/frontend/clients/connection.py. While failed, ``connected`` is
False and new calls raise the failure at once.

``BlockingEngineClient`` (evenflow/frontend/clients/blocking.py) wraps the same client for synchronous code.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from evenflow.protocol import (
    ERR_DUPLICATE_ID, ERR_INVALID_REQUEST, ERR_UNKNOWN_METHOD, Abort, AddRequest, AdapterRef, Hold, LoRALoad,
    RequestOutput, SamplingParams, UtilityCall, UtilityResult,
)

from evenflow.frontend.clients.backpressure import should_release
from evenflow.frontend.clients.connection import EngineConnection, RequestStream
from evenflow.frontend.clients.errors import (
    ERR_CLOSED, ERR_CONNECT_TIMEOUT, ERR_ENGINE_DEAD, ERR_NOT_CONNECTED, EngineError,
)

# (BlockingEngineClient is importable from here too: see __getattr__ below.)
__all__ = ["EngineClient", "EngineError", "ERR_CLOSED", "ERR_CONNECT_TIMEOUT", "ERR_ENGINE_DEAD"]


def __getattr__(name: str) -> Any:
    # Lazy re-export: blocking_client imports this module, so a top-level import would be circular.
    if name == "BlockingEngineClient":
        from evenflow.frontend.clients.blocking import BlockingEngineClient

        return BlockingEngineClient
    raise AttributeError(name)


class EngineClient(EngineConnection):
    """Async client of one engine-core over a DEALER socket (the socket side: connection.py)."""

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       priority: int = 0, arrival_time: float | None = None,
                       timeout_s: float = 0.0, lora: AdapterRef | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request; yield its deltas until one has ``finish_reason`` set.

        ``timeout_s`` > 0: the engine aborts the request after that long (``request_timeout``).
        ``lora``: the engine's LoRA adapter to serve it with (None: the base model).

        Raises EngineError for an Error about this request, a request too large for the engine's
        frame limit (``invalid_request``), or a fatal one. Stopping early (``aclose()``, ``break``,
        cancellation) aborts the request in the engine.
        """
        if self._fatal is not None:
            raise self._fatal
        if self._sock is None or self.ready is None:
            raise EngineError(ERR_NOT_CONNECTED, "call connect() first")
        if request_id in self._streams:
            raise EngineError(ERR_DUPLICATE_ID, f"request id {request_id!r} is already live", request_id)
        frame = self._codec.encode(AddRequest(request_id, list(prompt_token_ids), sampling_params, priority,
                                              arrival_time if arrival_time is not None else time.time(),
                                              timeout_s, lora.name if lora is not None else ""))
        limit = self.ready.max_frame_bytes
        if 0 < limit < len(frame):
            # The engine would refuse it with a bad_frame Error that carries no request id.
            raise EngineError(ERR_INVALID_REQUEST, f"request {request_id!r} encodes to {len(frame)} bytes, over the "
                                                   f"engine-core's frame limit of {limit} bytes (--max-frame-bytes)",
                              request_id)
        queue: asyncio.Queue[RequestOutput | EngineError] = asyncio.Queue()
        self._streams[request_id] = RequestStream(queue, frame)
        finished = False
        try:
            if not self._rehello:  # else it is submitted when the engine's Ready comes back
                self._send_frame(frame)
            while True:
                item = await queue.get()
                stream = self._streams.get(request_id)
                if stream is not None and should_release(stream.reader, queue.qsize()):
                    stream.reader.held_since = None
                    self._send(Hold([request_id], False))
                if isinstance(item, EngineError):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._fatal is None and self._sock is not None:
                self._send(Abort([request_id]))

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests; their streams end with finish_reason "abort"."""
        if self._sock is not None and self._fatal is None:
            self._send(Abort(list(request_ids)))

    async def call_utility(self, method: str, timeout: float = 30.0, lora: LoRALoad | None = None) -> UtilityResult:
        """Call an engine method by name (``get_stats``, ``reset_prefix_cache``, the LoRA ones with ``lora``)."""
        if self._fatal is not None:
            raise self._fatal
        call_id = next(self._call_ids)
        fut: asyncio.Future[UtilityResult] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self._send(UtilityCall(call_id, method, lora))
            result = await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)
        if not result.ok:
            raise EngineError(ERR_UNKNOWN_METHOD, result.message)
        return result
