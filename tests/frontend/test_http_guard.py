"""Hostile HTTP clients against uvicorn with evenflow's guarded protocol (in a thread, real sockets):
slowloris and silent sockets get 408 and are closed, oversized heads 431, one connection over the
cap 503 with a log line, a stalled body 408; normal requests are served throughout."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from evenflow.frontend.api.http_guard import HttpLimits, guarded_protocol

LIMITS = HttpLimits(header_timeout_s=1.0, max_head_bytes=8192, max_header_count=64, max_connections=40)


async def _echo(request: Request) -> PlainTextResponse:
    try:
        return PlainTextResponse(f"read {len(await request.body())} bytes")
    except ClientDisconnect:  # the guard closed a stalled body
        return PlainTextResponse("gone", status_code=499)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    app = Starlette(routes=[Route("/", _echo, methods=["GET", "POST"])])
    cfg = uvicorn.Config(app, loop="asyncio", log_level="warning", http=guarded_protocol(LIMITS),  # type: ignore[arg-type]
                         h11_max_incomplete_event_size=2 * LIMITS.max_head_bytes + 65536, timeout_keep_alive=5,
                         lifespan="off")
    server = uvicorn.Server(cfg)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def _read_all(s: socket.socket, timeout: float = 5.0) -> bytes:
    s.settimeout(timeout)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return out


def _get(port: int, extra: bytes = b"") -> bytes:
    with _connect(port) as s:
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n" + extra + b"connection: close\r\n\r\n")
        return _read_all(s)


def test_slowloris_and_silent_sockets_are_answered_408_and_closed(port: int) -> None:
    drips = [_connect(port) for _ in range(20)]
    silent = [_connect(port) for _ in range(10)]
    t0 = time.monotonic()
    for _ in range(5):  # a byte of the head every 0.3 s: never complete
        for s in drips:
            try:
                s.send(b"G")
            except OSError:
                pass
        assert _get(port).startswith(b"HTTP/1.1 200")  # a normal client is served meanwhile
        time.sleep(0.3)
    for s in drips + silent:
        reply = _read_all(s)
        assert reply.startswith(b"HTTP/1.1 408") and b"--header-timeout" in reply, reply
        s.close()
    assert time.monotonic() - t0 < 6


def test_oversized_heads_get_431(port: int) -> None:
    assert _get(port, b"x-big: " + b"a" * 100_000 + b"\r\n").startswith(b"HTTP/1.1 431")
    many = b"".join(b"x-h%d: v\r\n" % i for i in range(10_000))
    assert _get(port, many).startswith(b"HTTP/1.1 431")
    assert _get(port, b"x-ok: " + b"a" * 4000 + b"\r\n").startswith(b"HTTP/1.1 200")


def test_a_stalled_body_is_timed_out_and_a_slow_second_head_too(port: int) -> None:
    with _connect(port) as s:
        s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + b"x" * 10)
        assert _read_all(s).startswith(b"HTTP/1.1 408")
    with _connect(port) as s:  # keep-alive: the first request is served, the dripped second is not held
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        s.settimeout(5)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        for _ in range(6):
            try:
                s.send(b"G")
            except OSError:
                break
            time.sleep(0.3)
        assert b"HTTP/1.1 408" in _read_all(s)


def test_one_connection_over_the_cap_gets_503_and_a_log_line(port: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "evenflow.frontend.http")
    held = [_connect(port) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.3)
        with _connect(port) as extra:
            assert _read_all(extra).startswith(b"HTTP/1.1 503")
        assert any("--max-connections" in r.getMessage() for r in caplog.records)
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert _get(port).startswith(b"HTTP/1.1 200")

