"""What every HTTP handler needs: the engine client, tokenizer, model facts, metrics, settings."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..metrics import FrontendMetrics
from ..tokenizer import Tokenizer
from .errors import APIError, field_from_decode_error
from .prepare import check_model


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
    created: int = field(default_factory=lambda: int(time.time()))
    model_aliases: tuple[str, ...] = ()  # other names requests may use (the folder's base name)

    @property
    def served_names(self) -> list[str]:
        """Every name the model answers to, each once, the primary name first."""
        return list(dict.fromkeys((self.model_name, *self.model_aliases)))

    def check_model(self, requested: str | None) -> None:
        check_model(requested, self.served_names)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def decode_body(body: bytes, type_: type) -> Any:
    """Decode a JSON body into ``type_``; malformed JSON or a wrong type is a 400 naming the field."""
    if not body:
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid request: {e}", field_from_decode_error(str(e))) from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"malformed JSON: {e}") from None


def engine_error_to_api(exc: BaseException) -> APIError:
    """Engine-side failures: a rejected request is the client's fault (400), the rest are 503."""
    code = getattr(exc, "code", "")
    message = getattr(exc, "message", "") or str(exc) or type(exc).__name__
    if code in ("invalid_request", "duplicate_request_id"):
        return APIError(400, message)
    return APIError(503, f"the engine is unavailable: {message}")
