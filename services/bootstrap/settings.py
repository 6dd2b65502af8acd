"""Configuration of the bootstrap service, from arguments or ``MESHNET_*`` environment variables.

``meshnet bootstrap --host H --port P --registry R`` fills the same fields;
every field has its environment twin (``MESHNET_PORT``, ``MESHNET_REGISTRY``,
``MESHNET_READ_TIMEOUT_S``, ...).

The default port, 8998, is the bootstrap port of the PD deployments whose
rendezvous this replaces (SGLang's ``--disaggregation-bootstrap-port``), so
prefill and decode workers configured for them find it unchanged.
"""

from __future__ import annotations

from typing import Final

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from meshwire.serving import ListenerSettings
from services.bootstrap.registry import DEFAULT_HOLD_S, DEFAULT_MAX_RANKS, RegistryKind

DEFAULT_HOST: Final = "0.0.0.0"
"""Every IPv4 interface: decode ranks on other machines must reach the service."""
DEFAULT_PORT: Final = 8998
MAX_REQUEST_BYTES: Final = 4 << 20
"""The reference's request cap, 4 MiB; a larger body is refused before it is read whole."""
READ_TIMEOUT_S: Final = 10.0
"""How long a client may take to send a request's head, and then its body."""
DEFAULT_MAX_CONNECTIONS: Final = 1024
"""Open connections served at once; beyond it a request is answered 503."""
SHUTDOWN_TIMEOUT_S: Final = 5.0
"""How long a stopping server waits for requests in flight."""


class BootstrapSettings(BaseSettings, ListenerSettings):
    """What one bootstrap service listens on, which registry it keeps, and its limits (TLS and connections per
    address from :mod:`meshwire.serving`; ``read_timeout_s`` is its deadline on heads and bodies both)."""

    model_config = SettingsConfigDict(env_prefix="MESHNET_", frozen=True, extra="forbid")

    host: str = Field(DEFAULT_HOST, min_length=1, description="interface to bind ('::' for IPv6 and IPv4)")
    port: int = Field(DEFAULT_PORT, ge=0, le=65_535, description="TCP port; 0 binds an ephemeral one")
    registry: RegistryKind = Field("addresses", description="what source ranks register")
    max_body_bytes: int = Field(MAX_REQUEST_BYTES, ge=1, description="largest request body read")
    read_timeout_s: float = Field(READ_TIMEOUT_S, gt=0, description="time a client has to send a request")
    max_ranks: int = Field(DEFAULT_MAX_RANKS, ge=1, description="slots the table holds")
    max_connections: int = Field(DEFAULT_MAX_CONNECTIONS, ge=1, description="connections served at once")
    shutdown_timeout_s: float = Field(SHUTDOWN_TIMEOUT_S, ge=0, description="grace for requests in flight")
    access_log: bool = Field(True, description="log one line per request")
    secret: str | None = Field(None, min_length=1, max_length=4096,
                               description="the mesh secret: a registration bearing it may register over any slot")
    slot_hold_s: float = Field(DEFAULT_HOLD_S, gt=0, le=86_400,
                               description="how long a signed registration holds its slot against other registrants")
