"""Server-sent events and client-disconnect handling, as small ASGI pieces.

``SSEResponse`` streams ``data: ...`` chunks and watches the connection while it does: when the
client goes away the producing task is cancelled at once (even while the request still waits in
the engine's queue and no token is flowing), so the generation's cleanup aborts its engine
requests and their KV blocks free. ``run_until_disconnect`` does the same for non-streaming
handlers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.types import Receive, Scope, Send

T = TypeVar("T")
logger = logging.getLogger("evenflow.frontend")

DONE = b"data: [DONE]\n\n"


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before the response was complete."""


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``; cancel it and raise ClientDisconnected if the client leaves first.

    The request body must already be read (the watcher consumes ``receive``).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


class SSEResponse:
    """A ``text/event-stream`` response fed by an async iterator of already-framed bytes."""

    def __init__(self, body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        self.body = body
        self.headers = headers or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        producer = asyncio.ensure_future(self._produce(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not producer.done():
                producer.cancel()
                await asyncio.gather(producer, return_exceptions=True)
        if producer.done() and not producer.cancelled():
            exc = producer.exception()
            if exc is not None:
                logger.error("stream failed: %r", exc)
            try:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                pass

    async def _produce(self, send: Send) -> None:
        body = self.body
        try:
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except OSError:
            return  # the client went away while we were writing
        finally:
            aclose: Callable[[], Any] | None = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()
