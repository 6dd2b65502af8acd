"""HTTP helpers every tracker route shares: OpenAI-shaped errors, bounded bodies, credentials.

Every error the tracker answers has the OpenAI shape
(:func:`meshwire.errors.error_body`), so the official client raises a
readable exception and the node client can read ``code``. Request bodies are
read with a hard bound (:func:`meshwire.body_guard.read_bounded`): a
``Content-Length`` over the limit is refused before a byte is read, and a body
that keeps coming past it is cut off.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence
from typing import Any, Final

from fastapi import Request
from fastapi.responses import JSONResponse

from meshwire import errors
from meshwire.auth import check_bearer
from meshwire.body_guard import BodyIncomplete, BodyTooLarge, read_bounded

BEARER: Final = "bearer"


class HTTPError(Exception):
    """An error answer in the OpenAI shape, raised anywhere in a route and rendered by the app."""

    def __init__(self, status: int, message: str, type: str, code: str | None = None,
                 param: str | None = None, headers: Mapping[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.body = errors.error_body(message, type, code, param, **extra)
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def error_response(status: int, message: str, type: str, code: str | None = None, param: str | None = None,
                   headers: Mapping[str, str] | None = None, **extra: Any) -> JSONResponse:
    """An OpenAI-shaped JSON error response."""
    return HTTPError(status, message, type, code, param, headers, **extra).response()


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) one larger than ``limit`` bytes without reading it all."""
    try:
        return await read_bounded(request, limit)
    except BodyTooLarge:
        raise _too_large(limit) from None
    except BodyIncomplete:
        raise HTTPError(400, "the client went away before the request body was complete", errors.INVALID_REQUEST,
                        "body_incomplete") from None


def _too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"request body is larger than {limit} bytes", errors.INVALID_REQUEST, "body_too_large")


def require_mesh_secret(request: Request, secret: str) -> None:
    """Refuse a request without the mesh's bearer secret: 401 missing, 403 wrong. Reads no body."""
    failure = check_bearer(request.headers.get("authorization"), secret)
    if failure is not None:
        raise HTTPError(failure.status, failure.message, failure.error_type,
                        "missing_credential" if failure.status == 401 else "invalid_credential",
                        headers={"WWW-Authenticate": "Bearer"} if failure.status == 401 else None)


def require_api_key(request: Request, api_keys: Sequence[str], *, also: Sequence[str] = ()) -> None:
    """When API keys are configured, refuse (401, OpenAI's ``invalid_api_key``) a request without one.

    ``also`` lists further credentials accepted in their place (the mesh
    secret, where nodes and tools call); without API keys nothing is checked.
    """
    if not api_keys:
        return
    scheme, _, key = (request.headers.get("authorization") or "").strip().partition(" ")
    key = key.strip()
    if scheme.lower() == BEARER and key:
        offered = key.encode("utf-8")
        # Compare against every credential (no early exit), so timing says nothing about which one is close.
        matched = False
        for candidate in (*api_keys, *also):
            matched |= bool(candidate) and hmac.compare_digest(offered, candidate.encode("utf-8"))
        if matched:
            return
        raise HTTPError(401, "Incorrect API key provided.", errors.INVALID_REQUEST, "invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})
    raise HTTPError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                    errors.INVALID_REQUEST, "missing_api_key", headers={"WWW-Authenticate": "Bearer"})


def require_mesh_reader(request: Request, api_keys: Sequence[str], secret: str) -> None:
    """Guard the mesh's layout (``/v1/nodes``, ``/v1/mesh``, ``/v1/route``).

    They name every node's endpoint, relay address and failure reasons, so
    with API keys configured they need a client API key or the mesh secret
    (nodes and tools hold the secret); without API keys they stay public.
    """
    require_api_key(request, api_keys, also=(secret,))
