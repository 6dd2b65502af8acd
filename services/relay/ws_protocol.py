"""The relay's WebSocket protocol: every connection starts at the anonymous message bound, raised only once the
relay accepted its credential.

uvicorn's WebSocket protocol has one ``ws_max_size`` for every connection, and
the relay's must be large (``max_message_bytes``, a whole frame of
activations). The protocol reads a message whole, up to that bound, before the
app sees any of it: an anonymous ``/rpc`` caller, allowed 16 KiB, could make
the relay buffer about 97 MiB per connection before the app's own bound
refused the message (issue 34, finding 8).

:func:`credential_sized` builds the protocol class ``meshnet relay`` serves
with. Each connection's parser bounds messages at ``anonymous_max_bytes``
from the first byte after the handshake. When the app accepts a connection whose
credential it checked (it marks the scope, :data:`AUTHENTICATED_SCOPE_KEY`; a
bad credential is refused 401/403 before), the bound becomes uvicorn's ``ws_max_size`` and the
frame parser is restarted with it, so the first message of an authenticated
link already has the full bound. A client sends no frame before the
handshake's answer (RFC 6455), so nothing is lost by the restart; one that does
has its early frames read under the anonymous bound.

``meshnet relay`` serves with it. Under a bare uvicorn, pass
``--ws services.relay.ws_protocol:AnonymousSizedWebSockets`` (the default
anonymous bound) and ``--ws-max-size`` above ``max_message_bytes``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.server import ServerProtocol

from meshwire import limits
from services.relay.settings import DEFAULT_MAX_ANONYMOUS_MESSAGE_BYTES

AUTHENTICATED_SCOPE_KEY: Final = "meshnet.authenticated"
"""Set in the connection's ASGI scope by the app when it accepts a connection whose credential it checked (a
peer; a caller with the secret, a join token or a node's signed handshake, :mod:`meshwire.relay_auth`)."""
ANONYMOUS_WS_SLACK: Final = 4 * limits.KIB
"""Room above ``max_anonymous_message_bytes`` at the parser, so the relay still sees, and answers ``too_large``,
an anonymous message a little over its bound; one further over it closes the connection (1009)."""


class _SizedServer(ServerProtocol):
    """websockets' server side whose message bound is :attr:`full` once :attr:`opened`, else :attr:`anonymous`."""

    def __init__(self, *, full: int, anonymous: int, **kwargs: Any) -> None:
        self.full = full
        self.anonymous = anonymous
        self.opened = False
        super().__init__(max_size=anonymous, **kwargs)

    @property  # type: ignore[override]
    def max_message_size(self) -> int:
        return self.full if self.opened else self.anonymous

    @max_message_size.setter
    def max_message_size(self, value: int | None) -> None:
        """websockets sets it from ``max_size``: the two bounds above decide instead."""


def credential_sized(anonymous_max_bytes: int) -> type[asyncio.Protocol]:
    """uvicorn's sans-I/O WebSocket protocol, with messages bounded at ``anonymous_max_bytes`` until the app
    accepts a connection that presented a credential (then at ``ws_max_size``)."""

    class CredentialSizedWebSockets(WebSocketsSansIOProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            plain = self.conn
            self.conn = _SizedServer(full=self.config.ws_max_size, anonymous=anonymous_max_bytes,
                                     extensions=plain.available_extensions, logger=plain.logger)

        async def send(self, message: Any) -> None:
            accepting = message["type"] == "websocket.accept" and not self.handshake_complete
            await super().send(message)
            if accepting and self.scope.get(AUTHENTICATED_SCOPE_KEY):
                conn = self.conn
                assert isinstance(conn, _SizedServer)
                conn.opened = True
                conn.parser = conn.parse()  # the parser waits on the first frame with the bound it had: renew it
                next(conn.parser)

    return CredentialSizedWebSockets


AnonymousSizedWebSockets: Final = credential_sized(DEFAULT_MAX_ANONYMOUS_MESSAGE_BYTES + ANONYMOUS_WS_SLACK)
"""The protocol at the default anonymous bound, for a bare uvicorn
(``--ws services.relay.ws_protocol:AnonymousSizedWebSockets``)."""
