"""Configuration of a relay, from ``MESHNET_*`` environment variables.

Every field has an environment twin ``MESHNET_<FIELD>`` (``max_inflight_per_peer``
is ``MESHNET_MAX_INFLIGHT_PER_PEER``). Every bound the relay enforces on peers
and callers is a field here, so an operator can tighten it and a reviewer can
find it; the shared defaults live in :mod:`meshwire.limits`.

Callers come in two kinds with separate budgets, so one kind can never use up
the other's:

- *authenticated*: ``/mux`` callers, and ``/rpc`` callers that present the mesh
  credential at the handshake. They reach everything a peer serves, and share
  ``max_callers`` connections and, per peer, ``max_inflight_per_peer`` requests
  and ``max_inflight_bytes_per_peer`` bytes.
- *anonymous*: ``/rpc`` callers without a credential. They reach only a peer's
  public ``GET /health``, and have their own ``max_anonymous_callers``
  connections (``max_anonymous_callers_per_address`` from one remote IP),
  ``max_anonymous_inflight_per_peer`` requests per peer, smaller messages and
  a shorter idle timeout.

The anonymous message bound holds at the WebSocket parser: every connection
starts bounded just above ``max_anonymous_message_bytes`` and only one the relay
accepted with a credential is raised to ``max_message_bytes``
(:mod:`services.relay.ws_protocol`), so an anonymous caller makes the relay
hold at most about 20 KiB per connection, and ``max_anonymous_callers``
(``max_anonymous_callers_per_address`` per remote IP) such connections.

``rpc_requires_auth`` was the switch that let anonymous ``/rpc`` callers reach a
peer's whole app (its default, off) or refused them. The health-only rule
replaces the first meaning: off now admits anonymous callers to the public
health check only; on refuses them at the handshake (401), for a relay that
should not answer even that.
"""

from __future__ import annotations

from typing import Final, Self

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from meshwire import limits, tls
from meshwire.auth import DEFAULT_SECRET
from meshwire.serving import SlowClientSettings

DEFAULT_PORT: Final = 8001
DEFAULT_MAX_INFLIGHT_PER_PEER: Final = 64
"""Requests one peer may have outstanding at once; more are refused ``busy`` at once, never queued."""
DEFAULT_MAX_INFLIGHT_BYTES_PER_PEER: Final = 256 * limits.MIB
"""Request bytes (whole messages) outstanding to one peer at once: a few full frames, not 64 of them."""
DEFAULT_MAX_ANONYMOUS_INFLIGHT_PER_PEER: Final = 4
"""Public health checks outstanding to one peer at once, beside (never inside) the authenticated budget."""
DEFAULT_REQUEST_TIMEOUT_S: Final = 120.0
"""Longest the relay waits for a peer's answer (a long prefill happens before it)."""
DEFAULT_MAX_PEERS: Final = 1024
DEFAULT_MAX_CALLERS: Final = 4096
DEFAULT_MAX_ANONYMOUS_CALLERS: Final = 256
DEFAULT_MAX_ANONYMOUS_CALLERS_PER_ADDRESS: Final = 8
DEFAULT_MAX_ANONYMOUS_MESSAGE_BYTES: Final = 16 * limits.KIB
"""Largest message from an anonymous caller: a ``GET /health`` envelope is about a hundred bytes."""
DEFAULT_CALLER_IDLE_TIMEOUT_S: Final = 600.0
"""An authenticated caller link with nothing in flight and nothing sent this long is closed."""
DEFAULT_ANONYMOUS_IDLE_TIMEOUT_S: Final = 30.0
"""An anonymous caller with nothing in flight and nothing sent this long is closed."""
DEFAULT_TAKEOVER_PROBE_S: Final = 2.0
"""How long a peer holding an id has to answer a ping before a newcomer may take its place."""


