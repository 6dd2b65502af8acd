"""Routes as a node sees them: verifying its place in one, and getting one from the tracker.

Every hop checks that a route token verifies (the tracker's Ed25519 key, expiry), names this node
at the hop index the frame claims, and gives it the layers it actually holds
(:func:`verify_hop`). A head without a route from the tracker serves alone
when it holds every layer, and otherwise asks the tracker
(:class:`TrackerRoutes`), which is also where a head reports a failed hop and
asks for a route that avoids it (failover): :meth:`TrackerRoutes.route_from_here`
answers only a route this node heads, since a head cannot hand its session's
history to another head mid-stream.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import httpx
from pydantic import ValidationError

from meshwire.auth import bearer_headers
from meshwire.errors import STORE_UNAVAILABLE
from meshwire.route_keys import MAX_JWKS_BYTES, KeyProblem, KeySet
from meshwire.routes import Route, RouteError, RouteNode, SignedRoute, verify_route
from services.node.hop.trust import KeyFetchFailed, RouteTrust
from services.node.model.shard import Shard

logger = logging.getLogger(__name__)

ROUTE_PATH: Final = "/v1/route"
KEYS_PATH: Final = "/v1/keys"
RECEIPTS_PATH: Final = "/v1/receipts"
MAX_ROUTE_ANSWER_BYTES: Final = 64 * 1024
TRACKER_TIMEOUT_S: Final = 10.0
MAX_REASON_CHARS: Final = 500
MAX_OTHER_HEADS: Final = 4
"""Other heads a failover may ask the tracker to leave out before it gives up on a route from here."""


class RouteRefused(Exception):
    """A route cannot be used by this node (bad token, wrong node, wrong layers): 403 ``bad_route``."""


class NoRoute(Exception):
    """No route could be had: the tracker has none (or is unreachable, or not configured)."""

    def __init__(self, message: str, status: int = 503, *, healing: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.healing = healing
        """The tracker said it may move placed nodes onto the missing layers: asking again later may succeed."""


@dataclass(frozen=True)
class RoutedHop:
    """A verified route and this node's place in it."""

    route: Route
    token: str
    hop_index: int
    shadow: bool = False
    """This node is the route's shadow of hop ``hop_index`` (a verifier): it runs the frame and sends nothing on."""

    @property
    def me(self) -> RouteNode:
        return self.route.shadow.node if self.shadow and self.route.shadow else self.route.nodes[self.hop_index]

    @property
    def next(self) -> RouteNode | None:
        """The next hop, or ``None`` at the tail (and at a shadow, which passes nothing on)."""
        if self.shadow:
            return None
        return self.route.nodes[self.hop_index + 1] if self.hop_index + 1 < len(self.route.nodes) else None

    @property
    def next_shadow(self) -> RouteNode | None:
        """The shadow of the next hop, which this node sends each frame of the session to as well (issue 37)."""
        return None if self.shadow else self.route.shadow_of(self.hop_index + 1)

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(node.node_id for node in self.route.nodes)


def refuse_revoked(route: Route, revoked: Collection[str]) -> None:
    """:class:`RouteRefused` when ``route`` names a node whose join token the tracker said was revoked."""
    named = sorted(node.node_id for node in route.nodes if node.node_id in revoked)
    if named:
        raise RouteRefused(f"the route names {named[0]}, whose join token was revoked")


