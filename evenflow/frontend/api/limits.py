"""Limits on what one HTTP request may ask of a frontend, checked before the work they bound
(the stop strings' limits are evenflow/frontend/choices.py's, shared with the offline LLM).

Each rule refuses with a 400 naming the limit, so one legal-looking request cannot hold the event
loop (which also serves every other stream and keeps the engine link alive) for seconds.
"""

from __future__ import annotations

import numpy as np

from evenflow.frontend.api.errors import APIError

MAX_JSON_DEPTH = 64  # nesting of arrays/objects in a body; OpenAI's bodies need fewer than 10
MAX_PROMPTS = 1024  # prompts in one /v1/completions body
MAX_CHOICES = 1024  # engine requests of one API request: prompts x n
MAX_CHAT_MESSAGES = 4096  # messages of one chat request; the template's cost grows with each

_CHUNK = 1 << 20  # bytes scanned at once (bounds the scan's temporary arrays)


def json_depth(body: bytes) -> int:
    """Deepest nesting of ``[`` / ``{`` in a JSON text; brackets inside strings do not count.

    Linear and in C: escaped backslashes and quotes are cut out first, so every quote left opens or
    closes a string, and numpy counts quotes (parity = inside a string) and brackets outside them."""
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    depth = deepest = 0
    inside = False
    for at in range(0, len(text), _CHUNK):
        codes = np.frombuffer(text, dtype=np.uint8, count=min(_CHUNK, len(text) - at), offset=at)
        quotes = np.cumsum(codes == ord('"')) + inside
        outside = (quotes & 1) == 0
        steps = (((codes == ord("[")) | (codes == ord("{"))).astype(np.int64)
                 - ((codes == ord("]")) | (codes == ord("}"))))
        levels = np.cumsum(np.where(outside, steps, 0)) + depth
        deepest = max(deepest, int(levels.max()))
        depth, inside = int(levels[-1]), bool(quotes[-1] & 1)
    return deepest


def check_json_depth(body: bytes) -> None:
    # Only a body with that many brackets can be that deep: most skip the scan.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and (depth := json_depth(body)) > MAX_JSON_DEPTH:
        raise APIError(400, f"the JSON body is nested {depth} levels deep, over the limit of {MAX_JSON_DEPTH}")


def check_num_prompts(count: int) -> None:
    if count > MAX_PROMPTS:
        raise APIError(400, f"prompt holds {count} prompts, over the limit of {MAX_PROMPTS} per request", "prompt")


def check_num_messages(count: int) -> None:
    if count > MAX_CHAT_MESSAGES:
        raise APIError(400, f"messages holds {count} messages, over the limit of {MAX_CHAT_MESSAGES} per request",
                       "messages")


def check_num_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise APIError(400, f"{num_prompts} prompt(s) x n={n} asks for {num_prompts * n} choices, over the "
                            f"limit of {MAX_CHOICES} per request", "n")
