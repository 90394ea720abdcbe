"""Step inputs from numpy to the device: through pinned host buffers, with non-blocking copies.

A copy from pageable memory is synchronous in effect (the driver stages it through a pinned
buffer of its own and waits). Each named input keeps a pinned buffer that grows as needed; the
numpy array is copied into it and a non-blocking copy to the device is queued on the stream, so
the host goes on building the step while the copies run. A buffer is refilled only after the
copies that read it have run (an event recorded after the last copy of a step, waited on at the
start of the next), so the host never overwrites memory a queued copy still reads. On the CPU the
numpy array is wrapped without a copy.
"""

from __future__ import annotations

import numpy as np
import torch


class HostStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None

    def begin(self) -> None:
        """Start a step: wait until the previous step's copies have read their buffers."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def to_device(self, name: str, array: np.ndarray) -> torch.Tensor:
        """``array`` as a tensor on the device (queued, non-blocking)."""
        host = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cpu":
            return host
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < host.numel() or buffer.dtype != host.dtype:
            size = max(host.numel(), 2 * (buffer.numel() if buffer is not None else 0), 1024)
            # A replaced buffer may still be read by a queued copy: torch's pinned-memory
            # allocator keeps it until the stream is past that copy.
            buffer = torch.empty(size, dtype=host.dtype, pin_memory=self._pin)
            self._buffers[name] = buffer
        staged = buffer[: host.numel()].view(host.shape)
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)

    def end(self) -> None:
        """The step's copies are queued: mark the point after which its buffers are free again."""
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
