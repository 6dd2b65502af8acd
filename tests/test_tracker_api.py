"""The tracker as a running process: registration, routes, failures and errors, without any model.

Nodes here are plain authenticated registrations (what a node sends); the
tracker never needs to reach them except where a test says so. Each test uses
its own model name, so the tests share one tracker without seeing each other.
Every test runs twice: on the memory store and on a real Redis (``MESHNET_STORE``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from meshwire.route_keys import KeySet
from meshwire.routes import verify_route
from tests.procs import TEST_SECRET, Service, free_port, start_service

AUTH = {"Authorization": f"Bearer {TEST_SECRET}"}
NUM_LAYERS = 4


@pytest.fixture(scope="module", params=["memory", "redis"])
def tracker(request: pytest.FixtureRequest) -> Iterator[Service]:
    """One tracker per store: every test here runs on the memory store and on a real Redis."""
    store = "memory" if request.param == "memory" else request.getfixturevalue("redis_url")
    with start_service("tracker", {"MESHNET_NODE_TTL_S": "30", "MESHNET_HEARTBEAT_S": "1",
                                   "MESHNET_STORE": store}) as service:
        yield service


@pytest.fixture
def model() -> str:
    return f"/models/test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def client(tracker: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tracker.url}/v1", api_key="unused", max_retries=0, timeout=30)


def registration(node_id: str, model: str, start: int = 0, end: int = NUM_LAYERS - 1, *,
                 port: int | None = None, **load: Any) -> dict[str, Any]:
    return {"node_id": node_id, "model": model, "endpoint": f"http://127.0.0.1:{port or free_port()}",
            "shard_start": start, "shard_end": end, "num_layers": NUM_LAYERS, **load}


def register(tracker: Service, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{tracker.url}/v1/nodes", json=body, headers=AUTH if headers is None else headers)


def nodes_of(tracker: Service, model: str) -> list[dict[str, Any]]:
    listed = httpx.get(f"{tracker.url}/v1/nodes").json()["nodes"]
    return [node for node in listed if node["model"] == model]


def route(tracker: Service, model: str, exclude: str | None = None) -> httpx.Response:
    params = {"model": model} | ({"exclude": exclude} if exclude else {})
    return httpx.get(f"{tracker.url}/v1/route", params=params)


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# --- service basics --------------------------------------------------------------------------------


def test_health_answers_200(tracker: Service) -> None:
    answer = httpx.get(f"{tracker.url}/health")
    assert answer.status_code == 200 and answer.json()["status"] == "ok"


def test_metrics_are_prometheus_text(tracker: Service) -> None:
    answer = httpx.get(f"{tracker.url}/metrics")
    assert answer.status_code == 200
    assert "meshnet_tracker_nodes" in answer.text and "meshnet_tracker_registrations" in answer.text


def test_the_root_page_points_at_the_api(tracker: Service) -> None:
    answer = httpx.get(f"{tracker.url}/")
    assert answer.status_code == 200 and "/v1" in answer.text


def test_an_unknown_path_answers_in_the_openai_error_shape(tracker: Service) -> None:
    answer = httpx.get(f"{tracker.url}/v1/nothing-here")
    assert answer.status_code == 404
    assert set(answer.json()["error"]) >= {"message", "type", "code"}


def test_a_wrong_method_answers_405_in_the_openai_error_shape(tracker: Service) -> None:
    answer = httpx.get(f"{tracker.url}/v1/chat/completions")
    assert answer.status_code == 405 and "error" in answer.json()


# --- registration -------------------------------------------------------------------------------------


def test_a_registration_without_the_secret_is_401_and_changes_nothing(tracker: Service, model: str) -> None:
    answer = register(tracker, registration(uid("n"), model), headers={})
    assert answer.status_code == 401 and "error" in answer.json()
    assert nodes_of(tracker, model) == []


def test_a_registration_with_a_wrong_secret_is_403_and_changes_nothing(tracker: Service, model: str) -> None:
    answer = register(tracker, registration(uid("n"), model), headers={"Authorization": "Bearer wrong"})
    assert answer.status_code == 403
    assert nodes_of(tracker, model) == []


def test_a_registered_node_gets_a_lease_and_is_listed_with_its_load(tracker: Service, model: str) -> None:
    node_id = uid("n")
    answer = register(tracker, registration(node_id, model, kv_capacity_tokens=1000, kv_free_tokens=600,
                                            active_sessions=2, decode_tokens_per_s=30.0))
    assert answer.status_code == 200
    body = answer.json()
    assert body["lease"] and body["heartbeat_s"] == 1.0 and body["ttl_s"] == 30.0
    (node,) = nodes_of(tracker, model)
    assert node["node_id"] == node_id and node["state"] in ("joining", "online")
    assert (node["kv_free_tokens"], node["kv_capacity_tokens"], node["active_sessions"]) == (600, 1000, 2)
    assert node["decode_tokens_per_s"] == 30.0 and node["last_heartbeat_age_s"] >= 0


def test_a_heartbeat_with_the_lease_keeps_the_node_and_updates_its_load(tracker: Service, model: str) -> None:
    node_id = uid("n")
    body = registration(node_id, model)
    lease = register(tracker, body).json()["lease"]
    again = register(tracker, {**body, "active_sessions": 3}, headers={**AUTH, "X-Meshnet-Lease": lease})
    assert again.status_code == 200 and again.json()["lease"] == lease
    (node,) = nodes_of(tracker, model)
    assert node["state"] == "online" and node["active_sessions"] == 3


def test_a_node_cannot_register_under_another_nodes_id(tracker: Service, model: str) -> None:
    node_id = uid("n")
    original = registration(node_id, model)
    register(tracker, original)
    impostor = register(tracker, registration(node_id, model))
    assert impostor.status_code == 409 and impostor.json()["error"]["code"] == "lease_conflict"
    (node,) = nodes_of(tracker, model)
    assert node["endpoint"] == original["endpoint"]


def test_an_invalid_registration_is_400_naming_the_field(tracker: Service, model: str) -> None:
    answer = register(tracker, registration(uid("n"), model, start=3, end=1))
    assert answer.status_code == 400 and "shard" in answer.json()["error"]["message"]
    missing = register(tracker, {"node_id": uid("n"), "model": model})
    assert missing.status_code == 400 and "endpoint" in missing.json()["error"]["message"]


def test_a_node_that_leaves_is_listed_offline_and_leaves_the_routes(tracker: Service, model: str) -> None:
    node_id = uid("n")
    lease = register(tracker, registration(node_id, model)).json()["lease"]
    assert route(tracker, model).status_code == 200
    gone = httpx.delete(f"{tracker.url}/v1/nodes/{node_id}", headers={**AUTH, "X-Meshnet-Lease": lease})
    assert gone.status_code == 200
    assert [n["state"] for n in nodes_of(tracker, model)] == ["offline"]
    assert route(tracker, model).status_code == 503


def test_leaving_needs_the_secret(tracker: Service, model: str) -> None:
    node_id = uid("n")
    register(tracker, registration(node_id, model))
    assert httpx.delete(f"{tracker.url}/v1/nodes/{node_id}").status_code == 401
    assert nodes_of(tracker, model)[0]["state"] != "offline"


# --- routes -------------------------------------------------------------------------------------------------


def test_a_route_covers_every_layer_in_order_and_is_signed_by_the_tracker(tracker: Service, model: str) -> None:
    register(tracker, registration("tail-" + uid("n"), model, 2, 3))
    register(tracker, registration("head-" + uid("n"), model, 0, 2))
    answer = route(tracker, model)
    assert answer.status_code == 200
    signed = answer.json()
    assert [(n["shard_start"], n["start_layer"], n["shard_end"]) for n in signed["nodes"]] == [(0, 0, 2), (2, 3, 3)]
    keys = httpx.get(f"{tracker.url}/v1/keys")  # public: anyone may verify, no credential
    assert keys.status_code == 200
    verified = verify_route(signed["token"], KeySet.parse(keys.content))
    assert [n.node_id for n in verified.nodes] == [n["node_id"] for n in signed["nodes"]]
    assert verified.num_layers == NUM_LAYERS and verified.model == model


def test_a_route_is_found_by_the_models_basename(tracker: Service, model: str) -> None:
    register(tracker, registration(uid("n"), model))
    answer = route(tracker, model.rsplit("/", 1)[-1])
    assert answer.status_code == 200 and answer.json()["model"] == model


def test_a_route_avoids_excluded_nodes(tracker: Service, model: str) -> None:
    first, second = uid("a"), uid("b")
    register(tracker, registration(first, model))
    register(tracker, registration(second, model))
    assert [n["node_id"] for n in route(tracker, model, exclude=first).json()["nodes"]] == [second]
    assert [n["node_id"] for n in route(tracker, model, exclude=second).json()["nodes"]] == [first]
    both = route(tracker, model, exclude=f"{first},{second}")
    assert both.status_code == 503 and both.json()["error"]["missing_layers"] == [[0, 3]]


def test_the_least_loaded_replica_gets_the_route(tracker: Service, model: str) -> None:
    busy, idle = uid("busy"), uid("idle")
    register(tracker, registration(busy, model, active_sessions=5, decode_tokens_per_s=20.0))
    register(tracker, registration(idle, model, active_sessions=0, decode_tokens_per_s=20.0))
    assert [n["node_id"] for n in route(tracker, model).json()["nodes"]] == [idle]


def test_a_route_for_an_unknown_model_is_404(tracker: Service) -> None:
    answer = route(tracker, "no-such-model")
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"


def test_a_model_without_a_complete_route_is_503_naming_the_missing_layers(tracker: Service, model: str) -> None:
    register(tracker, registration(uid("n"), model, 0, 1))
    answer = route(tracker, model)
    assert answer.status_code == 503
    error = answer.json()["error"]
    assert error["missing_layers"] == [[2, 3]] and "2-3" in error["message"]


def test_the_coverage_summary_names_missing_layers_per_model(tracker: Service, model: str) -> None:
    register(tracker, registration(uid("n"), model, 1, 2))
    models = {m["model"]: m for m in httpx.get(f"{tracker.url}/v1/mesh").json()["models"]}
    assert models[model]["complete"] is False
    assert models[model]["missing"] == [[0, 0], [3, 3]]
    assert models[model]["layer_holders"] == [0, 1, 1, 0]


# --- failure reports --------------------------------------------------------------------------------------


def report(tracker: Service, node_id: str, route_token: str | None,
           headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"reason": "connection refused"} | ({"route": route_token} if route_token else {})
    return httpx.post(f"{tracker.url}/v1/nodes/{node_id}/failures", json=body,
                      headers=AUTH if headers is None else headers)


def two_hops(tracker: Service, model: str, *tails: str, head: str | None = None) -> str:
    """Register a head of layers 0-1 and ``tails`` holding 2-3; the head's id."""
    head = head or uid("head")
    register(tracker, registration(head, model, 0, 1))
    for tail in tails:
        register(tracker, registration(tail, model, 2, 3))
    return head


