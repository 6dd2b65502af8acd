"""Routes: layer planning, validation, and signed tokens that refuse every kind of forgery."""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from meshwire import limits
from meshwire.route_keys import KeySet, SigningKey
from meshwire.routes import (
    Route,
    RouteError,
    RouteNode,
    SignedRoute,
    issue_signed_route,
    plan_start_layers,
    route_key_id,
    sign_route,
    verify_route,
)

KEY = SigningKey.from_seed("A" * 43)
"""The tracker's route key in these tests."""
KEYS = KeySet.of([KEY])
"""What a node holds: the public half only."""
OLD_SECRET = "test-secret"
NOW = 1_700_000_000.0


def node(node_id: str, start: int, end: int, **extra: object) -> RouteNode:
    return RouteNode(node_id=node_id, endpoint=f"http://127.0.0.1:{9000 + start}",
                     shard_start=start, shard_end=end, **extra)


def three_hop_route() -> Route:
    return Route(model="tiny", num_layers=6,
                 nodes=plan_start_layers([node("a", 0, 2), node("b", 1, 4), node("c", 3, 5)]))


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forge(payload: object, key: SigningKey = KEY, header: object = None) -> str:
    """A token for an arbitrary payload (and header), correctly signed with ``key``."""
    signed = b64(orjson.dumps(header or {"alg": "EdDSA", "kid": key.kid})) + "." + b64(orjson.dumps(payload))
    return signed + "." + b64(key.sign(signed.encode()))


def refusal(token: str, keys: KeySet = KEYS, now: float = NOW) -> str:
    with pytest.raises(RouteError) as caught:
        verify_route(token, keys, now=now)
    assert str(caught.value)
    return caught.value.code


# --- planning and validation ----------------------------------------------------------------


def test_overlapping_hops_start_right_after_the_previous_hop():
    assert [n.start_layer for n in three_hop_route().nodes] == [0, 3, 5]


def test_a_hop_without_start_layer_starts_at_its_shard_start():
    assert node("a", 2, 3).start_layer == 2


def test_planning_refuses_a_gap_between_hops():
    with pytest.raises(RouteError) as caught:
        plan_start_layers([node("a", 0, 1), node("b", 3, 5)])
    assert caught.value.code == "malformed"


def test_planning_refuses_a_hop_that_adds_no_layer():
    with pytest.raises(RouteError):
        plan_start_layers([node("a", 0, 4), node("b", 1, 3), node("c", 5, 5)])


@pytest.mark.parametrize("nodes", [
    [node("a", 1, 5)],                                     # does not start at layer 0
    [node("a", 0, 4)],                                     # does not reach the last layer
    [node("a", 0, 2), node("b", 4, 5, start_layer=4)],     # gap
    [node("a", 0, 3), node("b", 2, 5)],                    # overlap not planned
])
def test_a_route_must_cover_every_layer_exactly_once(nodes):
    with pytest.raises(ValidationError):
        Route(model="tiny", num_layers=6, nodes=nodes)


def test_a_start_layer_outside_its_shard_is_refused():
    with pytest.raises(ValidationError):
        node("a", 2, 3, start_layer=5)


def test_a_route_may_not_name_more_than_the_hop_limit():
    hops = [node(f"n{i}", i, i) for i in range(limits.MAX_ROUTE_HOPS + 1)]
    with pytest.raises(ValidationError):
        Route(model="tiny", num_layers=len(hops), nodes=hops)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:9000", "file:///etc/passwd", "http://a b", ""])
def test_an_endpoint_must_be_an_http_url(endpoint):
    with pytest.raises(ValidationError):
        RouteNode(node_id="a", endpoint=endpoint, shard_start=0, shard_end=0)


def test_the_design_cards_route_json_parses():
    route = Route.model_validate_json(orjson.dumps({
        "model": "tiny", "num_layers": 4,
        "nodes": [{"node_id": "a", "endpoint": "http://h:1", "shard_start": 0, "shard_end": 1},
                  {"node_id": "b", "endpoint": "http://h:2", "shard_start": 2, "shard_end": 3,
                   "relay_addr": "ws://relay:8003/rpc/b"}],
    }))
    assert route.tail.relay_addr == "ws://relay:8003/rpc/b"
    assert route.hop_of("b") == 1


# --- signing ------------------------------------------------------------------------------


def test_a_signed_route_verifies_to_the_same_route():
    route = three_hop_route()
    assert verify_route(sign_route(route, KEY, now=NOW), KEYS, now=NOW + 1) == route


@settings(max_examples=40, deadline=None)
@given(cuts=st.sets(st.integers(min_value=1, max_value=31), max_size=8), relay=st.booleans())
def test_any_partition_of_the_layers_round_trips(cuts, relay):
    bounds = [0, *sorted(cuts), 32]
    nodes = [node(f"n{i}", lo, hi - 1, relay_addr=f"wss://relay/rpc/n{i}" if relay else None)
             for i, (lo, hi) in enumerate(itertools.pairwise(bounds))]
    route = Route(model="m", num_layers=32, nodes=nodes)
    assert verify_route(sign_route(route, KEY, now=NOW), KEYS, now=NOW) == route


def test_the_get_route_answer_carries_a_token_for_its_own_route():
    signed = issue_signed_route(three_hop_route(), KEY, ttl_s=30, now=NOW)
    again = SignedRoute.model_validate_json(signed.model_dump_json())
    assert again.expires_at == NOW + 30
    assert verify_route(again.token, KEYS, now=NOW) == again.route == three_hop_route()


