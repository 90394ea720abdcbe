"""A minimal progress bar on stderr for offline batches (no tqdm dependency)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``Processed prompts: 37/100 [00:03, 12.1 it/s]``, redrawn at most 10 times a second."""

    def __init__(self, total: int, enabled: bool = True, label: str = "Processed prompts") -> None:
        self.total = total
        self.enabled = enabled and total > 0
        self.label = label
        self.done = 0
        self.start = time.monotonic()
        self._last_draw = 0.0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last_draw >= 0.1 or self.done >= self.total):
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = now - self.start
        width = 30
        filled = int(width * self.done / self.total)
        rate = self.done / elapsed if elapsed > 0 else 0.0
        sys.stderr.write(f"\r{self.label}: {self.done}/{self.total} [{'#' * filled}{'.' * (width - filled)}] "
                         f"{elapsed:.1f}s, {rate:.1f} it/s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            sys.stderr.write("\n")
