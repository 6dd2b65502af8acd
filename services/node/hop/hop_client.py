"""Sending a frame to the next hop of a route: directly, or through the relay.

Every frame is signed with this node's hop key (:mod:`meshwire.hop_proof`): the
next hop accepts it because the tracker's signed route names that key for
this node, not because the sender knows a secret. A hop is dialled at its ``endpoint`` over keep-alive HTTP/1.1 connections
(:mod:`services.node.hop.hop_http`), so a decode step costs one small request on
an open connection. A
hop behind NAT also has a ``relay_addr``: when it cannot be dialled directly
(connection refused, or no answer to the connect at all: a NAT drops the
packets, which shows as a connect timeout), the frame goes through the relay
(``meshwire.relay_client.RelayCaller``).

A ``relay_addr`` is what the peer registered: an address the peer chose. So
this node shows such a relay no bearer credential (its join token or the
mesh secret would be the peer's to keep); it shows a proof signed with its
hop key, bound to the peer it calls and to the signed route naming both
(:mod:`meshwire.relay_auth`), useless to anyone else. Only the relay this
node's own operator configured (``--relay``) gets the bearer credential, as before.

Such an endpoint is then remembered as relay-only (:class:`DirectPaths`), so
later frames go straight to the relay instead of waiting on a dead direct
path each time. When the memory runs out (:data:`RELAY_ONLY_TTL_S`) the
direct path is probed in the background (``GET /health``) while frames keep
going through the relay: no token ever waits on a direct path already known
to be dead. A probe that connects sends traffic back to the direct path.

Failures that mean "this hop is gone" (cannot connect, connection reset, no
answer in time) raise :class:`HopUnreachable` naming the hop, which a hop
turns into a 502 ``hop_failed`` and the head into failover. An HTTP answer,
whatever its status, is returned as a :class:`HopAnswer` for the caller to judge.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
import orjson
from pydantic import ValidationError

from meshwire import errors
from meshwire import headers as h
from meshwire.failure_proof import FIELD as FAILURE_PROOF
from meshwire.failure_proof import failure_believed, sign_failure
from meshwire.fork import FORK_REFUSED
from meshwire.forward_step import ForwardAnswer
from meshwire.frames import get_header
from meshwire.hop_proof import sign_request
from meshwire.kv_handoff import HANDOFF_FAILED
from meshwire.relay_auth import relay_handshake
from meshwire.relay_client import RelayCaller, RelayError, relay_parts, ws_base
from meshwire.route_keys import KeySet, SigningKey
from meshwire.routes import RouteError, RouteNode, verify_route
from services.node.hop.hop_http import HopConnectFailed, HopHttp, HopHttpError, HopTimedOut

logger = logging.getLogger(__name__)

FORWARD_PATH: Final = "/forward"
OCTET_STREAM: Final = "application/octet-stream"
PROBE_PATH: Final = "/health"
BUSY_CODES: Final = frozenset({"kv_budget", "too_many_sessions", "draining"})
"""503 codes that mean "busy, try later" rather than "this node failed"."""
INVALID_SAMPLING: Final = "invalid_sampling"
"""The 400 code of a tail that could not sample with the request's parameters: the client's fault."""
DEFAULT_RETRY_AFTER_S: Final = "2"
MAX_ANSWER_BYTES: Final = 1 << 20
"""Largest answer accepted from a hop (answers are small JSON)."""
DIRECT_CONNECT_TIMEOUT_S: Final = 3.0
"""How long dialling a hop directly may take before it counts as unreachable (allows one SYN retry)."""
RELAY_ONLY_TTL_S: Final = 60.0
"""How long an endpoint that could not be dialled is reached through its relay before it is probed again."""
MAX_REMEMBERED_ENDPOINTS: Final = 4096
"""Most relay-only endpoints remembered at once (the oldest is forgotten first)."""


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


class DirectPaths:
    """Endpoints known not to be dialable directly, and when each is due for another look.

    Pure bookkeeping with an injected clock; bounded to :data:`MAX_REMEMBERED_ENDPOINTS`.
    """

    def __init__(self, ttl_s: float = RELAY_ONLY_TTL_S, clock: Callable[[], float] = time.monotonic,
                 max_endpoints: int = MAX_REMEMBERED_ENDPOINTS) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._max = max_endpoints
        self._probe_at: OrderedDict[str, float] = OrderedDict()

    def relay_only(self, endpoint: str) -> bool:
        """True when ``endpoint`` is known not to answer directly (expired memories included)."""
        return endpoint in self._probe_at

    def probe_due(self, endpoint: str) -> bool:
        """True when a relay-only ``endpoint`` should be tried directly again."""
        at = self._probe_at.get(endpoint)
        return at is not None and self._clock() >= at

    def unreachable(self, endpoint: str) -> None:
        """Remember (again) that ``endpoint`` cannot be dialled, for the next ``ttl_s``."""
        self._probe_at.pop(endpoint, None)
        self._probe_at[endpoint] = self._clock() + self._ttl_s
        while len(self._probe_at) > self._max:
            self._probe_at.popitem(last=False)

    def reachable(self, endpoint: str) -> None:
        """``endpoint`` answers directly again."""
        self._probe_at.pop(endpoint, None)


class HopClient:
    """Posts frames to hops for one node, over its own keep-alive connections or one relay caller.

    :meth:`aclose` stops the probes and closes the frame and relay
    connections (``http``, used for the rare direct-path probes, belongs to
    the caller).
    """

    def __init__(self, http: httpx.AsyncClient, relay_credential: str, timeout_s: float, *, node_id: str,
                 hop_key: SigningKey, connect_timeout_s: float = DIRECT_CONNECT_TIMEOUT_S,
                 relay_only_ttl_s: float = RELAY_ONLY_TTL_S, clock: Callable[[], float] = time.monotonic,
                 tls_context: ssl.SSLContext | None = None, own_relays: Collection[str] = ()) -> None:
        """``own_relays``: relay URLs this node's operator configured, which alone get ``relay_credential``."""
        self._http = http
        self._node_id = node_id
        self._hop_key = hop_key
        self._timeout_s = timeout_s
        self._timeout = httpx.Timeout(timeout_s, connect=min(connect_timeout_s, timeout_s))
        self._frames = HopHttp(connect_timeout_s=min(connect_timeout_s, timeout_s), max_answer_bytes=MAX_ANSWER_BYTES,
                               tls=tls_context)
        self._relay: RelayCaller | None = RelayCaller(relay_credential, ssl_context=tls_context)
        self._own_relays = frozenset(ws_base(url) for url in own_relays)
        self._paths = DirectPaths(relay_only_ttl_s, clock)
        self._probes: dict[str, asyncio.Task[None]] = {}
        self.route_keys: Callable[[], KeySet] | None = None
        """The route keys this node verifies routes with (its runtime sets it): a downstream claim of a failure
        is checked against the hop keys the route names."""

    def attested(self, failure: ChainFailure, node: RouteNode, headers: Mapping[str, str]) -> ChainFailure:
        """``failure`` of the frame sent to ``node`` (this node's next hop), as this node answers it on.

        Blame rests on evidence (:mod:`meshwire.failure_proof`): a claim that a
        node after ``node`` failed is passed on only with the signed word of
        the hop before that node; without it, ``node``, which answered the
        claim, is blamed. When ``node`` is the one blamed, this node signs that
        it failed it, with its hop key. Failures naming no node pass unchanged.
        """
        token, session = get_header(headers, h.ROUTE), get_header(headers, h.SESSION)
        if failure.failed_node is None or not token or not session:
            return failure
        error = failure.body.get("error")
        error = error if isinstance(error, dict) else {}
        if failure.failed_node != node.node_id:
            if self._believed(error.get(FAILURE_PROOF), token, session, failure.failed_node):
                return failure
            logger.warning("hop %s blames %s without the signed word of the hop before it: blaming %s, which "
                           "answered", node.node_id, str(failure.failed_node)[:100], node.node_id)
            error = {**error, "failed_node": node.node_id}
        proof = sign_failure(self._hop_key, self._node_id, token, session, node.node_id)
        body = {**failure.body, "error": {**error, FAILURE_PROOF: proof}}
        return ChainFailure(failure.status, body, failed_node=node.node_id, refused_code=failure.refused_code)

    def _believed(self, proof: object, token: str, session: str, failed_node: str) -> bool:
        """Whether ``proof`` is the signed word of the hop before ``failed_node`` on the route ``token``."""
        if self.route_keys is None:
            return True  # nothing to check a route with (a client without the node's trust): as before
        try:
            route = verify_route(token, self.route_keys(), check_expiry=False)
        except RouteError:
            return False
        return failure_believed(proof, route, token, session, failed_node)

    def relay_only(self, endpoint: str) -> bool:
        """Whether frames for ``endpoint`` go through its relay now, its direct path being known dead."""
        return self._paths.relay_only(endpoint)

    async def post_frame(self, node: RouteNode, headers: Mapping[str, str], body: bytes, *,
                         path: str = FORWARD_PATH, content_type: str = OCTET_STREAM) -> HopAnswer:
        """POST one frame (or a batch, at ``path``) to ``node``; raise :class:`HopUnreachable` when it is gone."""
        out_headers = {**headers, "Content-Type": content_type}
        # Signed with this node's hop key, which the route names for it: the next hop checks it came from here.
        out_headers.update(sign_request(self._hop_key, self._node_id, path, out_headers, body))
        relayable = node.relay_addr is not None and self._relay is not None
        if relayable and self._paths.relay_only(node.endpoint):
            if self._paths.probe_due(node.endpoint):
                self._probe_soon(node.endpoint)
            return await self._via_relay(node, out_headers, body, path)
        try:
            answer = await self._frames.request("POST", node.endpoint, path, out_headers, body, self._timeout_s)
        except HopConnectFailed as exc:  # never reached the hop: safe to try another way
            if relayable:
                logger.info("hop %s not reachable directly at %s (%s); using its relay", node.node_id,
                            node.endpoint, exc)
                self._paths.unreachable(node.endpoint)
                return await self._via_relay(node, out_headers, body, path)
            raise HopUnreachable(node.node_id, f"cannot connect to {node.endpoint}: {exc}") from exc
        except HopTimedOut as exc:
            raise HopUnreachable(node.node_id, f"no answer within {self._timeout_s:.0f} s") from exc
        except HopHttpError as exc:
            raise HopUnreachable(node.node_id, str(exc)) from exc
        return HopAnswer(status=answer.status, body=answer.body, headers=answer.headers)

    def _probe_soon(self, endpoint: str) -> None:
        """Try ``endpoint`` directly in the background (at most one probe per endpoint at a time)."""
        if endpoint in self._probes:
            return
        self._paths.unreachable(endpoint)  # not due again while this probe runs, nor after it fails
        task = asyncio.create_task(self._probe(endpoint), name=f"probe {endpoint}")
        self._probes[endpoint] = task
        task.add_done_callback(lambda _: self._probes.pop(endpoint, None))

    async def _probe(self, endpoint: str) -> None:
        try:
            await self._http.get(f"{endpoint}{PROBE_PATH}", timeout=self._timeout)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            logger.debug("%s still not reachable directly; staying on its relay", endpoint)
            return
        except httpx.HTTPError:
            pass  # connected, so the direct path works, whatever the answer
        logger.info("%s is reachable directly again", endpoint)
        self._paths.reachable(endpoint)

    def _handshake(self, node: RouteNode, headers: Mapping[str, str]) -> dict[str, str] | None:
        """What opens a connection to ``node``'s relay: ``None`` (the bearer credential) for a relay this node's
        operator configured; for one the peer chose, a proof bound to that peer and the frame's signed route."""
        assert node.relay_addr is not None
        try:
            base, peer = relay_parts(node.relay_addr)
        except RelayError as exc:
            raise HopUnreachable(node.node_id, str(exc)) from None
        if base in self._own_relays:
            return None
        route = next((value for name, value in headers.items() if name.lower() == "x-meshnet-route"), None)
        if not route:
            raise HopUnreachable(node.node_id, f"its relay {base} is not this node's own, and this request carries "
                                               "no signed route to show it")
        return relay_handshake(self._hop_key, self._node_id, route, peer)

    async def _via_relay(self, node: RouteNode, headers: dict[str, str], body: bytes, path: str) -> HopAnswer:
        assert self._relay is not None and node.relay_addr is not None
        handshake = self._handshake(node, headers)
        try:
            status, answer_headers, answer_body = await self._relay.request(
                node.relay_addr, "POST", path, headers, body, self._timeout_s, handshake=handshake)
        except Exception as exc:  # any relay failure means the hop cannot be reached
            raise HopUnreachable(node.node_id, f"relay {node.relay_addr} failed: {exc}") from exc
        if len(answer_body) > MAX_ANSWER_BYTES:
            raise HopUnreachable(node.node_id, f"answer of {len(answer_body)} bytes is too large")
        return HopAnswer(status=status, body=answer_body,
                         headers={k.lower(): v for k, v in dict(answer_headers).items()})

    async def aclose(self) -> None:
        """Stop the direct-path probes and close the relay connections (shutdown)."""
        probes = list(self._probes.values())
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        await self._frames.aclose()
        if self._relay is not None:
            await self._relay.close()


