"""Chat templates: render a list of messages to the prompt text, with jinja2 as HF does.

The environment matches what HuggingFace templates rely on: a sandbox, ``trim_blocks`` and
``lstrip_blocks``, a ``tojson`` filter that keeps non-ASCII, ``raise_exception`` and
``strftime_now``. Compiled templates are cached per template string.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """No template, or the template refused the messages (shown to the client as a 400)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None


def render_chat(
    template: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    extra_context: Mapping[str, Any] | None = None,
    continue_final_message: bool = False,
) -> str:
    """The prompt text for ``messages`` (dicts with ``role`` and ``content``).

    ``extra_context`` (a request's ``chat_template_kwargs``) adds template variables; it never
    overrides ``messages``, ``add_generation_prompt``, ``bos_token`` or ``eos_token``. Any failure
    of the template is a ChatTemplateError (a 400), whatever the template raised.
    ``continue_final_message`` leaves the last message open (``continue_open``).
    """
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("set add_generation_prompt to false with continue_final_message: a new turn "
                                "cannot start while the last message goes on")
    if not template:
        raise ChatTemplateError(
            "this model has no chat template; use /v1/completions or start the server with --chat-template FILE"
        )
    context: dict[str, Any] = dict(extra_context or {})
    context.update(messages=messages, add_generation_prompt=add_generation_prompt,
                   bos_token=bos_token or "", eos_token=eos_token or "")
    compiled = _compile(template)
    try:
        text = compiled.render(context)
        return continue_open(text, messages[-1].get("content") if messages else None) if continue_final_message else text
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None
    except Exception as e:  # a filter or method raising on user data (TypeError, KeyError, ...)
        raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None


def continue_open(rendered: str, final_content: Any) -> str:
    """``rendered`` cut just after the final message's text, so that the model continues that
    message: transformers' ``continue_final_message`` rule (the text stripped, found last)."""
    final = (final_content or "").strip() if isinstance(final_content, str) else ""
    if not final or final not in rendered:
        raise ChatTemplateError("continue_final_message needs a final message with text that the chat template "
                                "renders as written")
    return rendered[:rendered.rindex(final) + len(final)]


def content_text(content: Any) -> str:
    """OpenAI message content is a string or a list of parts; only text parts are supported, and
    they are joined with a newline, as vLLM joins them."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        else:
            raise ChatTemplateError("only text content parts are supported")
    return "\n".join(parts)
