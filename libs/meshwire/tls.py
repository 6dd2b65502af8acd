"""TLS for meshnet's servers and clients, from three settings every service shares.

- ``tls_cert`` / ``tls_key`` (``MESHNET_TLS_CERT`` / ``MESHNET_TLS_KEY``): the
  PEM certificate chain and private key a service presents; with both set it
  serves HTTPS (and WSS) only (uvicorn's ``ssl_certfile`` / ``ssl_keyfile``).
- ``tls_ca`` (``MESHNET_TLS_CA``): the PEM bundle a service's clients verify
  the services they call with (node to node, node to tracker, tracker to
  node, relay links, the CLI). Unset: each client's default roots. A private
  mesh with its own CA sets it everywhere.

Clients always verify ``https://`` and ``wss://`` peers (certificate and
host name); plain ``http://`` URLs stay plain.
"""

from __future__ import annotations

import functools
import ssl
from pathlib import Path
from typing import Any


def check_pair(cert: str | None, key: str | None) -> None:
    """``ValueError`` unless both or neither are given, and each given file exists."""
    if (cert is None) != (key is None):
        raise ValueError("tls_cert and tls_key go together: set both (MESHNET_TLS_CERT, MESHNET_TLS_KEY) or neither")
    for name, path in (("tls_cert", cert), ("tls_key", key)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{name}: no such file {path!r}")


def check_ca(ca: str | None) -> None:
    """``ValueError`` when ``ca`` names a file that does not exist."""
    if ca is not None and not Path(ca).is_file():
        raise ValueError(f"tls_ca: no such file {ca!r}")


def server_options(cert: str | None, key: str | None) -> dict[str, Any]:
    """uvicorn's keyword arguments for serving with ``cert`` and ``key`` (none when unset)."""
    if cert is None or key is None:
        return {}
    return {"ssl_certfile": cert, "ssl_keyfile": key}


@functools.cache
def client_context(ca: str | None = None) -> ssl.SSLContext | None:
    """A verifying client context trusting ``ca``'s roots; ``None`` without ``ca`` (each client's default:
    the system's roots for sockets and websockets, certifi's for httpx).

    Cached per file: every client of a process shares one context (building
    one loads the bundle).
    """
    return ssl.create_default_context(cafile=ca) if ca else None


def httpx_verify(ca: str | None = None) -> ssl.SSLContext | bool:
    """httpx's ``verify=``: a context trusting ``ca``, else ``True`` (httpx's default verification)."""
    return client_context(ca) or True


def scheme(tls: bool, websocket: bool = False) -> str:
    """``https``/``http`` (or ``wss``/``ws``) for a service that does or does not serve TLS."""
    if websocket:
        return "wss" if tls else "ws"
    return "https" if tls else "http"