class ChainFailure(Exception):
    """The rest of the route did not produce an answer.

    ``failed_node`` names the node that failed (unreachable, crashed, lost the
    session, misconfigured); it is ``None`` when a node was merely busy
    (503 ``kv_budget``): then ``busy_node`` names it and ``retry_after`` says
    when to try again. Both are ``None`` when the request itself was at fault
    (:attr:`client_fault`: a 400 ``invalid_sampling`` from the tail), which
    nobody routes around. ``status`` and ``body`` are what a hop answers its own
    caller: a 502 ``hop_failed`` naming the failed node, the busy 503 or the 400 as received.
    """

    def __init__(self, status: int, body: dict[str, Any], *, failed_node: str | None = None,
                 busy_node: str | None = None, retry_after: str | None = None, handoff_failed: bool = False,
                 refused_code: str | None = None) -> None:
        super().__init__(str(body.get("error", {}).get("message", "hop failed")))
        self.status = status
        self.body = body
        self.failed_node = failed_node
        self.busy_node = busy_node
        self.retry_after = retry_after
        self.handoff_failed = handoff_failed
        """A decode hop could not take a prefill handoff's KV over (409 ``handoff_failed``): nobody failed,
        the head prefills the prompt along the same route instead."""
        self.refused_code = refused_code
        """When ``failed_node`` refused the frame (a 400): its error code (``bad_encoding``...)."""

    @property
    def client_fault(self) -> bool:
        """True when the request, not a node, made the route fail."""
        return self.failed_node is None and self.busy_node is None and not self.handoff_failed


