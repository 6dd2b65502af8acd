"""What every meshnet service passes uvicorn: the slow-client guards and, when configured, TLS.

``serve`` of the tracker, node and relay calls :func:`uvicorn_options` (the
bootstrap builds its own ``uvicorn.Config`` with the same pieces, on h11).
"""

from __future__ import annotations

from typing import Any

from meshwire import slow_clients, tls


def uvicorn_options(*, tls_cert: str | None, tls_key: str | None, head_timeout_s: float,
                    max_connections_per_address: int) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run``: the guarded HTTP protocol, and the certificate if any."""
    return {
        "http": slow_clients.guarded_http(head_timeout_s, max_connections_per_address),
        **tls.server_options(tls_cert, tls_key),
    }
