"""The engine-core's side of the frontend wire: one ROUTER socket, owned by its own threads.

* The IO thread owns the ROUTER. It decodes every frame, answers what needs no scheduler state
  itself (Hello -> Ready or a version Error, Heartbeat -> Outputs with the latest stats, bad frames
  and invalid requests -> Error) and hands the rest to the engine loop through ``inbox``. It also
  decides liveness: a client the ROUTER can no longer route to after a disconnect event (milliseconds
  after its process died), or one silent for ``client_timeout`` seconds of this thread's running
  time (evenflow/protocol/liveness.py: a pause of this process is not the client's silence), is
  reported as ``ClientGone``.
* The encoder thread takes ``(identity, message)`` pairs from the engine loop, encodes them and
  passes the bytes to the IO thread over an inproc pipe (ZMQ sockets are single-threaded).

So the engine loop never touches a socket or msgpack for frontends.
"""

from __future__ import annotations

import collections
import errno
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from evenflow.protocol import (
    ERR_BAD_FRAME, ERR_CLIENT_DROPPED, ERR_INVALID_REQUEST, ERR_NOT_READY, ERR_VERSION, PROTOCOL_VERSION, AddRequest, Codec,
    DecodeError, Error, FrontendToEngine, Heartbeat, Hello, Outputs, Ready, SchedulerStats,
)

from evenflow.protocol.codec import engine_codec
from evenflow.protocol.curve import serve_curve
from evenflow.protocol.liveness import RunningClock
from evenflow.protocol.request_envelope import RequestRefused
from evenflow.protocol.validation import check_add_request

log = logging.getLogger("evenflow.core.frontend_link")

_UNICAST, _BROADCAST, _GONE_HANDLED = b"u", b"b", b"g"
_PROBE_DELAYS_S = (0.0, 0.1, 0.5, 1.5)  # after a disconnect event, until the pipe is gone
_POLL_MS = 100
_CLOCK_MAX_STEP_S = 0.5  # the IO loop wakes every _POLL_MS: a longer gap is a pause of this process
_SWEEP_S, _SWEEP_MAX_S = 0.2, 2.0  # silent clients are looked for every _SWEEP_S, or _SWEEP_MAX_S under a flood


@dataclass
class ClientMessage:
    """A message from a registered client for the engine loop."""

    identity: bytes
    client_index: int
    msg: AddRequest | msgspec.Struct


@dataclass
class ClientGone:
    """A client disconnected or went silent: abort all its requests."""

    identity: bytes
    client_index: int
    reason: str


@dataclass
class _Client:
    index: int
    name: str
    last_seen: float  # on the IO thread's RunningClock


