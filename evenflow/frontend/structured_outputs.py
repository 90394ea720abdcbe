"""Structured output constraints as the engine takes them, shared by the HTTP server and ``LLM``:
a schema as canonical JSON text (the engine caches compiles by it) and a compile check, so a bad
schema, regex or grammar never reaches the engine."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from evenflow.protocol import StructuredOutputsParams
from evenflow.protocol.structured_outputs import MissingGrammarLibrary, grammar_error

from evenflow.frontend.choices import InvalidRequest


def canonical_json(schema: Any, field: str) -> str:
    """A schema (an object, or its JSON text) as compact JSON text, its keys in the order written:
    the engine caches compiles by this text, and the grammar emits an object's properties in the
    order the schema declares them (sorting would reorder every generated object)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"{field} is not valid JSON: {e}", field) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(f"{field} must be a JSON schema (an object)", field)
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def check_structured_outputs(params: StructuredOutputsParams, field: str) -> StructuredOutputsParams:
    """``params`` if llguidance compiles it; else a 400 with the compiler's message."""
    try:
        problem = grammar_error(params)
    except MissingGrammarLibrary as e:
        raise InvalidRequest(str(e), field) from None
    if problem is not None:
        raise InvalidRequest(problem, field)
    return params


def offline_structured_outputs(params: StructuredOutputsParams) -> StructuredOutputsParams:
    """For ``LLM``: accept ``json`` as an object (as vLLM does), serialize it canonically, and
    compile-check; a problem is a ValueError (``InvalidRequest``) with the compiler's message."""
    if params.json is not None and not isinstance(params.json, str):
        params = msgspec.structs.replace(params, json=canonical_json(params.json, "structured_outputs.json"))
    return check_structured_outputs(params, "structured_outputs")
