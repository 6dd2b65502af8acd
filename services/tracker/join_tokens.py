"""Join tokens: one credential per node, issued by the operator, revocable.

A token reads ``mnj_<token id>_<secret>``. The store keeps only the SHA-256
of the secret (:class:`JoinTokenRecord`), so a copy of the store does not
hand out tokens. A token binds a node id (a node registers under no other,
and no other credential registers under it while the token is valid) and may
bind the model and the layers the node holds. A revoked or expired token is
refused at the node's next registration or heartbeat.

:func:`check_token` is pure: the caller looks the record up in its store.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from pathlib import PurePath
from typing import Annotated, Final

from pydantic import BaseModel, Field, ValidationError

from meshwire.fields import STRICT_MODEL, AsTuple, LayerIndex, ModelName, NodeId
from meshwire.registry import NodeRegistration

PREFIX: Final = "mnj_"
TOKEN_ID_BYTES: Final = 8
SECRET_BYTES: Final = 32
MAX_TOKENS: Final = 4096
"""Most join tokens (live, expired or revoked) a mesh keeps."""
MAX_TOKEN_TTL_S: Final = 10 * 365 * 86400.0
MAX_RECORD_BYTES: Final = 4096
_TOKEN: Final = re.compile(r"mnj_(?P<id>[0-9a-f]{16})_(?P<secret>[A-Za-z0-9_\-]{43})")


class TokenRefused(Exception):
    """A join token does not admit this node: ``status`` 401 (not a token we know) or 403 (not for this)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class JoinTokenRecord(BaseModel):
    """A join token as the store holds it."""

    model_config = STRICT_MODEL

    token_id: str = Field(min_length=16, max_length=16, pattern=r"^[0-9a-f]+$")
    secret_sha256: str = Field(min_length=64, max_length=64)
    node_id: NodeId
    model: ModelName | None = None
    layers: Annotated[tuple[LayerIndex, LayerIndex], AsTuple] | None = None
    created_at: float
    expires_at: float | None = None
    revoked_at: float | None = None

    @classmethod
    def parse(cls, text: str) -> JoinTokenRecord | None:
        if len(text) > MAX_RECORD_BYTES:
            return None
        try:
            return cls.model_validate_json(text)
        except ValidationError:
            return None

    def valid(self, now: float) -> bool:
        """Not revoked and not expired."""
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)

    def public(self, now: float) -> dict[str, object]:
        """What ``meshnet token list`` shows: everything but the secret's hash."""
        state = "revoked" if self.revoked_at is not None else "expired" if not self.valid(now) else "valid"
        return {"token_id": self.token_id, "node_id": self.node_id, "model": self.model,
                "layers": None if self.layers is None else f"{self.layers[0]}-{self.layers[1]}",
                "created_at": self.created_at, "expires_at": self.expires_at, "revoked_at": self.revoked_at,
                "state": state}


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("ascii")).hexdigest()


def mint(node_id: str, now: float, *, model: str | None = None, layers: tuple[int, int] | None = None,
         ttl_s: float | None = None) -> tuple[str, JoinTokenRecord]:
    """A new token for ``node_id`` and the record to store (the token itself is shown once)."""
    if layers is not None and layers[0] > layers[1]:
        raise ValueError(f"layers {layers[0]}-{layers[1]}: the first is after the last")
    if ttl_s is not None and not 0 < ttl_s <= MAX_TOKEN_TTL_S:
        raise ValueError(f"ttl must be between 0 and {MAX_TOKEN_TTL_S:.0f} seconds")
    token_id = secrets.token_hex(TOKEN_ID_BYTES)
    secret = secrets.token_urlsafe(SECRET_BYTES)[:43]
    record = JoinTokenRecord(token_id=token_id, secret_sha256=_digest(secret), node_id=node_id, model=model,
                             layers=layers, created_at=now, expires_at=None if ttl_s is None else now + ttl_s)
    return f"{PREFIX}{token_id}_{secret}", record


def looks_like_token(credential: str) -> bool:
    """Whether ``credential`` has a join token's form (rather than a shared secret or an API key)."""
    return credential.startswith(PREFIX)


def token_id_of(token: str) -> str:
    """The id part of ``token``; :class:`TokenRefused` (401) when it is not a join token."""
    match = _TOKEN.fullmatch(token)
    if match is None:
        raise TokenRefused(401, "invalid_credential", "not a join token (expected mnj_<id>_<secret>)")
    return match.group("id")


def check_token(token: str, record: JoinTokenRecord | None, now: float) -> JoinTokenRecord:
    """The record ``token`` proves, if valid; :class:`TokenRefused` otherwise (constant-time secret check)."""
    match = _TOKEN.fullmatch(token)
    if match is None or record is None or record.token_id != match.group("id"):
        raise TokenRefused(403, "invalid_credential", "unknown join token")
    if not hmac.compare_digest(_digest(match.group("secret")), record.secret_sha256):
        raise TokenRefused(403, "invalid_credential", "unknown join token")
    if record.revoked_at is not None:
        raise TokenRefused(403, "token_revoked", f"join token {record.token_id} was revoked")
    if not record.valid(now):
        raise TokenRefused(403, "token_expired", f"join token {record.token_id} has expired")
    return record


def check_binding(record: JoinTokenRecord, registration: NodeRegistration) -> None:
    """Refuse (403) a registration that the token does not allow: another id, model or layers."""
    if registration.node_id != record.node_id:
        raise TokenRefused(403, "token_node_mismatch", f"this join token is for node {record.node_id!r}, "
                                                       f"not {registration.node_id!r}")
    if record.model is not None and record.model not in (registration.model, PurePath(registration.model).name):
        raise TokenRefused(403, "token_model_mismatch", f"this join token allows model {record.model!r}, "
                                                        f"not {registration.model!r}")
    held = (registration.shard_start, registration.shard_end)
    if record.layers is not None and held != record.layers:
        raise TokenRefused(403, "token_layers_mismatch", f"this join token allows layers "
                                                         f"{record.layers[0]}-{record.layers[1]}, not "
                                                         f"{held[0]}-{held[1]}")