class FrontendLink:
    """ROUTER socket + IO/encoder threads. ``send``/``broadcast`` are safe from any thread."""

    def __init__(self, ctx: zmq.Context, address: str, ready: Ready, *, max_frame_bytes: int,
                 client_timeout: float, curve_keys: str | None = None) -> None:
        # None: a wake-up with no message (the engine puts one when a grammar compile finishes).
        self.inbox: queue.Queue[ClientMessage | ClientGone | None] = queue.Queue()
        self._ctx = ctx
        self._address = address
        self._ready = ready
        self._codec: Codec[FrontendToEngine] = engine_codec(max_frame_bytes)
        self._client_timeout = client_timeout
        self._clock = RunningClock(_CLOCK_MAX_STEP_S)  # read by the IO thread only
        self._curve_keys = curve_keys  # a key folder: CURVE-encrypt and authenticate (evenflow/protocol/curve.py)
        # (identity or None for all, message); a message of None marks a ClientGone as handled.
        self._outbox: queue.Queue[tuple[bytes | None, msgspec.Struct | None] | None] = queue.Queue()
        self._pipe_addr = f"inproc://frontend-out-{id(self)}"
        self._stats = SchedulerStats()
        self._clients: dict[bytes, _Client] = {}
        # Identities dropped whose ClientGone the engine loop has not handled yet: what it sends
        # them until then concerns requests from before the drop, which the client counts as gone.
        self._gone_unhandled: collections.Counter[bytes] = collections.Counter()
        self._next_index = 0
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self._io = threading.Thread(target=self._io_loop, name="frontend-io", daemon=True)
        self._enc = threading.Thread(target=self._encode_loop, name="frontend-encode", daemon=True)

    # ----------------------------------------------------------------------------- engine side

    def start(self) -> None:
        """Bind the ROUTER (raises on failure, e.g. address in use) and start the threads."""
        self._io.start()
        self._bound.wait()
        if self._bind_error is not None:
            raise self._bind_error
        self._enc.start()

    def send(self, identity: bytes, msg: msgspec.Struct) -> None:
        self._outbox.put((identity, msg))

    def gone_handled(self, identity: bytes) -> None:
        """The engine loop aborted a ClientGone's requests: later messages to that identity are new."""
        self._outbox.put((identity, None))

    def broadcast(self, msg: msgspec.Struct) -> None:
        """Send ``msg`` to every registered client."""
        self._outbox.put((None, msg))

    def set_stats(self, stats: SchedulerStats) -> None:
        """Publish the latest stats for heartbeat replies (a reference swap; never mutated later)."""
        self._stats = stats

    def num_clients(self) -> int:
        return len(self._clients)

    def close(self, flush_timeout: float = 2.0) -> None:
        """Send what is queued (up to ``flush_timeout``), then stop both threads."""
        self._outbox.put(None)
        self._enc.join(flush_timeout)
        self._stop.set()
        self._io.join(flush_timeout)

    # ----------------------------------------------------------------------------- threads

    def _encode_loop(self) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.connect(self._pipe_addr)
        encode = msgspec.msgpack.Encoder().encode
        try:
            while (item := self._outbox.get()) is not None:
                identity, msg = item
                if msg is None:
                    push.send_multipart((_GONE_HANDLED, b"", identity), copy=False)
                elif identity is None:
                    push.send_multipart((_BROADCAST, encode(msg)), copy=False)
                else:
                    push.send_multipart((_UNICAST, encode(msg), identity), copy=False)
        finally:
            push.close(linger=1000)

    def _io_loop(self) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        pipe = self._ctx.socket(zmq.PULL)
        auth = None
        try:
            # Unroutable sends raise instead of vanishing: that is how a gone client is noticed.
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.SNDHWM, 0)
            router.setsockopt(zmq.RCVHWM, 0)
            router.setsockopt(zmq.LINGER, 1000)
            # ZMQ closes the connection of a peer whose frame payload exceeds this (the documented
            # rule); frames between the decode limit and this cap still get a bad_frame Error.
            router.setsockopt(zmq.MAXMSGSIZE, disconnect_frame_bytes(self._codec.max_frame_bytes))
            auth = serve_curve(self._ctx, router, self._curve_keys) if self._curve_keys else None
            router.bind(self._address)
            pipe.bind(self._pipe_addr)
            monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        except BaseException as e:  # reported to start()'s caller
            self._bind_error = e
            if auth is not None:
                auth.stop()
            router.close(0)
            pipe.close(0)
            self._bound.set()
            return
        self._bound.set()
        poller = zmq.Poller()
        for s in (router, pipe, monitor):
            poller.register(s, zmq.POLLIN)
        probes: list[float] = []
        last_sweep = time.monotonic()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(_POLL_MS))
                self._clock.now()  # every wake-up: a pause of this process shows as one long gap
                if router in events:
                    _drain(router, lambda frames: self._on_frames(router, frames))
                if pipe in events:
                    _drain(pipe, lambda parts: self._on_outgoing(router, parts))
                if monitor in events:
                    recv_monitor_message(monitor)
                    now = time.monotonic()
                    probes.extend(now + d for d in _PROBE_DELAYS_S)
                now = time.monotonic()
                if probes and min(probes) <= now:
                    probes = [t for t in probes if t > now]
                    self._probe_all(router)
                # Frames still waiting were sent before any verdict could be fair: read them first
                # (but a steady flood from other clients must not put off the verdict for ever).
                waiting = bool(router.getsockopt(zmq.EVENTS) & zmq.POLLIN)
                if now - last_sweep > (_SWEEP_MAX_S if waiting else _SWEEP_S):
                    last_sweep = now
                    self._drop_silent(router, self._clock.now())
        finally:
            router.disable_monitor()
            monitor.close(0)
            pipe.close(0)
            router.close()
            if auth is not None:
                auth.stop()

    # ----------------------------------------------------------------------------- IO helpers

    def _send_frame(self, router: zmq.Socket, identity: bytes, frame: bytes | zmq.Frame) -> None:
        try:
            router.send_multipart((identity, frame), copy=False)
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            self._forget(identity, "disconnected")

    def _reply(self, router: zmq.Socket, identity: bytes, msg: msgspec.Struct) -> None:
        self._send_frame(router, identity, self._codec.encode(msg))

    def _on_outgoing(self, router: zmq.Socket, parts: list[zmq.Frame]) -> None:
        kind = parts[0].bytes
        if kind == _BROADCAST:
            for identity in list(self._clients):
                self._send_frame(router, identity, parts[1].bytes)
        elif kind == _GONE_HANDLED:
            self._gone_unhandled -= collections.Counter([parts[2].bytes])  # drops counts that reach 0
        elif (identity := parts[2].bytes) not in self._gone_unhandled:
            self._send_frame(router, identity, parts[1])

    def _on_frames(self, router: zmq.Socket, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        client = self._clients.get(identity)
        if client is not None:
            client.last_seen = self._clock.now()
        if len(frames) != 2:
            self._bad(router, identity, f"expected one frame per message, got {len(frames) - 1}")
            return
        # Checked in the order evenflow/protocol/README.md states: the frame decodes (else bad_frame), the
        # client said hello (else no_hello), the request's fields are valid (else invalid_request).
        try:
            msg = self._codec.decode(frames[1].buffer)
        except RequestRefused as e:
            if client is None:
                self._reply(router, identity, Error(ERR_NOT_READY, "send hello before request"))
            else:
                self._reply(router, identity, Error(ERR_INVALID_REQUEST, str(e), e.request_id))
            return
        except DecodeError as e:
            self._bad(router, identity, str(e))
            return
        if isinstance(msg, Hello):
            self._on_hello(router, identity, msg)
        elif client is None:
            tag = type(msg).__struct_config__.tag
            self._reply(router, identity, Error(ERR_NOT_READY, f"send hello before {tag}"))
        elif isinstance(msg, Heartbeat):
            self._reply(router, identity, Outputs([], self._stats, time.time()))
        elif isinstance(msg, AddRequest):
            problem = check_add_request(msg, self._ready.vocab_size, self._ready.max_model_len)
            if problem is not None:
                self._reply(router, identity, Error(ERR_INVALID_REQUEST, problem.message, msg.request_id))
            else:
                self.inbox.put(ClientMessage(identity, client.index, msg))
        else:  # Abort, Hold, UtilityCall
            self.inbox.put(ClientMessage(identity, client.index, msg))

    def _bad(self, router: zmq.Socket, identity: bytes, reason: str) -> None:
        log.warning("bad frame from client %s: %s", identity.hex(), reason)
        self._reply(router, identity, Error(ERR_BAD_FRAME, reason))

    def _on_hello(self, router: zmq.Socket, identity: bytes, hello: Hello) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            text = (f"protocol version mismatch: client {hello.client_name or identity.hex()!r} speaks "
                    f"version {hello.protocol_version}, this engine speaks version {PROTOCOL_VERSION}")
            log.warning(text)
            self._reply(router, identity, Error(ERR_VERSION, text, fatal=True))
            return
        if identity not in self._clients:
            self._clients[identity] = _Client(self._next_index, hello.client_name, self._clock.now())
            log.info("client %d connected (%s)", self._next_index, hello.client_name or identity.hex())
            self._next_index += 1
        self._reply(router, identity, self._ready)

    def _probe_all(self, router: zmq.Socket) -> None:
        """After a disconnect event: an empty Outputs to each client finds the one that is gone."""
        if self._clients:
            frame = self._codec.encode(Outputs([], self._stats, time.time()))
            for identity in list(self._clients):
                self._send_frame(router, identity, frame)

    def _drop_silent(self, router: zmq.Socket, running: float) -> None:
        for identity, c in list(self._clients.items()):
            if running - c.last_seen > self._client_timeout:
                reason = (f"silent for {running - c.last_seen:.1f} s of the engine's running time "
                          f"(--client-timeout {self._client_timeout:g} s)")
                self._forget(identity, reason)
                # Sent from this thread, so it precedes every answer to a later frame of that client.
                # (A client whose connection is gone cannot be told: its next message gets no_hello.)
                self._reply(router, identity, Error(ERR_CLIENT_DROPPED, f"dropped: {reason}; every request of "
                                                                   f"yours was aborted; send hello, then resubmit"))

    def _forget(self, identity: bytes, reason: str) -> None:
        client = self._clients.pop(identity, None)
        if client is not None:
            self._gone_unhandled[identity] += 1
            log.warning("client %d (%s) gone: %s", client.index, client.name or identity.hex(), reason)
            self.inbox.put(ClientGone(identity, client.index, reason))


def disconnect_frame_bytes(max_frame_bytes: int) -> int:
    """ZMQ_MAXMSGSIZE of the ROUTER: a frame whose payload (the msgpack bytes, not ZMTP's framing)
    is larger makes ZMQ close that connection. Twice the decode limit, as evenflow/protocol/README.md says."""
    return min(2 * max_frame_bytes, 2**63 - 1)


def _drain(sock: zmq.Socket, handle: Callable[[list[zmq.Frame]], None], burst: int = 256) -> None:
    """Handle up to ``burst`` waiting messages of ``sock``: a burst is drained without starving
    the other sockets of the poll loop."""
    for _ in range(burst):
        try:
            parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        handle(parts)
