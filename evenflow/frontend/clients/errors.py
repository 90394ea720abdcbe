"""EngineError and the client-side error codes (the engine's own codes are in evenflow.protocol.messages)."""

from __future__ import annotations

ERR_ENGINE_DEAD = "engine_dead"  # its connection closed, or no frame from it for --engine-timeout
ERR_CONNECT_TIMEOUT = "connect_timeout"
ERR_CLOSED = "client_closed"
ERR_NOT_CONNECTED = "not_connected"  # used before connect() succeeded (or when it failed)


class EngineError(Exception):
    """An error from (or about) the engine. ``code`` is one of the protocol's error codes."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
