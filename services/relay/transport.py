"""The relay's side of a WebSocket: serialised sends, quiet closes, refused handshakes.

A refused handshake is answered with a real HTTP status and an OpenAI-shaped
JSON error (401 no credential, 403 wrong credential, 404 unknown peer, 409 id
taken, 429 too many connections from one address, 503 full) where the server supports the ASGI ``websocket.http.response``
extension (uvicorn does); elsewhere the socket is closed before it opens with
close code ``4000 + status`` and the message as the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Final

from fastapi import WebSocket
from fastapi.responses import JSONResponse
from starlette.websockets import WebSocketDisconnect

from meshwire import errors
from services.relay.peers import TransportClosed

DENIAL_EXTENSION: Final = "websocket.http.response"
CLOSE_CODE_BASE: Final = 4000
MAX_CLOSE_REASON_BYTES: Final = 123
"""The WebSocket protocol's limit on a close reason."""
PEER_ID: Final = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
"""What a peer id may be: a node id (:data:`meshwire.fields.NodeId`)."""

_ERROR_TYPES: Final = {400: errors.INVALID_REQUEST, 401: errors.AUTHENTICATION, 403: errors.PERMISSION,
                       404: errors.NOT_FOUND, 409: errors.INVALID_REQUEST, 429: errors.RATE_LIMIT,
                       503: errors.UNAVAILABLE}


class WebSocketTransport:
    """A WebSocket whose sends are serialised, so concurrent answers never interleave."""

    def __init__(self, websocket: WebSocket) -> None:
        self._websocket = websocket
        self._lock = asyncio.Lock()

    async def send(self, data: bytes) -> None:
        """Send a binary message; :class:`TransportClosed` when the other side is gone."""
        try:
            async with self._lock:
                await self._websocket.send_bytes(data)
        except (OSError, RuntimeError, WebSocketDisconnect) as exc:
            raise TransportClosed(str(exc) or type(exc).__name__) from None

    async def send_text(self, text: str) -> None:
        """Send a text message; :class:`TransportClosed` when the other side is gone."""
        try:
            async with self._lock:
                await self._websocket.send_text(text)
        except (OSError, RuntimeError, WebSocketDisconnect) as exc:
            raise TransportClosed(str(exc) or type(exc).__name__) from None

    async def close(self, code: int, reason: str) -> None:
        """Close the socket; nothing happens when it is already closed."""
        with contextlib.suppress(OSError, RuntimeError, WebSocketDisconnect):
            await self._websocket.close(code, _reason(reason))


async def refuse(websocket: WebSocket, status: int, code: str, message: str) -> None:
    """Refuse a handshake with ``status`` and a JSON error naming the problem."""
    if DENIAL_EXTENSION in websocket.scope.get("extensions", {}):
        body = errors.error_body(message, _ERROR_TYPES.get(status, errors.INVALID_REQUEST), code)
        await websocket.send_denial_response(JSONResponse(body, status_code=status))
    else:
        await websocket.close(CLOSE_CODE_BASE + status, _reason(message))


class DenialLogFilter(logging.Filter):
    """Drops uvicorn's false alarm after a refused handshake.

    uvicorn's sans-I/O WebSocket protocol logs "ASGI callable returned without
    completing handshake" at ERROR after an app answers the handshake with a
    denial response, although the response went out. Every path of this app
    either accepts or refuses a handshake, so the line never means anything here.
    """

    NOISE: Final = "ASGI callable returned without completing handshake."

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.NOISE


def install_denial_log_filter() -> None:
    """Install :class:`DenialLogFilter` on uvicorn's error logger (once)."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, DenialLogFilter) for f in logger.filters):
        logger.addFilter(DenialLogFilter())


def _reason(message: str) -> str:
    """``message`` cut to what a close frame may carry (123 bytes of UTF-8)."""
    return message.encode("utf-8")[:MAX_CLOSE_REASON_BYTES].decode("utf-8", errors="ignore")
