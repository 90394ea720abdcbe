"""msgpack encoders/decoders for each direction, with a frame size limit.

Decoding is strict: msgspec validates types and tags while it parses, so a frame is either a
well-typed message or a ``DecodeError`` carrying a readable reason. Nothing else is accepted.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

from evenflow.protocol.messages import EngineToFrontend, FrontendToEngine
from evenflow.protocol.worker_messages import EngineToWorker, WorkerToEngine
from evenflow.protocol.wire_errors import explain, structs_by_tag

T = TypeVar("T")

# A frame larger than this is refused before parsing: 64 MiB fits a 1M-token prompt as msgpack.
MAX_FRAME_BYTES = 64 * 1024 * 1024


class DecodeError(ValueError):
    """A frame that is not a valid message of the expected union."""


class Codec(Generic[T]):
    """Encode any message; decode only the union ``T`` this side expects to receive."""

    def __init__(self, recv_type: object, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(recv_type)
        self._by_tag = structs_by_tag(recv_type)
        self.max_frame_bytes = max_frame_bytes

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, frame: bytes | memoryview) -> T:
        if len(frame) > self.max_frame_bytes:
            raise DecodeError(f"frame of {len(frame)} bytes exceeds the limit of {self.max_frame_bytes}")
        try:
            return self._decoder.decode(frame)
        except msgspec.DecodeError as e:
            raise DecodeError(explain(str(e), frame, self._by_tag)) from None


def engine_codec(max_frame_bytes: int = MAX_FRAME_BYTES) -> Codec[FrontendToEngine]:
    """The engine-core's codec for the frontend link (receives FrontendToEngine; a ``request``
    with a readable id but bad fields raises ``RequestRefused`` carrying that id)."""
    from evenflow.protocol.request_envelope import EngineCodec  # it subclasses Codec

    return EngineCodec(max_frame_bytes)


def frontend_codec() -> Codec[EngineToFrontend]:
    """A frontend's codec (receives EngineToFrontend)."""
    return Codec(EngineToFrontend)


def worker_codec() -> Codec[EngineToWorker]:
    """A worker's codec (receives EngineToWorker)."""
    return Codec(EngineToWorker)


def engine_worker_codec() -> Codec[WorkerToEngine]:
    """The engine-core's codec for the worker link (receives WorkerToEngine)."""
    return Codec(WorkerToEngine)