def test_a_tampered_payload_is_refused():
    token = sign_route(three_hop_route(), KEY, now=NOW)
    header, first, signature = token.split(".")
    payload = orjson.loads(base64.urlsafe_b64decode(first + "=="))
    payload["route"]["nodes"][1]["endpoint"] = "http://attacker.example:80"
    assert refusal(header + "." + b64(orjson.dumps(payload)) + "." + signature) == "bad_signature"


def test_a_tampered_signature_is_refused():
    token = sign_route(three_hop_route(), KEY, now=NOW)
    header, first, signature = token.split(".")
    flipped = bytearray(base64.urlsafe_b64decode(signature + "=="))
    flipped[0] ^= 1
    assert refusal(header + "." + first + "." + b64(bytes(flipped))) == "bad_signature"


def test_a_route_signed_with_another_key_under_the_trackers_key_id_is_refused():
    other = SigningKey.generate()
    header = {"alg": "EdDSA", "kid": KEY.kid}
    assert refusal(forge({"route": three_hop_route().model_dump(mode="json"), "exp": NOW + 60, "iat": NOW, "v": 2},
                         other, header)) == "bad_signature"


def test_a_route_signed_with_a_key_the_node_does_not_hold_is_refused():
    other = SigningKey.generate()
    token = sign_route(three_hop_route(), other, now=NOW)
    assert route_key_id(token) == other.kid
    assert refusal(token) == "unknown_key"


def test_an_hmac_route_signed_with_the_old_shared_secret_is_refused():
    """The format routes had before Ed25519: whoever holds the shared secret could sign one."""
    payload = {"route": three_hop_route().model_dump(mode="json"), "exp": NOW + 60, "iat": NOW, "v": 1}
    first = b64(orjson.dumps(payload))
    token = first + "." + b64(hmac.new(OLD_SECRET.encode(), first.encode(), hashlib.sha256).digest())
    assert refusal(token) == "malformed"
    hs256 = b64(orjson.dumps({"alg": "HS256", "kid": KEY.kid})) + "." + first
    token = hs256 + "." + b64(hmac.new(OLD_SECRET.encode(), hs256.encode(), hashlib.sha256).digest())
    assert refusal(token) == "malformed"


def test_a_route_verifies_with_any_key_of_the_set_during_a_rotation():
    new = SigningKey.generate()
    both = KeySet.of([KEY, new])
    assert verify_route(sign_route(three_hop_route(), KEY, now=NOW), both, now=NOW) == three_hop_route()
    assert verify_route(sign_route(three_hop_route(), new, now=NOW), both, now=NOW) == three_hop_route()


def test_an_expired_route_is_refused_unless_expiry_is_not_checked():
    token = sign_route(three_hop_route(), KEY, ttl_s=10, now=NOW)
    assert refusal(token, now=NOW + 10) == "expired"
    assert verify_route(token, KEYS, now=NOW + 10, check_expiry=False) == three_hop_route()


@pytest.mark.parametrize("token", ["", "no-dot", ".", "abc.", ".abc", "a.b.c", "a.b", "!!!.???.!!!", "été.été.été",
                                   " . . "])
def test_garbage_is_malformed_or_unsigned(token):
    assert refusal(token) in {"malformed", "bad_signature"}


@settings(max_examples=200, deadline=None)
@given(token=st.text(max_size=300))
def test_no_string_makes_verification_raise_anything_but_a_route_error(token):
    with pytest.raises(RouteError):
        verify_route(token, KEYS, now=NOW)


def test_an_oversize_token_is_malformed_before_any_work():
    assert refusal("a" * (limits.MAX_ROUTE_TOKEN_BYTES + 1) + ".b.c") == "malformed"


@pytest.mark.parametrize("payload", [
    {"route": {"model": "m"}, "exp": NOW + 60, "iat": NOW, "v": 2},      # not a route
    {"route": None, "exp": NOW + 60, "iat": NOW, "v": 2},
    {"exp": NOW + 60, "iat": NOW, "v": 2},                                # no route
    [1, 2, 3],                                                            # not an object
])
def test_a_correctly_signed_but_malformed_payload_is_malformed(payload):
    assert refusal(forge(payload)) == "malformed"


def test_a_token_of_another_version_is_malformed():
    route = three_hop_route().model_dump(mode="json")
    assert refusal(forge({"route": route, "exp": NOW + 60, "iat": NOW, "v": 1})) == "malformed"


@pytest.mark.parametrize("header", [{"alg": "none", "kid": KEY.kid}, {"alg": "EdDSA"}, {"kid": KEY.kid}, [1],
                                    {"alg": "EdDSA", "kid": KEY.kid, "jku": "http://attacker.example/keys"}])
def test_a_header_other_than_eddsa_with_a_key_id_is_malformed(header):
    route = three_hop_route().model_dump(mode="json")
    assert refusal(forge({"route": route, "exp": NOW + 60, "iat": NOW, "v": 2}, header=header)) == "malformed"


def test_a_route_cannot_be_signed_with_a_shared_secret():
    with pytest.raises(TypeError):
        sign_route(three_hop_route(), "a-shared-secret", now=NOW)  # type: ignore[arg-type]


def test_a_token_verified_once_is_remembered_but_its_expiry_is_checked_every_time():
    keys = KeySet.of([KEY])
    token = sign_route(three_hop_route(), KEY, ttl_s=10, now=NOW)
    assert verify_route(token, keys, now=NOW) == three_hop_route()
    assert keys.remembered(token) is not None
    assert refusal(token, keys, now=NOW + 10) == "expired"
    assert refusal(token, KeySet.of([SigningKey.generate()])) == "unknown_key", "another set remembers nothing"
