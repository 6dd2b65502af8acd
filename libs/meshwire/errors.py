"""The OpenAI error shape, built in one place.

Every HTTP service answers errors as
``{"error": {"message": str, "type": str, "code": str | None, "param": str | None}}``
so that the official OpenAI client raises a readable exception.
"""

from __future__ import annotations

from typing import Any, Final

INVALID_REQUEST: Final = "invalid_request_error"
AUTHENTICATION: Final = "authentication_error"
PERMISSION: Final = "permission_error"
NOT_FOUND: Final = "not_found_error"
RATE_LIMIT: Final = "rate_limit_error"
SERVER_ERROR: Final = "server_error"
UNAVAILABLE: Final = "service_unavailable"
STORE_UNAVAILABLE: Final = "store_unavailable"
"""Error code of a tracker whose store (Redis) is away: a node asks another tracker."""


def error_body(message: str, type: str, code: str | None = None, param: str | None = None,
               **extra: Any) -> dict[str, Any]:
    """Build an OpenAI-shaped error body.

    ``extra`` keys are added inside ``error`` (meshnet uses ``failed_node`` on
    a 502 ``hop_failed``); the four standard keys are always present.
    """
    error: dict[str, Any] = {"message": message, "type": type, "code": code, "param": param}
    error.update(extra)
    return {"error": error}