def hop_failed(node_id: str, reason: str, refused_code: str | None = None) -> ChainFailure:
    """The failure of ``node_id``, as the 502 ``hop_failed`` a hop answers (``refused_code``: its 400's code)."""
    body = errors.error_body(f"hop {node_id} failed: {reason}", errors.SERVER_ERROR, "hop_failed",
                             failed_node=node_id)
    return ChainFailure(502, body, failed_node=node_id, refused_code=refused_code)


async def send_along(client: HopClient, node: RouteNode, headers: Mapping[str, str], body: bytes) -> ForwardAnswer:
    """Send a frame to ``node`` and judge the answer: a :class:`ForwardAnswer`, or :class:`ChainFailure`."""
    try:
        answer = await client.post_frame(node, headers, body)
    except HopUnreachable as exc:
        raise client.attested(hop_failed(node.node_id, exc.reason), node, headers) from exc
    try:
        return judge_answer(node, answer)
    except ChainFailure as exc:  # this node met the failure of its next hop: it says so under its own key
        raise client.attested(exc, node, headers) from exc


def judge_answer(node: RouteNode, answer: HopAnswer) -> ForwardAnswer:
    """What ``node`` answered one frame: a :class:`ForwardAnswer`, or the :class:`ChainFailure` it means."""
    if answer.status == 200:
        try:
            return ForwardAnswer.model_validate_json(answer.body)
        except ValidationError:
            raise hop_failed(node.node_id, "its answer is not a forward answer") from None
    return judge_payload(node, answer.status, answer.json(), answer.headers.get("retry-after"))