def verify_hop(token: str | None, hop_index: int, *, keys: KeySet, node_id: str, model_id: str,
               shard: Shard, check_expiry: bool = True, revoked: Collection[str] = ()) -> RoutedHop:
    """Verify ``token`` and that its hop ``hop_index`` is this node with the layers it holds.

    ``check_expiry=False`` is for frames of a session already open here: a route's
    expiry bounds when sessions may be opened along it, not how long they may run.
    The signature is checked on every frame all the same, and a route naming a
    node in ``revoked`` (the tracker's heartbeat answer) is refused from then on.
    """
    if not token:
        raise RouteRefused("missing X-Meshnet-Route: a node forwards only along a signed route")
    try:
        route = verify_route(token, keys, check_expiry=check_expiry)
    except RouteError as exc:
        raise RouteRefused(f"route refused ({exc.code}): {exc}") from None
    refuse_revoked(route, revoked)
    if not 0 <= hop_index < len(route.nodes):
        raise RouteRefused(f"hop index {hop_index} is outside the route's {len(route.nodes)} hops")
    placed = route.at(hop_index, node_id)
    if placed is None:
        raise RouteRefused(f"the route names {route.nodes[hop_index].node_id} at hop {hop_index}, this node is "
                           f"{node_id}")
    me, shadow = placed
    if route.model != model_id or route.num_layers != shard.num_layers:
        raise RouteRefused(f"the route is for {route.model} ({route.num_layers} layers); "
                           f"this node serves {model_id} ({shard.num_layers} layers)")
    if me.shard_end != shard.end or not shard.start <= me.start_layer <= shard.end:
        raise RouteRefused(f"the route gives this node layers {me.start_layer}-{me.shard_end}; "
                           f"it holds {shard.start}-{shard.end}")
    return RoutedHop(route=route, token=token, hop_index=hop_index, shadow=shadow)


def verify_prefill_route(token: str, *, keys: KeySet, model_id: str, num_layers: int) -> RoutedHop:
    """Verify a prefill route a decode head was handed (``X-Meshnet-Prefill-Route``): signed, unexpired, this model.

    The head is not on it: it only sends the prompt to the route's head, which checks its own place.
    """
    try:
        route = verify_route(token, keys)
    except RouteError as exc:
        raise RouteRefused(f"route refused ({exc.code}): {exc}") from None
    if route.model != model_id or route.num_layers != num_layers:
        raise RouteRefused(f"the prefill route is for {route.model} ({route.num_layers} layers); "
                           f"this node serves {model_id} ({num_layers} layers)")
    return RoutedHop(route=route, token=token, hop_index=0)