def test_a_reported_node_backs_off_and_routes_avoid_it(tracker: Service, model: str) -> None:
    first, second = uid("a"), uid("b")
    two_hops(tracker, model, first, second)
    signed = route(tracker, model).json()
    failing = signed["nodes"][1]["node_id"]
    healthy = second if failing == first else first
    answer = report(tracker, failing, signed["token"])
    assert answer.status_code == 200 and answer.json()["backoff_s"] > 0 and answer.json()["applied"]
    states = {n["node_id"]: n["state"] for n in nodes_of(tracker, model)}
    assert states[failing] == "suspect"
    for _ in range(3):
        assert [n["node_id"] for n in route(tracker, model).json()["nodes"]][1] == healthy


def test_the_only_holder_of_a_range_stays_in_routes_while_backing_off(tracker: Service, model: str) -> None:
    only = uid("only")
    two_hops(tracker, model, only)
    signed = route(tracker, model).json()
    report(tracker, only, signed["token"])
    assert [n["node_id"] for n in route(tracker, model).json()["nodes"]][1] == only


def test_failure_reports_need_a_credential_the_route_and_a_node_on_it(tracker: Service, model: str) -> None:
    node_id = uid("n")
    head = two_hops(tracker, model, node_id)
    token = route(tracker, model).json()["token"]
    assert report(tracker, node_id, token, headers={}).status_code == 401
    missing = report(tracker, node_id, None)
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "route_required"
    for stranger in (head, "nobody-" + uid("n")):  # the head itself, a node the route does not name
        refused = report(tracker, stranger, token)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "not_on_route"
    header, payload, signature = token.split(".")
    forged = report(tracker, node_id, f"{header}.{payload}.{signature[::-1]}")
    assert forged.status_code == 403 and forged.json()["error"]["code"] == "bad_route"
    assert nodes_of(tracker, model)[0]["failures"] == 0 == nodes_of(tracker, model)[1]["failures"]


