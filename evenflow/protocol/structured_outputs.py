"""One definition of what a ``StructuredOutputsParams`` means as a grammar, for both ends.

The frontend calls ``grammar_error`` to refuse a bad schema/regex with a 400 before it reaches the
engine; the engine-core calls ``to_grammar`` to compile. Both go through llguidance (picked by
measurement, see docs/structured_output.md), an optional dependency: ``import_llguidance`` raises
``MissingGrammarLibrary`` naming the extra to install when it is absent. llguidance is imported
lazily, so nothing else in ``protocol`` needs it.
"""

from __future__ import annotations

import functools
import json
from types import ModuleType

from evenflow.protocol.messages import StructuredOutputsParams

GRAMMAR_EXTRA = "structured"
MISSING_LIBRARY_MESSAGE = (
    f"structured output (response_format, structured_outputs, guided_*) needs the llguidance library: "
    f"install it with pip install 'evenflow[{GRAMMAR_EXTRA}]'"
)
# What "any JSON object" means for json_object (OpenAI's {"type": "json_object"}).
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Bounds (seconds) of the grammar compile histogram: SchedulerStats.grammar.compile_buckets counts
# compiles per bucket (one more for +Inf), rendered as evenflow:grammar_compile_seconds.
COMPILE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LABELS = {"json": "json schema", "grammar": "lark grammar"}


class MissingGrammarLibrary(ImportError):
    """llguidance is not installed; the message names the extra that brings it."""


def import_llguidance() -> ModuleType:
    try:
        import llguidance
    except ImportError:
        raise MissingGrammarLibrary(MISSING_LIBRARY_MESSAGE) from None
    return llguidance


def to_grammar(kind: str, spec: str) -> str:
    """llguidance's grammar text for ``(kind, spec)`` as ``StructuredOutputsParams.kind_and_spec``
    returns them. Raises ValueError with the compiler's message for a bad schema, regex or grammar."""
    ll = import_llguidance()
    matcher = ll.LLMatcher
    try:
        if kind == "json":
            grammar = matcher.grammar_from_json_schema(spec)
        elif kind == "json_object":
            grammar = matcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA)
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(spec)
        elif kind == "choice":
            choices = json.loads(spec)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise ValueError("choice must be a non-empty list of strings")
            # Lark string literals take JSON escapes, so json.dumps quotes any choice exactly.
            grammar = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        elif kind == "grammar":
            grammar = matcher.grammar_from_lark(spec)
        else:
            raise ValueError(f"unknown structured output kind {kind!r}")
    except ValueError:
        raise
    except Exception as e:  # llguidance reports a bad JSON text or lark syntax with its own types
        raise ValueError(f"invalid {_LABELS.get(kind, kind)}: {e}") from None
    is_error, messages = matcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        raise ValueError(f"invalid {_LABELS.get(kind, kind)}: {'; '.join(messages)}")
    return grammar


def grammar_error(params: StructuredOutputsParams) -> str | None:
    """The compiler's message when ``params`` is unusable, None when it compiles.

    Raises ``MissingGrammarLibrary`` when llguidance is absent.
    """
    import_llguidance()  # before the cache: a spec checked earlier still needs the library now
    try:
        kind_spec = params.kind_and_spec()
    except ValueError as e:
        return str(e)
    if kind_spec is None:
        return "structured_outputs sets no constraint: set one of json, regex, choice, grammar, json_object"
    return _spec_error(*kind_spec)


@functools.lru_cache(maxsize=256)
def _spec_error(kind: str, spec: str) -> str | None:
    """Cached per spec: a frontend sees the same schemas again and again."""
    try:
        if kind == "json":
            json.loads(spec)  # a clearer message than the compiler's for non-JSON text
        to_grammar(kind, spec)
    except json.JSONDecodeError as e:
        return f"invalid json schema: {e}"
    except ValueError as e:
        return str(e)
    return None
