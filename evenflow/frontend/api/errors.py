"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import msgspec
from msgspec import Struct

from starlette.responses import Response


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(Struct):
    error: ErrorBody


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    504: "TimeoutError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error to answer with ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, *,
                 headers: dict[str, str] | None = None, rejected: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers
        self.rejected = rejected  # a refusal under load: the reason label of evenflow:request_rejected_total

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorBody(self.message, _ERROR_TYPES.get(self.status, "Error"), self.param, self.status))

    def to_response(self) -> Response:
        return Response(msgspec.json.encode(self.body()), status_code=self.status, media_type="application/json",
                        headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def field_from_decode_error(message: str) -> str | None:
    """msgspec says ``... - at `$.max_tokens` ``: pull the field name out for ``param``."""
    marker = "at `$."
    i = message.rfind(marker)
    if i == -1:
        return None
    return message[i + len(marker):].rstrip("`").split("[")[0].split(".")[0] or None