def test_one_reporter_alone_earns_a_node_one_short_backoff_and_a_second_corroborates(
        tracker: Service, model: str) -> None:
    victim = uid("victim")
    head = two_hops(tracker, model, victim)
    other_head = two_hops(tracker, model)
    mine = route(tracker, model, exclude=other_head).json()
    assert [n["node_id"] for n in mine["nodes"]] == [head, victim]
    first = report(tracker, victim, mine["token"]).json()
    assert first["applied"] and first["backoff_s"] == 5.0
    again = report(tracker, victim, mine["token"]).json()
    assert not again["applied"]  # the same reporter's word again is noted, not applied
    theirs = route(tracker, model, exclude=head).json()
    assert [n["node_id"] for n in theirs["nodes"]] == [other_head, victim]
    assert report(tracker, victim, theirs["token"]).json()["applied"]  # a second head corroborates


# --- the OpenAI front door without a working node ------------------------------------------------------------


def test_an_unknown_model_is_404_for_the_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert "no-such-model" in str(error.value)


@pytest.mark.parametrize(("fields", "named"), [
    ({"temperature": 5}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 17}, "n"),  # more choices than MAX_CHOICES
    ({"top_p": 0}, "top_p"),
])
def test_invalid_parameters_are_400_naming_the_field(client: openai.OpenAI, fields: dict[str, Any],
                                                     named: str) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], **fields)
    assert error.value.body["param"] == named  # type: ignore[index]
    assert named in str(error.value)


