"""Run a relay under uvicorn (what ``meshnet relay`` calls).

uvicorn's own WebSocket message bound is raised above the relay's
``max_message_bytes``, so an oversize message reaches the relay, which answers
it with a ``too_large`` error for that request instead of a dropped connection.
That bound holds only for a connection the relay accepted with a credential:
every connection starts bounded just above ``max_anonymous_message_bytes``
(:mod:`services.relay.ws_protocol`), so an anonymous caller's message over it is
refused by the WebSocket parser (close 1009) before it is buffered.
(Under a bare ``uvicorn services.relay.app:app`` pass ``--ws
services.relay.ws_protocol:AnonymousSizedWebSockets`` and ``--ws-max-size``;
without them uvicorn's 16 MiB bound applies to every connection.)
"""

from __future__ import annotations

from typing import Final

import uvicorn

from meshwire import exposure, limits, serving
from services.relay.app import create_app
from services.relay.settings import RelaySettings
from services.relay.ws_protocol import ANONYMOUS_WS_SLACK, credential_sized

WS_MAX_SIZE_SLACK: Final = limits.MIB
"""Room above ``max_message_bytes`` at the transport so the app sees, and answers, oversize messages."""


def serve(settings: RelaySettings | None = None) -> None:
    """Serve a relay until interrupted; refuses to listen beyond loopback with an empty or published secret."""
    settings = settings or RelaySettings()
    exposure.require_private_secret("the relay", settings.host, settings.secret)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                ws_max_size=settings.max_message_bytes + WS_MAX_SIZE_SLACK, ws=credential_sized(
                    min(settings.max_anonymous_message_bytes, settings.max_message_bytes) + ANONYMOUS_WS_SLACK),
                **serving.uvicorn_options(tls_cert=settings.tls_cert, tls_key=settings.tls_key,
                                          head_timeout_s=settings.head_timeout_s,
                                          max_connections_per_address=settings.max_connections_per_address))
