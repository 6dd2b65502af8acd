"""The route a head's request runs along: the tracker's (verified), none (a head alone), or one asked for;
and, for a long prompt on a mesh with prefill nodes, the prefill route to run it along first."""

from __future__ import annotations

from starlette.requests import Request

from meshwire import headers as h
from services.node.api.api_error import ApiError
from services.node.api.head_node import HeadNode
from services.node.hop.routing import NoRoute, RoutedHop, RouteRefused, verify_hop, verify_prefill_route
from services.node.pd.pd_head import PrefillPlan


async def route_of(request: Request, node: HeadNode) -> RoutedHop | None:
    """The route to run along: the tracker's (verified), none (alone), or one asked of the tracker."""
    assert node.shard is not None
    token = request.headers.get(h.ROUTE)
    if token is None:
        if node.shard.is_tail:
            return None
        try:
            signed = await node.tracker_routes.fetch(node.model_id)
        except NoRoute as exc:
            raise ApiError(exc.status, str(exc), "no_route") from None
        token = signed.token
    try:
        await node.trust.ensure(token)
        return verify_hop(token, 0, keys=node.trust.keys, node_id=node.node_id, model_id=node.model_id,
                          shard=node.shard, revoked=node.trust.revoked)
    except RouteRefused as exc:
        raise ApiError(403, str(exc), "bad_route") from None


def prefill_plan_of(request: Request, node: HeadNode, prompt_tokens: int) -> PrefillPlan | None:
    """The tracker's prefill route for this request, when its prompt is long enough to use it."""
    token = request.headers.get(h.PREFILL_ROUTE)
    if token is None or node.generator is None or node.puller is None or node.shard is None:
        return None
    try:
        least = int(request.headers.get(h.PD_MIN_PROMPT_TOKENS) or "0")
    except ValueError:
        raise ApiError(400, f"{h.PD_MIN_PROMPT_TOKENS} is not an integer", "bad_header") from None
    if prompt_tokens < max(least, 1):
        return None
    try:
        hop = verify_prefill_route(token, keys=node.trust.keys, model_id=node.model_id,
                                   num_layers=node.shard.num_layers)
    except RouteRefused as exc:
        raise ApiError(403, f"prefill route: {exc}", "bad_route") from None
    return PrefillPlan(hop)
