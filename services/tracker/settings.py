"""The tracker's configuration, read from ``MESHNET_*`` environment variables.

Every field has an environment twin: ``node_ttl_s`` is ``MESHNET_NODE_TTL_S``,
``api_keys`` is ``MESHNET_API_KEYS`` (a comma-separated list). The defaults
suit a local mesh; every limit the tracker enforces is a field here or a named
constant in :mod:`meshwire.limits`.
"""

from __future__ import annotations

from typing import Annotated, Final

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from meshwire import limits, tls
from meshwire.auth import DEFAULT_SECRET
from meshwire.fields import ApiKeyList
from meshwire.serving import SlowClientSettings, TlsClientSettings

DEFAULT_PORT: Final = 8000
ROUTE_TTL_S: Final = 60.0
"""Default lifetime of a signed route (the head opens its sessions at once; failover asks for new routes)."""


class TrackerSettings(BaseSettings, SlowClientSettings, TlsClientSettings):
    """How one tracker runs: where it listens, its secrets, its clocks and its bounds (TLS and the slow-client
    guards from :mod:`meshwire.serving`)."""

    model_config = SettingsConfigDict(env_prefix="MESHNET_", frozen=True, extra="ignore",
                                      use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    secret: str = Field(DEFAULT_SECRET, min_length=1)
    """The mesh's shared secret: admits nodes that hold no join token (a mesh that issues none)."""
    allow_private_endpoints: bool = True
    """Whether nodes may register loopback/private endpoints (off for a public mesh; link-local never)."""
    admin_key: str = Field("", max_length=1024)
    """The operator's credential for the admin API (join tokens, key rotation); empty: the admin API is off."""
    api_keys: Annotated[tuple[str, ...], NoDecode, ApiKeyList] = ()
    """Client API keys for the OpenAI front door; empty means the front door is open."""
    key_requests_per_minute: int = Field(0, ge=0, le=1_000_000)
    """Requests one API key may make in any 60 s (429 with ``Retry-After`` beyond); 0: no limit."""
    key_max_streams: int = Field(0, ge=0, le=65536)
    """Requests (streamed or not) one API key may have in flight at once (429 beyond); 0: no limit."""

    store: str = Field("memory", min_length=1, max_length=limits.MAX_URL_CHARS)
    """Where the registry lives: ``memory`` (this process) or ``redis://host:port/db``, shared by several trackers."""

    # --- registry clocks -------------------------------------------------------
    node_ttl_s: float = Field(6.0, gt=0, le=3600)
    """A node whose last heartbeat is older than this leaves every route."""
    heartbeat_s: float = Field(2.0, gt=0, le=600)
    """The heartbeat interval the tracker asks nodes for (a hint in the registration answer)."""
    suspect_after_s: float | None = Field(None, gt=0)
    """A node silent this long is shown ``suspect`` (still routable); default: half the TTL."""
    offline_keep_s: float = Field(300.0, ge=0, le=86400)
    """How long a departed node stays listed as ``offline`` before it is forgotten."""
    max_nodes: int = Field(1024, ge=1, le=65536)
    """Most node entries (live and recently departed) the registry holds."""

    # --- failure backoff -----------------------------------------------------------
    failure_backoff_s: float = Field(5.0, gt=0, le=3600)
    """Backoff after a node's first reported failure; it doubles on each repeat."""
    failure_backoff_max_s: float = Field(60.0, gt=0, le=86400)
    """Longest backoff a run of failures can earn."""
    failure_reset_s: float = Field(120.0, gt=0, le=86400)
    """A node with no failure report for this long starts its next backoff from the beginning."""

    # --- verification (issue 37) ---------------------------------------------------------
    verify_rate: float | None = Field(None, ge=0.0, le=1.0)
    """Fraction of routes planned with a shadow that recomputes one hop's steps for comparison (so, on average,
    of steps spot-checked); only where another node holds that hop's layers. Unset: 0.02. 0: no checks."""

    # --- streams whose head dies -------------------------------------------------------
    continue_attempts: int = Field(3, ge=0, le=16)
    """New heads tried for a stream whose head died mid-answer (0: the stream ends with an error event)."""
    continue_deadline_s: float = Field(120.0, gt=0, le=3600)
    """Longest a stream may spend continuing after head failures before it ends with an error event."""

    # --- routes ----------------------------------------------------------------------
    route_ttl_s: float = Field(ROUTE_TTL_S, gt=0, le=86400)
    """Lifetime of a signed route: how long after it is signed a route may open sessions (an open session's
    steps ride on it), so the bound on a revoked node's routes opening new ones."""
    route_key_rotate_s: float = Field(7 * 86400.0, ge=0, le=365 * 86400)
    """Age at which the route-signing key (Ed25519) is replaced by a new one; 0: only when rotated by hand."""
    route_key_lead_s: float = Field(60.0, ge=0, le=86400)
    """How long a new route key is published (``GET /v1/keys``) before it signs."""
    pd_min_prompt_tokens: int = Field(256, ge=1, le=1 << 20)
    """A prompt at least this long is prefilled on the mesh's prefill nodes (``--role prefill``) and decoded
    on the others, when the mesh has a complete prefill group; shorter prompts take the plain route."""

    # --- the OpenAI front door -------------------------------------------------------
    max_body_bytes: int = Field(limits.MAX_REQUEST_BYTES, ge=1024, le=256 * limits.MIB)
    """Largest request body the tracker reads."""
    proxy_connect_timeout_s: float = Field(5.0, gt=0, le=600)
    """Time to open a connection to a head node."""
    proxy_read_timeout_s: float = Field(300.0, gt=0, le=3600)
    """Longest silence allowed from a head node (a long prefill happens before the first byte)."""
    proxy_write_timeout_s: float = Field(30.0, gt=0, le=600)
    max_connections: int = Field(256, ge=1, le=65536)
    """Most simultaneous connections from the tracker to head nodes."""

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: str) -> str:
        value = value.strip()
        if value != "memory" and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"store must be 'memory' or a redis://host:port/db URL, got {value[:100]!r}")
        return value

    @model_validator(mode="after")
    def _check_clocks(self) -> TrackerSettings:
        if self.heartbeat_s >= self.node_ttl_s:
            raise ValueError(f"heartbeat_s ({self.heartbeat_s}) must be shorter than node_ttl_s "
                             f"({self.node_ttl_s}), or every node would expire between heartbeats")
        if self.failure_backoff_max_s < self.failure_backoff_s:
            raise ValueError("failure_backoff_max_s must be at least failure_backoff_s")
        return self

    @property
    def suspect_s(self) -> float:
        """Silence after which a node is shown ``suspect``."""
        return self.suspect_after_s if self.suspect_after_s is not None else self.node_ttl_s / 2

    @property
    def url(self) -> str:
        """The base URL clients use (``0.0.0.0`` shown as ``127.0.0.1``)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{tls.scheme(self.tls_cert is not None)}://{host}:{self.port}"
