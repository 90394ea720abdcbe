"""The socket side of EngineClient: one DEALER to one engine-core, its handshake, liveness and recovery.

``connect()`` does the Hello/Ready handshake and starts three tasks: one routes incoming frames to
per-request queues (and answers utility calls), one sends a Heartbeat every second, one watches
for the connection closing. When the engine's connection closes (a ZMQ disconnect event: its
process died, within milliseconds on TCP and ipc), when it is silent for ``engine_timeout``
seconds of this process's running time (evenflow/protocol/liveness.py: our own pauses do not
count), or when it says it is going away, every pending request fails with an EngineError
carrying the reason; the connection then says Hello again with backoff until an engine-core (the
same or a restarted one) answers Ready. The request API on top of it: evenflow/frontend/clients/engine_client.py.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from evenflow.protocol import (
    ERR_CLIENT_DROPPED, ERR_NOT_READY, ERR_REQUEST_TIMEOUT, PROTOCOL_VERSION, MAX_FRAME_BYTES, Abort, Codec,
    DecodeError, EngineToFrontend, Error, Heartbeat, Hello, Hold, Outputs, Ready, RequestOutput, SchedulerStats,
    UtilityCall, UtilityResult,
)
from evenflow.protocol.curve import connect_curve
from evenflow.protocol.liveness import DEFAULT_SILENCE_TIMEOUT_S, RunningClock

from evenflow.frontend.clients.backpressure import DEFAULT_STUCK_READER_TIMEOUT_S, ReaderState, is_stuck, should_hold
from evenflow.frontend.clients.errors import ERR_CLOSED, ERR_CONNECT_TIMEOUT, ERR_ENGINE_DEAD, EngineError

log = logging.getLogger("evenflow.frontend.clients.engine_client")  # the name users configure

HEARTBEAT_S = 1.0
DEAD_AFTER_S = DEFAULT_SILENCE_TIMEOUT_S  # the default of --engine-timeout
RECONNECT_MIN_S = 0.5  # first re-Hello after a failure; doubles up to RECONNECT_MAX_S
RECONNECT_MAX_S = 5.0
# The engine's frames (Outputs of up to max_num_seqs requests with logprobs) stay far below this;
# a larger one is a broken or hostile peer, and ZMQ drops its connection instead of buffering it.
MAX_INBOUND_FRAME_BYTES = 4 * MAX_FRAME_BYTES


@dataclass
class RequestStream:
    """One live request: its queue of deltas, and its encoded frame to resubmit after a re-Hello."""

    queue: asyncio.Queue[RequestOutput | EngineError]
    frame: bytes
    got_output: bool = False
    reader: ReaderState = field(default_factory=ReaderState)  # backpressure.py


class EngineConnection:
    """One engine-core's DEALER socket: handshake, the receive/heartbeat/disconnect tasks, recovery."""

    def __init__(self, address: str, client_name: str = "", curve_keys: str | None = None,
                 engine_timeout: float | None = None,
                 stuck_reader_timeout: float = DEFAULT_STUCK_READER_TIMEOUT_S) -> None:
        self.address = address
        self.client_name = client_name
        # Silence (of our running time) after which the engine counts as hung or unreachable.
        self.engine_timeout = engine_timeout if engine_timeout is not None else DEAD_AFTER_S
        if self.engine_timeout <= 0:
            raise ValueError(f"engine_timeout must be positive, got {self.engine_timeout}")
        self.stuck_reader_timeout = stuck_reader_timeout  # a request held this long is aborted
        self.holds = 0  # hold messages sent (backpressure), for tests and logs
        self.curve_keys = curve_keys  # a key folder: CURVE-encrypted, authenticated link (evenflow/protocol/curve.py)
        self.ready: Ready | None = None
        self.stats: SchedulerStats | None = None
        self.rehellos = 0  # Hellos after the handshake: the engine forgot us, died or restarted
        self.reconnects = 0  # times a Ready ended a failure (engine death, restart, fatal error)
        self._codec: Codec[EngineToFrontend] = Codec(EngineToFrontend)
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._streams: dict[str, RequestStream] = {}
        self._rehello = False  # the engine forgot us; a Hello is on its way
        self._calls: dict[int, asyncio.Future[UtilityResult]] = {}
        self._call_ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._fatal: EngineError | None = None  # set while failed; cleared by the next accepted Ready
        self._dead_engine_id: str | None = None  # an engine that said it is going away: ignore its Ready
        self._revived = asyncio.Event()
        self._clock = RunningClock(2 * HEARTBEAT_S)  # remade at connect() (HEARTBEAT_S may be changed)
        self._last_rx = 0.0  # on self._clock
        self._monitor: zmq.asyncio.Socket | None = None
        # Called with every Outputs after its deltas are queued (the data-parallel client's router
        # reads stats and prefix-cache events here).
        self.on_outputs: Callable[[Outputs], None] | None = None

    @property
    def failure(self) -> EngineError | None:
        """Why the client is failed (engine death, fatal error, close); None while it serves."""
        return self._fatal

    @property
    def connected(self) -> bool:
        """True between a Ready and the next failure (engine death, fatal error, close)."""
        return self.ready is not None and self._sock is not None and self._fatal is None

    async def connect(self, timeout: float = 30.0) -> Ready:
        """Handshake; raises EngineError on a version mismatch or when no Ready comes in time."""
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_INBOUND_FRAME_BYTES)
        if self.curve_keys:
            connect_curve(self._sock, self.curve_keys)
        self._sock.connect(self.address)
        self._send(Hello(PROTOCOL_VERSION, self.client_name))
        deadline = time.monotonic() + timeout
        while self.ready is None:
            left = deadline - time.monotonic()
            if left <= 0 or not await self._sock.poll(int(left * 1000)):
                await self._teardown()
                raise EngineError(ERR_CONNECT_TIMEOUT, f"no answer from the engine-core at {self.address} "
                                                       f"within {timeout:.1f} s")
            msg = self._decode(await self._sock.recv())
            if isinstance(msg, Ready):
                self.ready = msg
            elif isinstance(msg, Error):
                await self._teardown()
                raise EngineError(msg.code, msg.message)
        self._clock = RunningClock(2 * HEARTBEAT_S)
        self._last_rx = self._clock.now()
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._tasks = [asyncio.ensure_future(self._recv_loop()), asyncio.ensure_future(self._heartbeat_loop()),
                       asyncio.ensure_future(self._disconnect_loop())]
        return self.ready

    async def close(self) -> None:
        """Stop the background tasks, fail what is pending, close the socket."""
        self._fail_all(EngineError(ERR_CLOSED, "the client was closed"))
        await self._teardown()

    # ----------------------------------------------------------------------------- internals

    def _send(self, msg: Hello | Abort | Hold | Heartbeat | UtilityCall) -> None:
        self._send_frame(self._codec.encode(msg))

    def _send_frame(self, frame: bytes) -> None:
        # DEALER with an unbounded queue never blocks, so no await: safe inside finally blocks.
        assert self._sock is not None
        self._sock.send(frame, copy=False)

    def _say_hello_again(self) -> None:
        self.rehellos += 1
        self._send(Hello(PROTOCOL_VERSION, self.client_name))

    def _decode(self, frame: bytes) -> EngineToFrontend | None:
        try:
            return self._codec.decode(frame)
        except DecodeError as e:
            log.error("undecodable frame from the engine-core: %s", e)
            return None

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while True:
            msg = self._decode(await self._sock.recv())
            self._last_rx = self._clock.now()
            if isinstance(msg, Outputs):
                if msg.stats is not None:
                    self.stats = msg.stats
                orphans = []
                for out in msg.outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        # Nobody reads it: a stream failed while the engine-core was silent past
                        # --engine-timeout (paused, not dead) runs on there. Abort it: its KV is freed.
                        if out.finish_reason is None:
                            orphans.append(out.request_id)
                    elif not stream.reader.gave_up:
                        stream.got_output = True
                        stream.queue.put_nowait(out)
                        if should_hold(stream.reader, stream.queue.qsize()):
                            stream.reader.held_since = self._clock.now()
                            self.holds += 1
                            self._send(Hold([out.request_id], True))
                if orphans:
                    self._send(Abort(orphans))
                if self.on_outputs is not None:
                    self.on_outputs(msg)
            elif isinstance(msg, Error):
                self._on_error(msg)
            elif isinstance(msg, Ready):
                self._on_ready_again(msg)
            elif isinstance(msg, UtilityResult):
                fut = self._calls.get(msg.call_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def _on_error(self, err: Error) -> None:
        if err.request_id is not None and err.request_id in self._streams:
            self._streams[err.request_id].queue.put_nowait(EngineError(err.code, err.message, err.request_id))
        elif err.fatal:
            log.error("engine-core: %s", err.message)
            if self.ready is not None:  # that engine is going away: a Ready from it is not a recovery
                self._dead_engine_id = self.ready.engine_id
            self._fail_all(EngineError(err.code, err.message))
        elif err.code in (ERR_CLIENT_DROPPED, ERR_NOT_READY) and self._fatal is None:
            # The engine dropped us (our loop stalled past its client timeout) or restarted: what
            # already streamed was aborted there and fails; say Hello again, then resubmit the rest.
            # (While failed, these answer stale frames queued before our Hello: the Hello is out.)
            if not self._rehello:
                log.warning("engine-core forgot this client (%s): saying hello again", err.message)
                self._rehello = True
                lost = EngineError(err.code, f"the engine-core dropped this client mid-request: {err.message}")
                for stream in self._streams.values():
                    if stream.got_output:
                        stream.queue.put_nowait(lost)
                self._say_hello_again()
        else:
            log.warning("engine-core error [%s]: %s", err.code, err.message)

    def _on_ready_again(self, ready: Ready) -> None:
        if self._fatal is not None:
            if ready.engine_id == self._dead_engine_id:
                return
            log.info("engine-core at %s is back (engine id %s): serving again", self.address, ready.engine_id)
            self.ready = ready
            self._fatal = None
            self._dead_engine_id = None
            self.reconnects += 1
            self._revived.set()
            return
        self.ready = ready
        if self._rehello:
            self._rehello = False
            for stream in self._streams.values():
                if not stream.got_output:
                    self._send_frame(stream.frame)

    async def _heartbeat_loop(self) -> None:
        while True:
            if self._fatal is not None:
                await self._say_hello_until_ready()
                self._last_rx = self._clock.now()
                self._send(Heartbeat())
                continue
            await asyncio.sleep(HEARTBEAT_S)
            silent = self._clock.now() - self._last_rx
            # Frames already queued mean our own loop was stalled, not that the engine went away.
            pending = self._sock is not None and bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
            if silent > self.engine_timeout and not pending:
                self._fail_all(EngineError(ERR_ENGINE_DEAD, f"no message from the engine-core at {self.address} "
                                                            f"for {silent:.1f} s (--engine-timeout "
                                                            f"{self.engine_timeout:g} s): it hangs or is unreachable"))
                continue
            if self._fatal is None:
                self._send(Heartbeat())
                self._abort_stuck_readers()

    def _abort_stuck_readers(self) -> None:
        now = self._clock.now()
        stuck = [rid for rid, s in self._streams.items() if is_stuck(s.reader, now, self.stuck_reader_timeout)]
        if not stuck:
            return
        log.warning("aborting %d request(s) whose readers took nothing for %g s (their KV is freed)",
                    len(stuck), self.stuck_reader_timeout)
        self._send(Abort(stuck))
        for rid in stuck:
            stream = self._streams[rid]
            stream.reader.gave_up = True
            stream.queue.put_nowait(EngineError(ERR_REQUEST_TIMEOUT, f"request {rid!r} was aborted: its reader took "
                                                f"no output for {self.stuck_reader_timeout:g} s", rid))

    async def _disconnect_loop(self) -> None:
        """A closed connection is a dead (or restarting) engine-core: fail its requests at once."""
        assert self._monitor is not None and self._sock is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            for _ in range(100):  # what the engine sent before it went is read first
                if not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    break
                await asyncio.sleep(0.001)
            if self._fatal is None:
                log.warning("engine-core at %s closed its connection", self.address)
                self._fail_all(EngineError(ERR_ENGINE_DEAD, f"the engine-core at {self.address} closed its "
                                                            f"connection: it exited or restarted"))

    async def _say_hello_until_ready(self) -> None:
        """After a failure: Hello with backoff until ``_on_ready_again`` accepts a Ready."""
        delay = RECONNECT_MIN_S
        while self._fatal is not None:
            self._revived.clear()
            try:
                await asyncio.wait_for(self._revived.wait(), delay)
                return
            except asyncio.TimeoutError:
                pass
            if self._fatal is not None:
                self._say_hello_again()
                delay = min(2 * delay, RECONNECT_MAX_S)

    def _fail_pending(self, error: EngineError) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(error)

    def _fail_all(self, error: EngineError) -> None:
        if self._fatal is None:
            self._fatal = error
        self._rehello = False  # every stream fails now: nothing is left to resubmit
        self._fail_pending(error)

    async def _teardown(self) -> None:
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        for task in self._tasks:
            if task is not current:
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        self._tasks = []
        if self._monitor is not None and self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._monitor = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
