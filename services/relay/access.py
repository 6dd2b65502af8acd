"""Who may reach what through the relay: the credential decides, at the handshake.

The relay forwards to a peer only what the peer's own checks would let the
caller have. A peer (a node) serves three kinds of path: its public health
(``GET /health``, open to anyone who can dial it), ``/forward`` (the mesh
credential, checked by the node), and its head endpoints (meant to be dialled
directly by the tracker, whose own front door checks clients). Relaying a
caller's request with no credential into that app gave anyone on the
internet the app as seen from inside the mesh. So:

- a caller that presents the mesh credential (``Authorization: Bearer
  <MESHNET_SECRET>`` at the WebSocket handshake; checked before anything else,
  401 missing or malformed, 403 wrong) is *authenticated* and may reach
  everything the peer serves. ``/mux`` callers always are;
- an ``/rpc`` caller without one is *anonymous* and reaches only the peer's
  public health: ``GET /health``, sent to the peer with no headers and no body.
  Any other request is answered 401 ``unauthorized`` inside the envelope,
  without reaching the peer. A relay with ``rpc_requires_auth`` refuses
  anonymous callers at the handshake instead.

The reference's JSON envelope is unchanged; its callers add the credential to
the handshake (``websockets.connect(url, additional_headers=...)``).
"""

from __future__ import annotations

from typing import Final

from meshwire.auth import AuthFailure, check_bearer
from meshwire.envelope import HttpMethod
from services.relay.budgets import CallerKind
from services.relay.metrics import Transport

PUBLIC_METHOD: Final = "GET"
PUBLIC_PATH: Final = "/health"
"""The one request an anonymous ``/rpc`` caller may relay: the peer's public health check."""


def caller_kind(authorization: str | None, secret: str, transport: Transport, *,
                rpc_requires_auth: bool) -> CallerKind | AuthFailure:
    """What a caller is by its handshake's ``Authorization`` value, or why it is refused.

    A credential that is presented is always checked, so a wrong one is a 403
    even where none is needed; none at all is anonymous on ``/rpc`` (unless
    ``rpc_requires_auth``) and a 401 on ``/mux``.
    """
    if authorization is None and transport == "rpc" and not rpc_requires_auth:
        return "anonymous"
    failure = check_bearer(authorization, secret)
    return "authenticated" if failure is None else failure


def is_public(method: HttpMethod, path: str) -> bool:
    """Whether an anonymous caller may relay ``method path``: exactly ``GET /health``."""
    return method == PUBLIC_METHOD and path == PUBLIC_PATH


def refusal_message(method: HttpMethod, path: str) -> str:
    """The words of the 401 answered to an anonymous caller's request for anything else."""
    return (f"{method} {path[:200]} needs the mesh credential: an /rpc caller without "
            f"'Authorization: Bearer <secret>' at the handshake reaches only {PUBLIC_METHOD} {PUBLIC_PATH}")
