"""How long the model's forward pass took: on CUDA the kernels' own time, not their launch time.

CUDA kernels run asynchronously, so the host's clock after ``model(...)`` measures launches. On
CUDA a pair of events brackets the forward on the stream; ``seconds()`` waits for the end event
(a synchronization on that event only) and reads the elapsed device time. The runner reads it
after the step's one host synchronization (copying the sampled ids to the host), by which time
the event has completed and the wait costs nothing. On the CPU the host clock is the truth.
"""

from __future__ import annotations

import time

import torch


class ForwardTimer:
    def __init__(self, device: torch.device) -> None:
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._t0 = 0.0
        self._host_s = 0.0

    def start(self) -> None:
        if self._events is not None:
            self._events[0].record()
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        self._host_s = time.perf_counter() - self._t0

    def seconds(self) -> float:
        """The last forward's duration (on CUDA this waits until it has finished)."""
        if self._events is None:
            return self._host_s
        start, end = self._events
        end.synchronize()
        return start.elapsed_time(end) / 1e3
