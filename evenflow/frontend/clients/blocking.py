"""BlockingEngineClient: an EngineClient for synchronous code, its event loop running in a daemon thread.

Because the loop runs for the client's whole lifetime, heartbeats keep flowing while the caller
does other things between calls (the engine drops a client silent for --client-timeout), and a dead or
restarted engine-core is reconnected in the background exactly as in the async client.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine, Iterator, TypeVar

from evenflow.protocol import Ready, RequestOutput, SamplingParams, SchedulerStats, UtilityResult

from evenflow.frontend.clients.engine_client import EngineClient

T = TypeVar("T")


class BlockingEngineClient:
    """EngineClient for synchronous code: an event loop runs in a daemon thread."""

    def __init__(self, address: str, client_name: str = "") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-client", daemon=True)
        self._thread.start()
        self._client = EngineClient(address, client_name)

    @property
    def async_client(self) -> EngineClient:
        """The wrapped client; use it only from coroutines passed to ``run``."""
        return self._client

    @property
    def ready(self) -> Ready | None:
        return self._client.ready

    @property
    def stats(self) -> SchedulerStats | None:
        return self._client.stats

    @property
    def connected(self) -> bool:
        return self._client.connected

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the client's loop and wait for it; an interrupt or timeout cancels it."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()  # cancels the task on the loop: its cleanup (aborts) runs there
            raise

    def connect(self, timeout: float = 30.0) -> Ready:
        return self.run(self._client.connect(timeout))

    def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 priority: int = 0, arrival_time: float | None = None) -> Iterator[RequestOutput]:
        """Yield the request's deltas; closing the iterator early aborts the request."""
        agen = self._client.generate(request_id, prompt_token_ids, sampling_params, priority, arrival_time)
        try:
            while True:
                try:
                    yield self.run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self.run(agen.aclose())

    def abort(self, request_ids: list[str]) -> None:
        self.run(self._client.abort(request_ids))

    def call_utility(self, method: str, timeout: float = 30.0) -> UtilityResult:
        return self.run(self._client.call_utility(method, timeout))

    def close(self) -> None:
        """Close the client, then stop and close the loop thread."""
        if self._thread.is_alive():
            self.run(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
            self._loop.close()
