"""No service off loopback with an empty or published secret.

A secret that ships in this repository (the development default, the compose
file's old fallback, the example ``.env``'s placeholder, the tests') is known
to everyone: a service that listens beyond this machine with it lets anyone
register a node, mint a route or join the relay. :func:`require_private_secret`
refuses that at start, naming the setting and how to make a secret; a service
on loopback (``meshnet up``, ``make mesh``) keeps working with nothing set.
"""

from __future__ import annotations

import ipaddress
from typing import Final

from meshwire.auth import DEFAULT_SECRET

KNOWN_SECRETS: Final = frozenset({
    DEFAULT_SECRET,
    "change-me-mesh-secret",
    "change-me-to-a-long-random-string",
    "test-mesh-secret",
    "change-me",
    "secret",
})
"""Secrets published in this repository (defaults, placeholders, the tests')."""
MAKE_A_SECRET: Final = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
"""The command the refusal suggests."""
SECRET_SETTING: Final = "MESHNET_SECRET"


class UnsafeSecret(ValueError):
    """A service would listen beyond loopback with an empty or published secret."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine (``127.x``, ``::1``, ``localhost``).

    A wildcard (``0.0.0.0``, ``::``, empty), any other address and any other
    name count as reachable from elsewhere.
    """
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def secret_problem(secret: str) -> str | None:
    """What is wrong with ``secret`` for a service others can reach, or ``None``."""
    if not secret.strip():
        return "is empty"
    if secret in KNOWN_SECRETS:
        return f"is {secret!r}, a default published with meshnet"
    return None


def require_private_secret(service: str, host: str, secret: str, setting: str = SECRET_SETTING) -> None:
    """Raise :class:`UnsafeSecret` when ``service`` would listen on non-loopback ``host`` with a known secret."""
    if is_loopback(host):
        return
    problem = secret_problem(secret)
    if problem is None:
        return
    raise UnsafeSecret(
        f"{service} refuses to listen on {host or '0.0.0.0'} while {setting} {problem}: anyone who can reach it "
        f"could join the mesh. Make a secret with `{MAKE_A_SECRET}`, set {setting} to it on every machine "
        f"of the mesh, or listen on 127.0.0.1 only.")
