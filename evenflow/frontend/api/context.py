"""What every HTTP handler needs: the engine client, tokenizer, model facts, metrics, settings."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.types import Receive

from evenflow.protocol import ERR_OVERLOADED, ERR_REQUEST_TIMEOUT, ERR_UNKNOWN_LORA_ADAPTER, AdapterRef

from evenflow.frontend.lora_adapters import LoRAAdapters
from evenflow.frontend.metrics import FrontendMetrics
from evenflow.frontend.tokenizer import Tokenizer
from evenflow.frontend.api.errors import APIError, field_from_decode_error
from evenflow.frontend.api.limits import MAX_JSON_DEPTH, check_json_depth
from evenflow.frontend.generation import Generation
from evenflow.frontend.api.prepare import check_model
from evenflow.frontend.api.sse import ClientDisconnected, run_until_disconnect


@dataclass
class ServingContext:
    client: Any  # EngineClient (duck-typed so tests can use a fake)
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    vocab_size: int
    metrics: FrontendMetrics
    api_key: str | None = None
    model_root: str | None = None
    max_body_bytes: int = 0  # set from ServerConfig (DEFAULT_MAX_BODY_BYTES); 0 = the default
    created: int = field(default_factory=lambda: int(time.time()))
    model_aliases: tuple[str, ...] = ()  # other names requests may use (the folder's base name)
    lora: LoRAAdapters = field(default_factory=LoRAAdapters)  # adapters, chosen by the model field

    @property
    def served_names(self) -> list[str]:
        """Every name the model answers to, each once, the primary name first."""
        return list(dict.fromkeys((self.model_name, *self.model_aliases)))

    def check_model(self, requested: str | None) -> None:
        check_model(requested, self.served_names)

    def response_model(self, gen: Generation) -> str:
        """The ``model`` of a response: the adapter's name when one served it (as vLLM)."""
        return gen.lora.name if gen.lora is not None else self.model_name

    async def resolve_model(self, requested: str | None) -> AdapterRef | None:
        """The LoRA adapter the ``model`` field names (None: the base model); 404 for an unknown name."""
        if not requested or requested in self.served_names:
            return None
        adapter = self.lora.get(requested)
        if adapter is None and self.lora.enabled:
            await self.lora.refresh(self.client)  # loaded through another frontend since
            adapter = self.lora.get(requested)
        if adapter is None:
            check_model(requested, self.served_names + self.lora.names())
        return adapter


# A body larger than this is refused with 413 before it is read whole: a 1M-token prompt as text is ~4 MiB.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it exceeds ``limit`` bytes (declared or sent)."""
    limit = limit or DEFAULT_MAX_BODY_BYTES
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body of {declared} bytes exceeds the limit of {limit} bytes "
                            f"(--max-request-body-bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body exceeds the limit of {limit} bytes (--max-request-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def decode_body(body: bytes, type_: type) -> Any:
    """Decode a JSON body into ``type_``; malformed JSON or a wrong type is a 400 naming the field."""
    if not body:
        raise APIError(400, "the request body is empty; expected a JSON object")
    check_json_depth(body)
    try:
        return msgspec.json.decode(body, type=type_)
    except RecursionError:  # the depth check makes this unreachable; kept as a 400, never a 500
        raise APIError(400, f"the JSON body is nested too deeply (limit {MAX_JSON_DEPTH})") from None
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid request: {e}", field_from_decode_error(str(e))) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"malformed JSON: {e}") from None


RETRY_AFTER_OVERLOADED_S = 1
RETRY_AFTER_UNAVAILABLE_S = 5  # about the client's longest reconnect backoff


def engine_error_to_api(exc: BaseException) -> APIError:
    """Engine-side failures: a rejected request is the client's fault (400), an admission limit
    is 503 + Retry-After, a deadline is 504, the rest (no engine) are 503 + Retry-After."""
    code = getattr(exc, "code", "")
    message = getattr(exc, "message", "") or str(exc) or type(exc).__name__
    if code in ("invalid_request", "duplicate_request_id"):
        return APIError(400, message)
    if code == ERR_UNKNOWN_LORA_ADAPTER:  # unloaded since this frontend last heard of it
        return APIError(404, message, "model")
    if code == ERR_OVERLOADED:  # the engine's message starts with the limit's name
        return APIError(503, f"the engine is overloaded: {message}",
                        headers={"Retry-After": str(RETRY_AFTER_OVERLOADED_S)}, rejected=message.split(":")[0])
    if code == ERR_REQUEST_TIMEOUT:
        return APIError(504, message)
    return APIError(503, f"the engine is unavailable: {message}",
                    headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)}, rejected="engine_unavailable")


async def admit(gen: Generation, receive: Receive) -> None:
    """Before a stream's HTTP status: submit its engine requests and wait for their first answers
    (``Generation.admit``); a refusal becomes the HTTP error instead of a 200 that then fails."""
    try:
        await run_until_disconnect(receive, gen.admit())
    except (APIError, ClientDisconnected):
        raise
    except Exception as e:
        raise engine_error_to_api(e) from None


TIMEOUT_HEADER = "x-request-timeout"


def request_timeout(headers: Mapping[str, str]) -> float:
    """Seconds from the ``X-Request-Timeout`` header (0: absent, the engine's --request-timeout)."""
    text = headers.get(TIMEOUT_HEADER)
    if text is None:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (0.0 < value < math.inf):
        raise APIError(400, f"X-Request-Timeout must be a positive number of seconds, got {text!r}",
                       "X-Request-Timeout")
    return value
