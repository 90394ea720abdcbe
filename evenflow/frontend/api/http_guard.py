"""uvicorn's h11 protocol with the limits a public HTTP server needs (nginx has them all):

* a deadline for a request's head (``--header-timeout``): a client that sends its headers a byte at
  a time (slowloris) or nothing at all is answered 408 and closed, not held forever;
* an idle timeout while a request body is being received (the same seconds, per chunk);
* a head size and a header count limit (``--h11-max-incomplete-event-size``,
  ``--h11-max-header-count``, vLLM's names): 431 instead of parsing it;
* a cap on open connections (``--max-connections``): one more is answered 503 and closed, with a
  log line (at most one every 10 s, with the count refused since).

Keep-alive idleness between requests is uvicorn's own ``timeout_keep_alive``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("evenflow.frontend.http")

_END_OF_HEAD = b"\r\n\r\n"
_LOG_EVERY_S = 10.0


@dataclass
class HttpLimits:
    header_timeout_s: float = 10.0
    max_head_bytes: int = 16 * 1024  # request line + headers
    max_header_count: int = 256
    max_connections: int = 2048


def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = ('{"error":{"message":"%s","type":"%s","code":%d}}' % (message, reason, status)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class _RefusalLog:
    """One log line per interval for a refusal that may come thousands of times a second."""

    def __init__(self) -> None:
        self.last = 0.0
        self.count = 0

    def note(self, text: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= _LOG_EVERY_S:
            log.warning("%s (%d refused since the last such line)", text, self.count)
            self.last, self.count = now, 0


_refused_connections = _RefusalLog()


class GuardedH11Protocol(H11Protocol):
    """H11Protocol plus HttpLimits (set on the class by ``guarded_protocol``)."""

    limits = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._head_lines = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            _refused_connections.note(f"refused a connection: {len(self.connections) - 1} are open, the limit "
                                      f"is --max-connections {self.limits.max_connections}")
            self._refuse(503, "Service Unavailable", "too many open connections; retry later")
            return
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self.conn.their_state in (h11.IDLE, h11.DONE) and self.cycle_done():
            if not self._head_bytes:  # the first byte of a new head: its deadline starts now
                self._arm(self.limits.header_timeout_s)
            end = data.find(_END_OF_HEAD)
            head = data if end < 0 else data[:end]
            self._head_bytes += len(head)
            self._head_lines += head.count(b"\n")
            if self._head_bytes > self.limits.max_head_bytes or self._head_lines > self.limits.max_header_count:
                self._refuse(431, "Request Header Fields Too Large",
                             f"the request head exceeds {self.limits.max_head_bytes} bytes or "
                             f"{self.limits.max_header_count} headers")
                return
            if end >= 0:
                self._head_bytes = self._head_lines = 0
                self._disarm()
        super().data_received(data)
        if self.conn.their_state is h11.SEND_BODY:
            self._arm(self.limits.header_timeout_s)  # the body's next chunk is due within the timeout
        elif not self._head_bytes:
            self._disarm()

    def cycle_done(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, self._on_read_timeout)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _on_read_timeout(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            self._refuse(408, "Request Timeout", f"no complete request within {self.limits.header_timeout_s:g} s "
                                                 f"(--header-timeout)")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        self._disarm()
        if self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete:
            self.transport.close()  # a response is under way: a second status line cannot follow
            return
        self.transport.write(_raw_response(status, reason, message))
        self.transport.close()


def guarded_protocol(limits: HttpLimits) -> type[GuardedH11Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` with these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
