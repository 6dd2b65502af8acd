"""Sending a frame to the next hop of a route: directly, or through the relay.

A hop is dialled at its ``endpoint`` over one shared keep-alive HTTP/1.1
client, so a decode step costs one small request on an open connection. A
hop behind NAT also has a ``relay_addr``: when it cannot be dialled directly,
the frame goes through the relay (``meshwire.relay_client.RelayCaller``), and
the node remembers for a while that this hop is reached that way.

Failures that mean "this hop is gone" (cannot connect, connection reset, no
answer in time) raise :class:`HopUnreachable` naming the hop, which a hop
turns into a 502 ``hop_failed`` and the head into failover. An HTTP answer,
whatever its status, is returned as a :class:`HopAnswer` for the caller to judge.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
import orjson
from pydantic import ValidationError

from meshwire import errors
from meshwire.auth import bearer_headers
from meshwire.routes import RouteNode
from services.node.protocol import ForwardAnswer

try:  # written by the relay piece; without it, hops behind NAT are reached directly or not at all
    from meshwire.relay_client import RelayCaller
except ImportError:  # pragma: no cover - depends on which pieces are installed
    RelayCaller = None  # type: ignore[assignment,misc]

logger = logging.getLogger(__name__)

FORWARD_PATH: Final = "/forward"
BUSY_CODES: Final = frozenset({"kv_budget", "too_many_sessions", "draining"})
"""503 codes that mean "busy, try later" rather than "this node failed"."""
DEFAULT_RETRY_AFTER_S: Final = "2"
MAX_ANSWER_BYTES: Final = 1 << 20
"""Largest answer accepted from a hop (answers are small JSON)."""
PREFER_RELAY_S: Final = 60.0
"""After a hop could not be dialled directly, go through its relay for this long."""


class HopUnreachable(Exception):
    """The hop ``node_id`` could not be reached or did not answer in time."""

    def __init__(self, node_id: str, reason: str) -> None:
        super().__init__(f"hop {node_id} unreachable: {reason}")
        self.node_id = node_id
        self.reason = reason


@dataclass(frozen=True)
class HopAnswer:
    """What a hop answered: status, lower-cased headers, body."""

    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        """The body as JSON, or ``None`` when it is not JSON."""
        try:
            return orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return None


class HopClient:
    """Posts frames to hops for one node; shares one HTTP client and one relay caller."""

    def __init__(self, http: httpx.AsyncClient, secret: str, timeout_s: float) -> None:
        self._http = http
        self._secret = secret
        self._timeout_s = timeout_s
        self._relay = RelayCaller(secret) if RelayCaller is not None else None
        self._prefer_relay_until: dict[str, float] = {}

    async def post_frame(self, node: RouteNode, headers: Mapping[str, str], body: bytes) -> HopAnswer:
        """POST one frame to ``node``'s ``/forward``; raise :class:`HopUnreachable` when it is gone."""
        out_headers = {**headers, **bearer_headers(self._secret), "Content-Type": "application/octet-stream"}
        if node.relay_addr is not None and self._relay is not None and self._relay_preferred(node.node_id):
            return await self._via_relay(node, out_headers, body)
        try:
            response = await self._http.post(f"{node.endpoint}{FORWARD_PATH}", headers=out_headers, content=body,
                                             timeout=self._timeout_s)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached the hop: safe to try another way
            if node.relay_addr is not None and self._relay is not None:
                logger.info("hop %s not reachable directly (%s); using its relay", node.node_id, exc)
                self._prefer_relay_until[node.node_id] = time.monotonic() + PREFER_RELAY_S
                return await self._via_relay(node, out_headers, body)
            raise HopUnreachable(node.node_id, f"cannot connect to {node.endpoint}: {exc}") from exc
        except httpx.TimeoutException as exc:
            raise HopUnreachable(node.node_id, f"no answer within {self._timeout_s:.0f} s") from exc
        except httpx.HTTPError as exc:
            raise HopUnreachable(node.node_id, f"{type(exc).__name__}: {exc}") from exc
        if len(response.content) > MAX_ANSWER_BYTES:
            raise HopUnreachable(node.node_id, f"answer of {len(response.content)} bytes is too large")
        return HopAnswer(status=response.status_code, body=response.content,
                         headers={k.lower(): v for k, v in response.headers.items()})

    def _relay_preferred(self, node_id: str) -> bool:
        until = self._prefer_relay_until.get(node_id)
        if until is None:
            return False
        if time.monotonic() >= until:
            del self._prefer_relay_until[node_id]
            return False
        return True

    async def _via_relay(self, node: RouteNode, headers: dict[str, str], body: bytes) -> HopAnswer:
        assert self._relay is not None and node.relay_addr is not None
        try:
            status, answer_headers, answer_body = await self._relay.request(
                node.relay_addr, "POST", FORWARD_PATH, headers, body, self._timeout_s)
        except Exception as exc:  # any relay failure means the hop cannot be reached
            raise HopUnreachable(node.node_id, f"relay {node.relay_addr} failed: {exc}") from exc
        if len(answer_body) > MAX_ANSWER_BYTES:
            raise HopUnreachable(node.node_id, f"answer of {len(answer_body)} bytes is too large")
        return HopAnswer(status=status, body=answer_body,
                         headers={k.lower(): v for k, v in dict(answer_headers).items()})


