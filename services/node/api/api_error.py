"""The OpenAI-shaped error answers of a head's API: :class:`ApiError`, and a failed generation as one."""

from __future__ import annotations

from typing import Any, Final

import orjson
from starlette.responses import Response

from meshwire import errors
from services.node.head.failures import GenerationFailed

_STATUS_TYPES: Final = {
    400: errors.INVALID_REQUEST, 401: errors.AUTHENTICATION, 403: errors.PERMISSION, 404: errors.NOT_FOUND,
    409: errors.INVALID_REQUEST, 413: errors.INVALID_REQUEST, 502: errors.SERVER_ERROR, 503: errors.UNAVAILABLE,
}
"""The OpenAI error ``type`` of each status (anything else: ``server_error``)."""


class ApiError(Exception):
    """An OpenAI-shaped error answer."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 retry_after: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
        self.retry_after = retry_after
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return errors.error_body(str(self), _STATUS_TYPES.get(self.status, errors.SERVER_ERROR), self.code,
                                 self.param, **self.extra)

    def response(self) -> Response:
        headers = {"Retry-After": self.retry_after} if self.retry_after else None
        return Response(orjson.dumps(self.body()), status_code=self.status, media_type="application/json",
                        headers=headers)


def from_failure(exc: GenerationFailed) -> ApiError:
    """A generation's failure as the API answers it (naming the failed node, when one failed)."""
    extra = {"failed_node": exc.failed_node} if exc.failed_node else {}
    return ApiError(exc.status, str(exc), exc.code, retry_after=exc.retry_after, **extra)