def judge_payload(node: RouteNode, status: int, payload: Any, retry_after: str | None) -> ForwardAnswer:
    """:func:`judge_answer` for an answer whose JSON body is already parsed (a row of ``/forward/rows``)."""
    if status == 200:
        try:
            return ForwardAnswer.model_validate(payload)
        except ValidationError:
            raise hop_failed(node.node_id, "its answer is not a forward answer") from None
    error = payload.get("error") if isinstance(payload, dict) else None
    error = error if isinstance(error, dict) else {}
    code, named = error.get("code"), error.get("failed_node") or error.get("node_id")
    if status == 502 and code == "hop_failed" and isinstance(named, str):
        raise ChainFailure(502, payload, failed_node=named)
    if status == 503 and code in BUSY_CODES:
        busy = named if isinstance(named, str) else node.node_id
        raise ChainFailure(503, payload, busy_node=busy, retry_after=retry_after or DEFAULT_RETRY_AFTER_S)
    if status == 400 and code == INVALID_SAMPLING:
        raise ChainFailure(400, payload)
    if status == 409 and code in (HANDOFF_FAILED, FORK_REFUSED):
        raise ChainFailure(409, payload, handoff_failed=True)
    culprit = named if isinstance(named, str) else node.node_id
    message = str(error.get("message", str(payload)[:200]))
    refused = str(code) if status == 400 and isinstance(code, str) and culprit == node.node_id else None
    raise hop_failed(culprit, f"answered {status} {code or ''}: {message}".strip(), refused)
