"""How both ends of a link judge a silent peer: on the judge's own running time.

A process that was paused (SIGSTOP, ``docker pause``, a long GC, VM steal, swap) must not count its
own pause as the peer's silence: on waking, what the peer sent meanwhile is still in the socket.
``RunningClock`` advances by the real time between two observations, but by at most ``max_step``:
a loop that observes it every ``tick`` seconds sees a gap far larger than that only when it did not
run. Real death is noticed another way (a ZMQ disconnect event, a process sentinel), in
milliseconds; the silence timeouts are for hangs and partitions, so they default to tens of seconds.
A socket is read with ``recv_ready``, never a blocking recv after a poll: a link that drops between
the two can take back the message the poll saw, and the recv then waits forever (a two-host engine
did, with its worker links' ZMQ heartbeats on).
"""

from __future__ import annotations

import time

import zmq

# Defaults of the silence timeouts (the engine's --client-timeout, the frontend's --engine-timeout).
DEFAULT_SILENCE_TIMEOUT_S = 30.0


class RunningClock:
    """Seconds this process has been running, as seen by one loop that calls ``now()`` often."""

    def __init__(self, max_step: float) -> None:
        if max_step <= 0:
            raise ValueError(f"max_step must be positive, got {max_step}")
        self.max_step = max_step
        self._last_real = time.monotonic()
        self._running = 0.0
        self.paused_s = 0.0  # real time discounted as our own pauses (for logs and tests)

    def now(self) -> float:
        """Running seconds since construction; a gap over ``max_step`` counts as ``max_step``."""
        real = time.monotonic()
        step = real - self._last_real
        self._last_real = real
        if step > self.max_step:
            self.paused_s += step - self.max_step
            step = self.max_step
        self._running += step
        return self._running


def recv_ready(sock: zmq.Socket, timeout_ms: int) -> zmq.Frame | None:
    """The socket's next message, waiting up to ``timeout_ms``; None if none came (module docstring)."""
    if not sock.poll(timeout_ms):
        return None
    try:
        return sock.recv(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
