"""Shared-secret bearer authentication between meshnet services.

Services call :func:`check_bearer` before reading a request body: a missing
or malformed ``Authorization`` header is a 401, a wrong secret a 403. The
comparison is constant time so the secret cannot be guessed byte by byte.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

DEFAULT_SECRET: Final = "meshnet-dev-secret"
"""The development secret; the CLI warns when a mesh runs with it."""
SCHEME: Final = "Bearer"
MAX_AUTHORIZATION_CHARS: Final = 4096
"""Longest ``Authorization`` value considered; longer ones are malformed."""


@dataclass(frozen=True)
class AuthFailure:
    """Why a request was refused: ``status`` is 401 (no credential) or 403 (wrong credential)."""

    status: Literal[401, 403]
    message: str

    @property
    def error_type(self) -> str:
        """The OpenAI error ``type`` matching :attr:`status`."""
        return "authentication_error" if self.status == 401 else "permission_error"

    @property
    def code(self) -> str:
        """The error ``code`` services answer with: ``unauthorized`` (401) or ``forbidden`` (403)."""
        return "unauthorized" if self.status == 401 else "forbidden"


def check_bearer(authorization: str | None, secret: str) -> AuthFailure | None:
    """Check an ``Authorization`` header value against ``secret``.

    Returns ``None`` when it is exactly ``Bearer <secret>`` (scheme
    case-insensitive), else the :class:`AuthFailure` to answer.
    """
    if not authorization:
        return AuthFailure(401, "missing Authorization header (expected 'Bearer <secret>')")
    if len(authorization) > MAX_AUTHORIZATION_CHARS:
        return AuthFailure(401, "malformed Authorization header (too long)")
    scheme, _, credential = authorization.strip().partition(" ")
    credential = credential.strip()
    if scheme.lower() != SCHEME.lower() or not credential:
        return AuthFailure(401, "malformed Authorization header (expected 'Bearer <secret>')")
    if not hmac.compare_digest(credential.encode("utf-8"), secret.encode("utf-8")):
        return AuthFailure(403, "invalid credential")
    return None


def check_bearer_any(authorization: str | None, credentials: Sequence[str]) -> AuthFailure | None:
    """Like :func:`check_bearer`, accepting any one of ``credentials`` (a mesh secret, client API keys).

    Every candidate is compared (in constant time each), so the answer's timing
    does not tell which one nearly matched.
    """
    failures = [check_bearer(authorization, credential) for credential in credentials if credential]
    if not failures:
        return AuthFailure(403, "no credential is accepted here")
    if any(failure is None for failure in failures):
        return None
    return failures[0]


def bearer_headers(secret: str) -> dict[str, str]:
    """The headers that authenticate a request with ``secret``."""
    return {"Authorization": f"{SCHEME} {secret}"}
