"""How the tracker answers what went wrong: every error in the OpenAI shape, each kind handled in one place.

:func:`add_error_handlers` registers, on the app:

- :class:`~.responses.HTTPError` (raised anywhere in a route): its own answer;
- :class:`~.store.StoreUnavailable` (a shared store away, raised by any store operation): 503
  ``store_unavailable`` with ``Retry-After`` (:func:`.state.store_unavailable`), so no route
  translates it by hand;
- unknown paths (404) and wrong methods (405), and a request FastAPI could not validate (400);
- anything else: 500 ``internal_error``, logged with its traceback.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshwire import errors

from .responses import HTTPError, error_response
from .state import store_unavailable, tracker_state
from .store import StoreUnavailable

logger = logging.getLogger(__name__)


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error ``app`` raises in the OpenAI shape (see the module doc)."""
    app.add_exception_handler(HTTPError, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(StoreUnavailable, _store_away)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _starlette_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _crashed)


async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
    return exc.response()


async def _store_away(request: Request, exc: StoreUnavailable) -> JSONResponse:
    return store_unavailable(str(exc), tracker_state(request).settings.heartbeat_s).response()


async def _starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path[:200]}"
        return error_response(404, message, errors.NOT_FOUND, "not_found")
    if exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path[:200]}"
        return error_response(405, message, errors.INVALID_REQUEST, "method_not_allowed", headers=exc.headers)
    return error_response(exc.status_code, str(exc.detail), errors.INVALID_REQUEST, None, headers=exc.headers)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
    return error_response(400, f"invalid request: {first.get('msg', 'bad input')}", errors.INVALID_REQUEST,
                          "invalid_request", param)


async def _crashed(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error on %s %s", request.method, request.url.path)
    return error_response(500, "internal error in the tracker", errors.SERVER_ERROR, "internal_error")