class RelaySettings(BaseSettings, SlowClientSettings):
    """Where a relay listens, its secret, and the bounds it holds peers and callers to (TLS and the slow-client
    guards from :mod:`meshwire.serving`)."""

    model_config = SettingsConfigDict(env_prefix="MESHNET_", frozen=True, extra="ignore",
                                      use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Listen address; a relay serving peers behind NAT listens on a public one (``0.0.0.0``)."""
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    secret: str = Field(DEFAULT_SECRET, min_length=1, max_length=1024)
    """The mesh's shared secret: peers, ``/mux`` callers and full ``/rpc`` callers present it as a bearer token."""
    tracker: str | None = Field(None, max_length=4 * limits.MAX_URL_CHARS)
    """Tracker URL(s), comma-separated, that check the join tokens peers and callers show; none: only the secret."""
    rpc_requires_auth: bool = False
    """Refuse ``/rpc`` callers without the secret at the handshake (401). Off: they are admitted, but reach only a peer's ``GET /health``."""

    max_message_bytes: int = Field(limits.RELAY_MAX_MESSAGE_BYTES, ge=4 * limits.KIB,
                                   le=limits.RELAY_MAX_MESSAGE_BYTES)
    """Largest WebSocket message accepted from a peer or a caller (JSON envelopes count base64)."""
    max_inflight_per_peer: int = Field(DEFAULT_MAX_INFLIGHT_PER_PEER, ge=1, le=65536)
    """Requests from authenticated callers outstanding to one peer at once; more are refused ``busy``."""
    max_inflight_bytes_per_peer: int = Field(DEFAULT_MAX_INFLIGHT_BYTES_PER_PEER, ge=4 * limits.KIB,
                                             le=1 << 40)
    """Request bytes from authenticated callers outstanding to one peer at once (at least ``max_message_bytes``)."""
    max_anonymous_inflight_per_peer: int = Field(DEFAULT_MAX_ANONYMOUS_INFLIGHT_PER_PEER, ge=1, le=65536)
    """Health checks from anonymous ``/rpc`` callers outstanding to one peer at once."""
    request_timeout_s: float = Field(DEFAULT_REQUEST_TIMEOUT_S, gt=0, le=3600)
    max_peers: int = Field(DEFAULT_MAX_PEERS, ge=1, le=1 << 20)
    """Most peers connected at once."""
    max_callers: int = Field(DEFAULT_MAX_CALLERS, ge=1, le=1 << 20)
    """Most authenticated caller connections (``/mux``, ``/rpc`` with the secret) open at once."""
    max_anonymous_callers: int = Field(DEFAULT_MAX_ANONYMOUS_CALLERS, ge=1, le=1 << 20)
    """Most ``/rpc`` connections without the secret open at once; they never take an authenticated caller's place."""
    max_anonymous_callers_per_address: int = Field(DEFAULT_MAX_ANONYMOUS_CALLERS_PER_ADDRESS, ge=1, le=1 << 20)
    """Most ``/rpc`` connections without the secret open at once from one remote IP address."""
    max_anonymous_message_bytes: int = Field(DEFAULT_MAX_ANONYMOUS_MESSAGE_BYTES, ge=limits.KIB,
                                             le=limits.RELAY_MAX_MESSAGE_BYTES)
    """Largest message accepted from an ``/rpc`` caller without the secret."""
    caller_idle_timeout_s: float = Field(DEFAULT_CALLER_IDLE_TIMEOUT_S, gt=0, le=86400)
    """An authenticated caller connection with nothing in flight that sends nothing this long is closed."""
    anonymous_idle_timeout_s: float = Field(DEFAULT_ANONYMOUS_IDLE_TIMEOUT_S, gt=0, le=86400)
    """An ``/rpc`` connection without the secret, with nothing in flight, that sends nothing this long is closed."""
    takeover_probe_s: float = Field(DEFAULT_TAKEOVER_PROBE_S, gt=0, le=60)

    log_level: str = "info"

    @model_validator(mode="after")
    def _one_message_fits_the_byte_budget(self) -> Self:
        if self.max_inflight_bytes_per_peer < self.max_message_bytes:
            raise ValueError(f"max_inflight_bytes_per_peer ({self.max_inflight_bytes_per_peer}) must be at least "
                             f"max_message_bytes ({self.max_message_bytes}), or a largest request could never pass")
        return self

    def tracker_urls(self) -> tuple[str, ...]:
        """The trackers that check join tokens, in the order they are asked."""
        return tuple(url.strip() for url in (self.tracker or "").split(",") if url.strip())

    @property
    def url(self) -> str:
        """The base WebSocket URL peers and callers use (``0.0.0.0`` shown as ``127.0.0.1``)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{tls.scheme(self.tls_cert is not None, websocket=True)}://{host}:{self.port}"
