"""Backpressure from a slow reader to the engine: bounded per-request output buffers.

A request's outputs wait in its stream's queue until its reader (an HTTP client's SSE stream, an
offline caller) takes them. Past ``HOLD_AFTER`` unread outputs the client sends ``hold`` and the
engine stops scheduling that request, keeping its KV blocks; once the reader is down to
``RELEASE_BELOW`` the client releases it. A request held longer than ``stuck_reader_timeout`` is
aborted: its KV is freed for readers that read, and its reader, should it come back, gets an error.
"""

from __future__ import annotations

from dataclasses import dataclass

HOLD_AFTER = 32
RELEASE_BELOW = 8
DEFAULT_STUCK_READER_TIMEOUT_S = 60.0


@dataclass
class ReaderState:
    """One stream's backpressure state (times on the client's running clock)."""

    held_since: float | None = None
    gave_up: bool = False  # aborted as a stuck reader: later outputs are dropped


def should_hold(state: ReaderState, unread: int) -> bool:
    return state.held_since is None and not state.gave_up and unread >= HOLD_AFTER


def should_release(state: ReaderState, unread: int) -> bool:
    return state.held_since is not None and not state.gave_up and unread < RELEASE_BELOW


def is_stuck(state: ReaderState, now: float, timeout_s: float) -> bool:
    return state.held_since is not None and not state.gave_up and now - state.held_since > timeout_s
