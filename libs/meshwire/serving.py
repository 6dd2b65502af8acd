"""What every meshnet service serves with: the settings of its TLS and slow-client guards, and uvicorn's options.

Four services listen, and each is configured with the same block of settings
(the same ``MESHNET_*`` names, defaults and bounds in every one), so the block
is written once here, as pydantic mixins a service's ``BaseSettings`` inherits:

- :class:`ListenerSettings`, every service: ``tls_cert`` / ``tls_key`` (serve
  HTTPS; both or neither, and each file must exist) and
  ``max_connections_per_address``;
- :class:`SlowClientSettings`, the tracker, node and relay: those, and the
  head and body deadlines (``head_timeout_s``, ``body_timeout_s``; the
  bootstrap has one deadline of its own for both, ``read_timeout_s``);
- :class:`TlsClientSettings`, the services whose clients call ``https://``
  peers (tracker, node): ``tls_ca``.

``serve`` of the tracker, node and relay calls :func:`uvicorn_options` (the
bootstrap builds its own ``uvicorn.Config`` with the same pieces, on h11).
"""

from __future__ import annotations

from typing import Any, Final, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from meshwire import slow_clients, tls

MAX_HEAD_TIMEOUT_S: Final = 600.0
"""Longest head deadline a service may be given."""
MAX_BODY_TIMEOUT_S: Final = 3600.0
"""Longest body deadline a service may be given."""
MAX_CONNECTIONS_PER_ADDRESS_LIMIT: Final = 65536
"""Largest ``max_connections_per_address`` a service may be given."""

_DOCUMENTED: Final = ConfigDict(use_attribute_docstrings=True)
"""The mixins' fields take their descriptions (``--help``, the README's table) from their docstrings."""


class ListenerSettings(BaseModel):
    """Mixin of every service's settings: the certificate it serves HTTPS with, and connections per address."""

    model_config = _DOCUMENTED

    tls_cert: str | None = None
    """PEM certificate (chain) this service presents; with ``tls_key`` set too it serves HTTPS only."""
    tls_key: str | None = None
    """PEM private key of ``tls_cert``."""
    max_connections_per_address: int = Field(slow_clients.MAX_CONNECTIONS_PER_ADDRESS, ge=1,
                                             le=MAX_CONNECTIONS_PER_ADDRESS_LIMIT)
    """Connections served at once from one client address; one more is answered 503 and closed."""

    @model_validator(mode="after")
    def _check_tls_pair(self) -> Self:
        tls.check_pair(self.tls_cert, self.tls_key)
        return self


class SlowClientSettings(ListenerSettings):
    """Mixin of the tracker's, node's and relay's settings: the listener, and a deadline on each head and body."""

    head_timeout_s: float = Field(slow_clients.HEAD_TIMEOUT_S, gt=0, le=MAX_HEAD_TIMEOUT_S)
    """Seconds a client connection has to send each request head (line and headers) before it is closed."""
    body_timeout_s: float = Field(slow_clients.BODY_TIMEOUT_S, gt=0, le=MAX_BODY_TIMEOUT_S)
    """Seconds a request has to deliver its whole body once the service reads it; then it is answered 408."""


class TlsClientSettings(BaseModel):
    """Mixin of the settings of a service whose clients call ``https://`` and ``wss://`` peers."""

    model_config = _DOCUMENTED

    tls_ca: str | None = None
    """PEM CA bundle this service's clients verify ``https://`` and ``wss://`` peers with; unset: the default trusted roots."""

    @model_validator(mode="after")
    def _check_tls_ca(self) -> Self:
        tls.check_ca(self.tls_ca)
        return self


def uvicorn_options(*, tls_cert: str | None, tls_key: str | None, head_timeout_s: float,
                    max_connections_per_address: int) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run``: the guarded HTTP protocol, and the certificate if any."""
    return {
        "http": slow_clients.guarded_http(head_timeout_s, max_connections_per_address),
        **tls.server_options(tls_cert, tls_key),
    }