class ChainFailure(Exception):
    """The rest of the route did not produce an answer.

    ``failed_node`` names the node that failed (unreachable, crashed, lost the
    session, misconfigured); it is ``None`` when a node was merely busy
    (503 ``kv_budget``): then ``busy_node`` names it and ``retry_after`` says
    when to try again. ``status`` and ``body`` are what a hop answers its own
    caller: a 502 ``hop_failed`` naming the failed node, or the busy 503 as received.
    """

    def __init__(self, status: int, body: dict[str, Any], *, failed_node: str | None = None,
                 busy_node: str | None = None, retry_after: str | None = None) -> None:
        super().__init__(str(body.get("error", {}).get("message", "hop failed")))
        self.status = status
        self.body = body
        self.failed_node = failed_node
        self.busy_node = busy_node
        self.retry_after = retry_after


def hop_failed(node_id: str, reason: str) -> ChainFailure:
    """The failure of ``node_id``, as the 502 ``hop_failed`` a hop answers."""
    body = errors.error_body(f"hop {node_id} failed: {reason}", errors.SERVER_ERROR, "hop_failed",
                             failed_node=node_id)
    return ChainFailure(502, body, failed_node=node_id)


async def send_along(client: HopClient, node: RouteNode, headers: Mapping[str, str], body: bytes) -> ForwardAnswer:
    """Send a frame to ``node`` and judge the answer: a :class:`ForwardAnswer`, or :class:`ChainFailure`."""
    try:
        answer = await client.post_frame(node, headers, body)
    except HopUnreachable as exc:
        raise hop_failed(node.node_id, exc.reason) from exc
    if answer.status == 200:
        try:
            return ForwardAnswer.model_validate_json(answer.body)
        except ValidationError:
            raise hop_failed(node.node_id, "its answer is not a forward answer") from None
    payload = answer.json()
    error = payload.get("error") if isinstance(payload, dict) else None
    error = error if isinstance(error, dict) else {}
    code, named = error.get("code"), error.get("failed_node") or error.get("node_id")
    if answer.status == 502 and code == "hop_failed" and isinstance(named, str):
        raise ChainFailure(502, payload, failed_node=named)
    if answer.status == 503 and code in BUSY_CODES:
        busy = named if isinstance(named, str) else node.node_id
        raise ChainFailure(503, payload, busy_node=busy,
                           retry_after=answer.headers.get("retry-after", DEFAULT_RETRY_AFTER_S))
    culprit = named if isinstance(named, str) else node.node_id
    message = str(error.get("message", answer.body[:200]))
    raise hop_failed(culprit, f"answered {answer.status} {code or ''}: {message}".strip())
