"""``ApiError``: a refusal the gateway answers with an HTTP status and OpenAI's error body,
``{"error": {"message", "type", "param", "code"}}``, naming the field or bound at fault."""

from __future__ import annotations

from typing import Any

from ragen.errors import RagenError

# OpenAI's error types by status
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 502: "server_error", 503: "server_error", 504: "server_error"}


class ApiError(RagenError):
    """A request the gateway refuses (4xx) or could not answer (5xx)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def bad_field(param: str, expected: str, got: Any) -> ApiError:
    """400 naming ``param``: what it must be, and what came."""
    shown = repr(got)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ApiError(400, f"{param} must be {expected}, got {shown}", param=param, code="invalid_value")
