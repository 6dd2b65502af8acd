"""Configuration of a relay, from ``MESHNET_*`` environment variables.

Every field has an environment twin ``MESHNET_<FIELD>`` (``max_inflight_per_peer``
is ``MESHNET_MAX_INFLIGHT_PER_PEER``). Every bound the relay enforces on peers
and callers is a field here, so an operator can tighten it and a reviewer can
find it; the shared defaults live in :mod:`meshwire.limits`.
"""

from __future__ import annotations

from typing import Final

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from meshwire import limits
from meshwire.auth import DEFAULT_SECRET

DEFAULT_PORT: Final = 8001
DEFAULT_MAX_INFLIGHT_PER_PEER: Final = 64
"""Requests one peer may have outstanding at once; more are refused ``busy`` at once, never queued."""
DEFAULT_REQUEST_TIMEOUT_S: Final = 120.0
"""Longest the relay waits for a peer's answer (a long prefill happens before it)."""
DEFAULT_MAX_PEERS: Final = 1024
DEFAULT_MAX_CALLERS: Final = 4096
DEFAULT_TAKEOVER_PROBE_S: Final = 2.0
"""How long a peer holding an id has to answer a ping before a newcomer may take its place."""


class RelaySettings(BaseSettings):
    """Where a relay listens, its secret, and the bounds it holds peers and callers to."""

    model_config = SettingsConfigDict(env_prefix="MESHNET_", frozen=True, extra="ignore",
                                      use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Listen address; a relay serving peers behind NAT listens on a public one (``0.0.0.0``)."""
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    secret: str = Field(DEFAULT_SECRET, min_length=1, max_length=1024)
    """The mesh's shared secret: peers and ``/mux`` callers present it as a bearer token."""
    rpc_requires_auth: bool = False
    """Whether ``/rpc`` callers must present the secret too. Off by default: the reference
    caller sends none, and every request it relays carries its own bearer token, which the
    peer checks. A wrong credential is refused either way."""

    max_message_bytes: int = Field(limits.RELAY_MAX_MESSAGE_BYTES, ge=4 * limits.KIB,
                                   le=limits.RELAY_MAX_MESSAGE_BYTES)
    """Largest WebSocket message accepted from a peer or a caller (JSON envelopes count base64)."""
    max_inflight_per_peer: int = Field(DEFAULT_MAX_INFLIGHT_PER_PEER, ge=1, le=65536)
    request_timeout_s: float = Field(DEFAULT_REQUEST_TIMEOUT_S, gt=0, le=3600)
    max_peers: int = Field(DEFAULT_MAX_PEERS, ge=1, le=1 << 20)
    """Most peers connected at once."""
    max_callers: int = Field(DEFAULT_MAX_CALLERS, ge=1, le=1 << 20)
    """Most caller connections (``/rpc`` and ``/mux`` together) open at once."""
    takeover_probe_s: float = Field(DEFAULT_TAKEOVER_PROBE_S, gt=0, le=60)

    log_level: str = "info"

    @property
    def url(self) -> str:
        """The base WebSocket URL peers and callers use (``0.0.0.0`` shown as ``127.0.0.1``)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"ws://{host}:{self.port}"