class TrackerRoutes:
    """The head's view of the trackers: ask for routes, report failed nodes.

    With several trackers (``--tracker URL1,URL2``, one mesh on a shared
    store) a request goes to the one that answered last, and on to the next
    when it cannot be reached or says its store is away
    (:data:`STORE_UNAVAILABLE`); any other answer is the mesh's answer.
    """

    def __init__(self, http: httpx.AsyncClient, trackers: str | Sequence[str] | None, credential: str,
                 node_id: str) -> None:
        self._http = http
        self._trackers = (trackers,) if isinstance(trackers, str) else tuple(trackers or ())
        self._current = 0
        self._credential = credential
        self._node_id = node_id
        self.trust = RouteTrust(KeySet(), self.fetch_keys if self._trackers else None)
        """The route keys routes from the tracker are verified with (the node's runtime gives its own)."""

    @property
    def available(self) -> bool:
        return bool(self._trackers)

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """``method path`` on the first tracker that answers for the mesh; :class:`NoRoute` when none does."""
        if not self._trackers:
            raise NoRoute("this node does not hold every layer and has no tracker to ask for a route")
        failures: list[str] = []
        for attempt in range(len(self._trackers)):
            index = (self._current + attempt) % len(self._trackers)
            tracker = self._trackers[index]
            try:
                response = await self._http.request(method, f"{tracker}{path}", headers=bearer_headers(self._credential),
                                                    timeout=TRACKER_TIMEOUT_S, **kwargs)
            except httpx.HTTPError as exc:
                failures.append(f"tracker {tracker} unreachable: {exc}")
                continue
            if response.status_code == 503 and _error_code(response) == STORE_UNAVAILABLE:
                failures.append(f"tracker {tracker}: its store is away")
                continue
            if index != self._current:
                logger.info("trackers: %s answers now", tracker)
                self._current = index
            return response
        raise NoRoute("; ".join(failures))

    async def fetch(self, model: str, exclude: Iterable[str] = ()) -> SignedRoute:
        """``GET /v1/route?model=M&exclude=a,b``: a fresh signed route, or :class:`NoRoute`."""
        params = {"model": model}
        excluded = ",".join(sorted(set(exclude)))
        if excluded:
            params["exclude"] = excluded
        response = await self._call("GET", ROUTE_PATH, params=params)
        if response.status_code != 200:
            raise NoRoute(f"tracker has no route for {model}: {_error_message(response)}",
                          status=response.status_code if response.status_code in (404, 503) else 503,
                          healing=response.status_code == 503 and _error_field(response, "healing") is True)
        if len(response.content) > MAX_ROUTE_ANSWER_BYTES:
            raise NoRoute("tracker's route answer is too large")
        try:
            return SignedRoute.model_validate_json(response.content)
        except ValidationError as exc:
            raise NoRoute(f"tracker's route answer is invalid: {exc.errors()[0]['msg']}") from None

    async def fetch_keys(self) -> KeySet:
        """``GET /v1/keys``: the trackers' route-signing public keys (:class:`KeyFetchFailed` when none answers)."""
        try:
            response = await self._call("GET", KEYS_PATH)
        except NoRoute as exc:
            raise KeyFetchFailed(str(exc)) from None
        if response.status_code != 200:
            raise KeyFetchFailed(f"tracker answered {response.status_code} for its keys: {_error_message(response)}")
        if len(response.content) > MAX_JWKS_BYTES:
            raise KeyFetchFailed("tracker's key set is too large")
        try:
            return KeySet.parse(response.content)
        except KeyProblem as exc:
            raise KeyFetchFailed(f"tracker's key set: {exc}") from None

    async def route_from_here(self, model: str, shard: Shard, exclude: Collection[str] = ()) -> RoutedHop:
        """A verified route that this node heads and that avoids ``exclude`` (failover).

        The tracker plans the cheapest route, which may start at another node
        holding layer 0; that head is then left out too and the tracker asked
        again, at most :data:`MAX_OTHER_HEADS` times. Raises :class:`NoRoute`
        when no such route exists (or the tracker answers one this node cannot run).
        """
        avoid = set(exclude)
        for _ in range(MAX_OTHER_HEADS + 1):
            signed = await self.fetch(model, avoid)
            head = signed.nodes[0].node_id
            if head != self._node_id:
                logger.info("the tracker's route starts at %s, not here; asking again without it", head)
                avoid.add(head)
                continue
            await self.trust.ensure(signed.token)
            try:
                return verify_hop(signed.token, 0, keys=self.trust.keys, node_id=self._node_id, model_id=model,
                                  shard=shard, revoked=self.trust.revoked)
            except RouteRefused as exc:
                raise NoRoute(f"the tracker's route cannot be run from here: {exc}") from None
        raise NoRoute(f"every route the tracker offers starts at another head (tried {MAX_OTHER_HEADS + 1})")

    async def report_failure(self, node_id: str, reason: str, route: str | None = None) -> None:
        """``POST /v1/nodes/{id}/failures``, best effort: the tracker backs the node off.

        ``route`` is the token of the signed route (this node its head) the failure happened on: the
        tracker takes a report only from a route's head about a hop of that route."""
        if not self._trackers:
            return
        try:
            report = {"reason": reason[:MAX_REASON_CHARS] or "failed", "reporter": self._node_id,
                      **({"route": route} if route else {})}
            await self._call("POST", f"/v1/nodes/{node_id}/failures", json=report)
        except NoRoute as exc:
            logger.warning("could not report failed node %s to a tracker: %s", node_id, exc)


    async def report_receipts(self, route: str, receipts: Sequence[str]) -> None:
        """``POST /v1/receipts``: the receipts of steps along ``route`` (this node its head), for the tracker to keep
        and compare (issue 37); :class:`NoRoute` when no tracker takes them."""
        response = await self._call("POST", RECEIPTS_PATH, json={"route": route, "receipts": list(receipts)})
        if response.status_code != 200:
            raise NoRoute(f"the tracker refused {len(receipts)} receipts: {_error_message(response)}")


def _error_field(response: httpx.Response, key: str) -> Any:
    """``error.<key>`` of an OpenAI-shaped error answer, or ``None``."""
    try:
        return response.json()["error"][key]
    except (ValueError, KeyError, TypeError):
        return None


def _error_code(response: httpx.Response) -> str | None:
    code = _error_field(response, "code")
    return code if isinstance(code, str) else None


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}"
