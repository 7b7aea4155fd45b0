"""Errors the gateway answers itself, rendered in the envelope of the API the client speaks.

Each class carries its status and error type as defaults (as Litestar's HTTP exceptions do), so
raising `Unauthorized("...")` anywhere on the hot path is enough; `body` picks the OpenAI
(`{"error": {...}}`) or Anthropic (`{"type": "error", "error": {...}}`) shape. `ApiError` is the
root of the gateway's errors; `ClientGone` is no error of the gateway's, only the signal that
nobody is left to answer.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

Dialect = Literal["openai", "anthropic"]

_json = msgspec.json.Encoder()


class ApiError(Exception):
    """An error answered to the client; subclasses set status and types."""

    status: ClassVar[int] = 500
    openai_type: ClassVar[str] = "server_error"
    anthropic_type: ClassVar[str] = "api_error"

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    def body(self, dialect: Dialect) -> bytes:
        """The JSON error envelope of `dialect`."""
        if dialect == "anthropic":
            error = {"type": self.anthropic_type, "message": self.message}
            return _json.encode({"type": "error", "error": error})
        payload = {"message": self.message, "type": self.openai_type, "param": None, "code": None}
        return _json.encode({"error": payload})

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers: JSON content type, plus Retry-After when the client should come back."""
        headers = [(b"content-type", b"application/json")]
        if self.retry_after is not None:
            headers.append((b"retry-after", str(max(1, round(self.retry_after))).encode()))
        return headers


class ClientGone(Exception):
    """The client disconnected before its request body arrived (nothing is answered)."""


class BadRequest(ApiError):
    """Malformed body (not JSON, not an object, a field of the wrong type)."""

    status = 400
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class Unauthorized(ApiError):
    """Missing, malformed, tampered or expired key."""

    status = 401
    openai_type = "authentication_error"
    anthropic_type = "authentication_error"


class Forbidden(ApiError):
    """A valid key of an episode that is already closed."""

    status = 403
    openai_type = "permission_error"
    anthropic_type = "permission_error"


class NotFound(ApiError):
    """Unknown route."""

    status = 404
    openai_type = "not_found_error"
    anthropic_type = "not_found_error"


class MethodNotAllowed(ApiError):
    """Known route, wrong method."""

    status = 405
    openai_type = "invalid_request_error"
    anthropic_type = "invalid_request_error"


class PayloadTooLarge(ApiError):
    """Request body over the configured limit."""

    status = 413
    openai_type = "invalid_request_error"
    anthropic_type = "request_too_large"


class BadGateway(ApiError):
    """The upstream failed or answered garbage."""

    status = 502
    openai_type = "server_error"
    anthropic_type = "api_error"


class Unavailable(ApiError):
    """No healthy upstream, paused too long, or the bus can't take the span: come back later."""

    status = 503
    openai_type = "server_error"
    anthropic_type = "overloaded_error"


class GatewayTimeout(ApiError):
    """The upstream did not answer in time."""

    status = 504
    openai_type = "server_error"
    anthropic_type = "api_error"


_BY_STATUS: dict[int, type[ApiError]] = {
    cls.status: cls
    for cls in (
        BadRequest, Unauthorized, Forbidden, NotFound, MethodNotAllowed, PayloadTooLarge,
        BadGateway, Unavailable, GatewayTimeout,
    )
}  # fmt: skip


def error_for_status(status: int, message: str) -> ApiError:
    """The gateway error of an HTTP status (a generic `ApiError` for unlisted ones)."""
    return _BY_STATUS.get(status, ApiError)(message)
