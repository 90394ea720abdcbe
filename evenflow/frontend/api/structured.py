"""Structured output fields of an OpenAI request -> the engine's ``StructuredOutputsParams``.

Accepted, as vLLM does: OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``),
vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) and the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``. At most one constraint per request. Every constraint is compiled here first
(llguidance, in a worker thread: never on the event loop), so a bad schema, regex or grammar is a 400 carrying
the compiler's message and never reaches the engine; without llguidance installed it is a 400
naming the extra to install.
"""

from __future__ import annotations

import asyncio
from typing import Any


from evenflow.protocol import StructuredOutputsParams

from evenflow.frontend.api.errors import bad_request
from evenflow.frontend.structured_outputs import canonical_json, check_structured_outputs

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _from_response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = rf.get("type", "text")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}",
                          "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format of type json_schema needs a json_schema object "
                          '({"name": ..., "schema": {...}, "strict": true})', "response_format")
    # OpenAI makes ``schema`` optional; without one any JSON value is allowed. ``strict`` is
    # accepted and always holds: the grammar is enforced token by token.
    return StructuredOutputsParams(json=canonical_json(spec.get("schema", {}), "response_format.json_schema.schema"))


def _from_structured_outputs(so: dict[str, Any]) -> StructuredOutputsParams:
    unknown = sorted(set(so) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise bad_request(f"structured_outputs: unsupported key(s) {', '.join(unknown)} "
                          f"(supported: {', '.join(STRUCTURED_OUTPUTS_KEYS)})", "structured_outputs")
    return _params(so.get("json"), so.get("regex"), so.get("choice"), so.get("grammar"),
                   bool(so.get("json_object", False)), "structured_outputs")


def _params(json_schema: Any, regex: Any, choice: Any, grammar: Any, json_object: bool,
            field: str) -> StructuredOutputsParams:
    if regex is not None and not isinstance(regex, str):
        raise bad_request(f"{field}: regex must be a string", field)
    if grammar is not None and not isinstance(grammar, str):
        raise bad_request(f"{field}: grammar must be a string", field)
    if choice is not None and (not isinstance(choice, list) or not choice
                               or not all(isinstance(c, str) for c in choice)):
        raise bad_request(f"{field}: choice must be a non-empty list of strings", field)
    return StructuredOutputsParams(
        json=None if json_schema is None else canonical_json(json_schema, field),
        regex=regex, choice=choice, grammar=grammar, json_object=json_object)


def structured_outputs_of(req: Any) -> tuple[StructuredOutputsParams, str] | None:
    """The request's one constraint and the field that set it, None for free text."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        params = _from_response_format(rf)
        if params is not None:
            found.append((params, "response_format"))
    if getattr(req, "structured_outputs", None) is not None:
        found.append((_from_structured_outputs(req.structured_outputs), "structured_outputs"))
    for field in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(req, field, None)
        if value is not None:
            kind = field.removeprefix("guided_")
            found.append((_params(value if kind == "json" else None, value if kind == "regex" else None,
                                  value if kind == "choice" else None, value if kind == "grammar" else None,
                                  False, field), field))
    if len(found) > 1:
        raise bad_request(f"set only one structured output constraint, got {', '.join(f for _, f in found)}",
                          found[1][1])
    return found[0] if found else None


async def structured_outputs_async(req: Any) -> StructuredOutputsParams | None:
    """``structured_outputs_of`` + ``check_structured_outputs``, the compile in a worker thread:
    even a small schema can take tens of ms to validate, and the event loop feeds every stream."""
    found = structured_outputs_of(req)
    if found is None:
        return None
    return await asyncio.to_thread(check_structured_outputs, *found)
