"""Decode errors in the wire's words: field names and counts as evenflow/protocol/README.md states them.

msgspec reports positions (``$[3].max_tokens``) and counts arity inconsistently for tagged arrays
(the tag counts in "at least length 3, got 2" but not in "at most length 5, got 6"). A client
reads the README, not msgspec, so these helpers name fields and count elements after the tag.
"""

from __future__ import annotations

import re
import typing

import msgspec

from evenflow.protocol.messages import INT64_MAX, INT64_MIN

_ARITY = re.compile(r"^Expected `array` of at (?:least|most) length \d+, got \d+$")
_AT = re.compile(r"^(?P<reason>.*?) - at `\$(?P<path>[^`]*)`$", re.S)
_INDEX = re.compile(r"^\[(\d+)\]")
_ELEMENTS = msgspec.msgpack.Decoder(list[msgspec.Raw])
_TAG = msgspec.msgpack.Decoder(str)
_INT64_HINT = " (integers on the wire are int64)"


def structs_by_tag(recv_type: object) -> dict[str, type[msgspec.Struct]]:
    """The tagged Structs of a union (or of one Struct type), by their wire tag."""
    members = typing.get_args(recv_type) or (recv_type,)
    return {cls.__struct_config__.tag: cls for cls in members
            if isinstance(cls, type) and issubclass(cls, msgspec.Struct) and cls.__struct_config__.tag}


def field_names(cls: type[msgspec.Struct]) -> list[str]:
    return [f.name for f in msgspec.structs.fields(cls)]


def arity_message(tag: str, cls: type[msgspec.Struct], got: int) -> str:
    """The one wording for too few and too many fields: both count the elements after the tag."""
    fields = msgspec.structs.fields(cls)
    required = sum(f.required for f in fields)
    span = str(required) if required == len(fields) else f"{required} to {len(fields)}"
    names = ", ".join(f.name for f in fields) or "none"
    return f"`{tag}` takes {span} fields after its tag ({names}), got {got}"


def with_int64_hint(reason: str) -> str:
    """msgspec's words made the README's (a msgpack map, a key), plus why an int was refused."""
    reason = reason.replace("Object contains unknown field", "unknown key").replace("`object`", "`map`")
    return reason + _INT64_HINT if str(INT64_MAX) in reason or str(INT64_MIN) in reason else reason


def in_field(reason: str, field: str) -> str:
    """``Expected `int`, got `float` - at `$.max_tokens``` decoded as ``field`` ->
    ``field.max_tokens: Expected `int`, got `float```."""
    m = _AT.match(reason)
    if m is None:
        return f"{field}: {with_int64_hint(reason)}"
    return f"{field}{m['path']}: {with_int64_hint(m['reason'])}"


def explain(reason: str, frame: bytes | memoryview, by_tag: dict[str, type[msgspec.Struct]]) -> str:
    """Reword msgspec's ``reason`` for a top-level tagged-array ``frame``: arity counted after the
    tag, positions named by field (``$[1]`` of a ``request`` is ``request_id``)."""
    try:  # only on the error path: a second, shallow parse of the frame's top level
        elements = _ELEMENTS.decode(frame)
        tag = _TAG.decode(elements[0])
    except (msgspec.DecodeError, IndexError):
        return reason
    cls = by_tag.get(tag)
    if cls is None:
        return f"unknown tag {tag!r} (this side receives: {', '.join(sorted(by_tag))})" if by_tag else reason
    if _ARITY.match(reason):
        return arity_message(tag, cls, len(elements) - 1)
    m = _AT.match(reason)
    index = _INDEX.match(m["path"]) if m is not None else None
    if m is None or index is None:
        return with_int64_hint(reason)
    position = int(index[1])
    names = field_names(cls)
    if not 1 <= position <= len(names):
        return with_int64_hint(reason)
    rest = m["path"][index.end():]
    return f"`{tag}` field {names[position - 1]}{rest}: {with_int64_hint(m['reason'])}"
