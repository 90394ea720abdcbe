"""Two-stage decoding of a frontend's refused ``request``, so the refusal can name the request.

Stage 1 decodes the frame against the frontend union with ``request`` replaced by an envelope:
the same tag and arity, ``request_id`` a string, every other field kept as raw msgpack bytes (a
zero-copy view). Anything wrong here (garbage bytes, unknown tag, arity, a non-string id) is a
``DecodeError``: the id cannot be read. Stage 2 decodes each raw field with its real type from
``AddRequest``; a failure there is a ``RequestRefused`` carrying the id and the field's name.
"""

from __future__ import annotations

import typing

import msgspec

from evenflow.protocol.codec import Codec, DecodeError
from evenflow.protocol.messages import AddRequest, FrontendToEngine
from evenflow.protocol.wire_errors import in_field


class RequestRefused(DecodeError):
    """A ``request`` whose id was read but whose other fields are not valid."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(reason)
        self.request_id = request_id


def _envelope_of(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """``cls`` with its first field (the id) kept and the others raw; an omitted field is None
    (and takes ``cls``'s own default). Derived, so a field added to ``cls`` is carried too."""
    first, *rest = msgspec.structs.fields(cls)
    fields: list[tuple] = [(first.name, first.type)]
    fields += [(f.name, msgspec.Raw) if f.required else (f.name, msgspec.Raw, None) for f in rest]
    config = cls.__struct_config__
    return msgspec.defstruct(f"{cls.__name__}Envelope", fields, tag=config.tag, array_like=True,
                             forbid_unknown_fields=True)


RequestEnvelope = _envelope_of(AddRequest)
_FIELD_DECODERS = {f.name: msgspec.msgpack.Decoder(f.type) for f in msgspec.structs.fields(AddRequest)[1:]}
_WIRE_UNION = typing.Union[tuple(RequestEnvelope if t is AddRequest else t  # type: ignore[misc]
                                 for t in typing.get_args(FrontendToEngine))]


def open_envelope(envelope: msgspec.Struct) -> AddRequest:
    """Stage 2: the typed ``AddRequest``, or ``RequestRefused`` naming the first bad field."""
    request_id: str = envelope.request_id  # type: ignore[attr-defined]
    values = {}
    for name, decoder in _FIELD_DECODERS.items():
        raw = getattr(envelope, name)
        if raw is None:
            continue
        try:
            values[name] = decoder.decode(raw)
        except msgspec.DecodeError as e:
            raise RequestRefused(request_id, in_field(str(e), name)) from None
    return AddRequest(request_id, **values)


class EngineCodec(Codec[FrontendToEngine]):
    """The engine-core's frontend codec. A valid frame is decoded in one pass, as by a plain
    ``Codec``; only a refused one is decoded again in two stages (see the module doc), to find
    the request id, so the common path costs nothing extra."""

    def __init__(self, max_frame_bytes: int) -> None:
        super().__init__(FrontendToEngine, max_frame_bytes)
        self._envelopes: Codec[FrontendToEngine] = Codec(_WIRE_UNION, max_frame_bytes)

    def decode(self, frame: bytes | memoryview) -> FrontendToEngine:
        try:
            return super().decode(frame)
        except DecodeError as whole:
            try:
                msg = self._envelopes.decode(frame)
            except DecodeError:
                raise whole from None  # not even the envelope decodes: the id cannot be read
            return open_envelope(msg) if isinstance(msg, RequestEnvelope) else msg