def test_a_chat_without_messages_is_400(tracker: Service) -> None:
    answer = httpx.post(f"{tracker.url}/v1/chat/completions", json={"model": "any"})
    assert answer.status_code == 400 and "messages" in answer.json()["error"]["message"]


def test_a_body_that_is_not_json_is_400(tracker: Service) -> None:
    answer = httpx.post(f"{tracker.url}/v1/completions", content=b"{not json",
                        headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"


def test_a_body_over_the_limit_is_413(tracker: Service) -> None:
    answer = httpx.post(f"{tracker.url}/v1/completions", content=b"x" * (9 << 20),
                        headers={"Content-Type": "application/json"})
    assert answer.status_code == 413


def test_a_model_without_a_complete_route_is_503_for_the_openai_client(client: openai.OpenAI,
                                                                       tracker: Service, model: str) -> None:
    register(tracker, registration(uid("n"), model, 0, 2))
    with pytest.raises(openai.InternalServerError) as error:
        client.completions.create(model=model, prompt="hello")
    assert error.value.status_code == 503 and "3" in str(error.value)


def test_models_lists_only_models_with_a_complete_route(client: openai.OpenAI, tracker: Service) -> None:
    whole, partial = f"/models/{uid('whole')}", f"/models/{uid('partial')}"
    register(tracker, registration(uid("n"), whole))
    register(tracker, registration(uid("n"), partial, 0, 0))
    listed = {m.id for m in client.models.list()}
    assert whole in listed and partial not in listed


def test_a_head_that_cannot_be_reached_is_reported_and_the_client_gets_502(
        client: openai.OpenAI, tracker: Service, model: str) -> None:
    dead = uid("dead")
    register(tracker, registration(dead, model, port=free_port()))  # nothing listens there
    with pytest.raises(openai.APIStatusError) as error:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert error.value.status_code == 502
    (node,) = nodes_of(tracker, model)
    assert node["state"] == "suspect" and node["failures"] == 1


# --- API keys --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_tracker() -> Iterator[Service]:
    with start_service("tracker", {"MESHNET_API_KEYS": "key-one, key-two"}) as service:
        yield service


def test_with_api_keys_a_request_without_a_key_is_401(keyed_tracker: Service) -> None:
    answer = httpx.get(f"{keyed_tracker.url}/v1/models")
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "missing_api_key"


def test_with_api_keys_a_wrong_key_is_401_for_the_openai_client(keyed_tracker: Service) -> None:
    client = openai.OpenAI(base_url=f"{keyed_tracker.url}/v1", api_key="key-three", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}])


def test_with_api_keys_each_configured_key_is_accepted(keyed_tracker: Service) -> None:
    for key in ("key-one", "key-two"):
        client = openai.OpenAI(base_url=f"{keyed_tracker.url}/v1", api_key=key, max_retries=0)
        assert list(client.models.list()) == []


def test_with_api_keys_nodes_still_register_with_the_mesh_secret(keyed_tracker: Service, model: str) -> None:
    assert register(keyed_tracker, registration(uid("n"), model)).status_code == 200


def test_without_api_keys_the_mesh_layout_is_public(tracker: Service, model: str) -> None:
    node_id = uid("n")
    register(tracker, registration(node_id, model))
    assert node_id in {n["node_id"] for n in httpx.get(f"{tracker.url}/v1/nodes").json()["nodes"]}
    assert httpx.get(f"{tracker.url}/v1/mesh").status_code == 200
    assert route(tracker, model).status_code == 200
