"""Closing the tracker's open doors, against a real tracker process with client API keys set.

- the mesh's layout (``/v1/nodes``, ``/v1/mesh``, ``/v1/route``) needs a client
  API key or the mesh secret;
- a node registers only plain ``scheme://host:port[/prefix]`` addresses;
- a head's answer reaches the client only as an OpenAI answer: anything else is a 502;
- a live id, and its departure, belong to whoever holds its lease;
- a model's layer count is what its nodes agree on, not what the first one said.

The heads here are one small HTTP server in this process that answers each
prefix its own way (``/html`` an HTML error page, ``/openai`` an OpenAI error...),
registered as nodes at ``http://127.0.0.1:PORT/<prefix>``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Final

import httpx
import openai
import orjson
import pytest

from services.tracker.head_answers import MAX_MESSAGE_CHARS, parse_openai_error, relayed_error
from tests.procs import TEST_SECRET, Service, free_port, start_service

API_KEY: Final = "door-key"
MESH: Final = {"Authorization": f"Bearer {TEST_SECRET}"}
CLIENT: Final = {"Authorization": f"Bearer {API_KEY}"}
NUM_LAYERS: Final = 4
LEAKED: Final = "internal-only-text"
"""What the fake heads put in their bad answers; it must never reach a client."""


@pytest.fixture(scope="module", params=["memory", "redis"])
def tracker(request: pytest.FixtureRequest) -> Iterator[Service]:
    """One tracker per store: the doors are the same on the memory store and on a real Redis."""
    store = "memory" if request.param == "memory" else request.getfixturevalue("redis_url")
    with start_service("tracker", {"MESHNET_API_KEYS": API_KEY, "MESHNET_NODE_TTL_S": "60",
                                   "MESHNET_HEARTBEAT_S": "1", "MESHNET_STORE": store}) as service:
        yield service


@pytest.fixture
def model() -> str:
    return f"/models/doors-{uuid.uuid4().hex[:10]}"


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def registration(node_id: str, model: str, start: int = 0, end: int = NUM_LAYERS - 1, *,
                 endpoint: str | None = None, num_layers: int = NUM_LAYERS, **extra: Any) -> dict[str, Any]:
    return {"node_id": node_id, "model": model, "endpoint": endpoint or f"http://127.0.0.1:{free_port()}",
            "shard_start": start, "shard_end": end, "num_layers": num_layers, **extra}


def register(tracker: Service, body: dict[str, Any], lease: str | None = None) -> httpx.Response:
    headers = MESH | ({"X-Meshnet-Lease": lease} if lease else {})
    return httpx.post(f"{tracker.url}/v1/nodes", json=body, headers=headers)


def nodes_of(tracker: Service, model: str) -> dict[str, dict[str, Any]]:
    listed = httpx.get(f"{tracker.url}/v1/nodes", headers=MESH).json()["nodes"]
    return {node["node_id"]: node for node in listed if node["model"] == model}


# --- the mesh's layout needs a key ------------------------------------------------------------------------

VIEWS: Final = ("/v1/nodes", "/v1/mesh", "/v1/route?model=any")


@pytest.mark.parametrize("path", VIEWS)
def test_with_api_keys_a_mesh_view_without_a_key_is_401(tracker: Service, path: str) -> None:
    answer = httpx.get(f"{tracker.url}{path}")
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "missing_api_key"
    assert answer.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("path", VIEWS)
def test_with_api_keys_a_mesh_view_with_a_wrong_key_is_401(tracker: Service, path: str) -> None:
    answer = httpx.get(f"{tracker.url}{path}", headers={"Authorization": "Bearer not-a-key"})
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("credential", [CLIENT, MESH], ids=["client-key", "mesh-secret"])
def test_with_api_keys_a_client_key_or_the_mesh_secret_reads_the_mesh(tracker: Service, model: str,
                                                                      credential: dict[str, str]) -> None:
    node_id = uid("n")
    assert register(tracker, registration(node_id, model)).status_code == 200
    listed = httpx.get(f"{tracker.url}/v1/nodes", headers=credential)
    assert listed.status_code == 200 and node_id in {n["node_id"] for n in listed.json()["nodes"]}
    assert httpx.get(f"{tracker.url}/v1/mesh", headers=credential).status_code == 200
    route = httpx.get(f"{tracker.url}/v1/route", params={"model": model}, headers=credential)
    assert route.status_code == 200 and route.json()["nodes"][0]["node_id"] == node_id


def test_the_live_page_sends_the_saved_key_to_the_mesh_view(tracker: Service) -> None:
    page = httpx.get(f"{tracker.url}/").text
    assert 'fetch(path, { headers: { Accept: "application/json", ...authHeaders() }' in page
    assert "Authorization: `Bearer ${k}`" in page


# --- addresses are plain ---------------------------------------------------------------------------------------

REFUSED_ENDPOINTS: Final = {
    "query": "http://127.0.0.1:9/admin?x=",
    "fragment": "http://127.0.0.1:9/admin#",
    "userinfo": "http://user:pw@127.0.0.1:9",
    "userinfo-without-password": "http://evil.example@127.0.0.1:9",
    "scheme": "file://127.0.0.1:9/etc",
    "percent-escape": "http://127.0.0.1:9/a%2f..",
    "dot-segment": "http://127.0.0.1:9/a/../admin",
    "too-long": "http://127.0.0.1:9/" + "a" * 600,
    "port": "http://127.0.0.1:70000",
}


@pytest.mark.parametrize("endpoint", REFUSED_ENDPOINTS.values(), ids=REFUSED_ENDPOINTS.keys())
def test_an_endpoint_that_is_not_a_plain_base_url_is_refused_naming_the_field(
        tracker: Service, model: str, endpoint: str) -> None:
    answer = register(tracker, registration(uid("n"), model, endpoint=endpoint))
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "endpoint" and "endpoint" in error["message"]
    assert nodes_of(tracker, model) == {}


@pytest.mark.parametrize("relay_addr", ["ws://127.0.0.1:9/rpc/a?x=1", "ws://127.0.0.1:9/rpc/a#x",
                                        "ws://u@127.0.0.1:9/rpc/a", "http://127.0.0.1:9/rpc/a"])
def test_a_relay_address_that_is_not_plain_is_refused_naming_the_field(tracker: Service, model: str,
                                                                       relay_addr: str) -> None:
    answer = register(tracker, registration(uid("n"), model, relay_addr=relay_addr))
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "relay_addr"
    assert nodes_of(tracker, model) == {}


def test_a_plain_endpoint_with_a_path_prefix_and_a_plain_relay_address_are_accepted(tracker: Service,
                                                                                   model: str) -> None:
    node_id = uid("n")
    body = registration(node_id, model, endpoint="https://node-7.example.org:8443/mesh/a",
                        relay_addr=f"wss://relay.example.org/rpc/{node_id}")
    assert register(tracker, body).status_code == 200
    assert nodes_of(tracker, model)[node_id]["endpoint"] == "https://node-7.example.org:8443/mesh/a"


# --- head answers ---------------------------------------------------------------------------------------------

HEAD_ANSWERS: Final[dict[str, tuple[int, str, bytes]]] = {
    "html": (500, "text/html", f"<html><body>{LEAKED}</body></html>".encode()),
    "plain": (404, "text/plain", LEAKED.encode()),
    "other-json": (403, "application/json", b'{"detail": "' + LEAKED.encode() + b'"}'),
    "redirect": (302, "application/json", b'{"error": {"message": "' + LEAKED.encode() + b'", "type": "x"}}'),
    "ok-html": (200, "text/html", f"<html>{LEAKED}</html>".encode()),
    "openai": (400, "application/json",
               b'{"error": {"message": "max_tokens is too large", "type": "invalid_request_error",'
               b' "code": "bad_max_tokens", "param": "max_tokens"}, "internal": "' + LEAKED.encode() + b'"}'),
    "blames": (502, "application/json",
               b'{"error": {"message": "the next hop failed", "type": "server_error", "code": "hop_failed", '
               + b'"failed_node": "victim-of-a-blame"}}'),
}
"""Per endpoint prefix: the status, content type and body the fake head answers."""


@dataclass
class FakeHeads:
    """An HTTP server answering each prefix as :data:`HEAD_ANSWERS` says, and what it was asked."""

    port: int
    paths: list[str] = field(default_factory=list)

    def endpoint(self, prefix: str) -> str:
        return f"http://127.0.0.1:{self.port}/{prefix}"


@pytest.fixture(scope="module")
def heads() -> Iterator[FakeHeads]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            fake.paths.append(self.path)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, content_type, body = HEAD_ANSWERS[self.path.split("/")[1]]
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Location", "http://127.0.0.1:9/elsewhere")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake = FakeHeads(port=server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


def test_a_heads_error_is_rebuilt_bounded_with_only_scalar_extras() -> None:
    raw = orjson.dumps({"error": {"message": "m" * 10_000, "type": "server_error", "code": "hop_failed",
                                  "failed_node": "tail", "headers": "x", "status": 1, "nested": {"a": LEAKED}},
                        "leak": LEAKED})
    error = parse_openai_error(raw)
    assert error is not None
    relayed = relayed_error(502, error, retry_after="3")
    body = relayed.response()
    assert relayed.status == 502 and body.headers["retry-after"] == "3"
    sent = orjson.loads(body.body)
    assert set(sent) == {"error"} and LEAKED not in body.body.decode()
    assert len(sent["error"]["message"]) == MAX_MESSAGE_CHARS
    assert (sent["error"]["failed_node"], sent["error"]["headers"], sent["error"]["status"]) == ("tail", "x", 1)


@pytest.mark.parametrize("raw", [b"", b"<html></html>", b"[]", b'{"error": "text"}', b'{"error": {"type": "x"}}',
                                 b'{"error": {"message": 1, "type": "x"}}', b'{"detail": "x"}'])
def test_anything_but_an_openai_error_object_is_not_one(raw: bytes) -> None:
    assert parse_openai_error(raw) is None


def chat(tracker: Service, model: str) -> httpx.Response:
    return httpx.post(f"{tracker.url}/v1/chat/completions", headers=CLIENT, timeout=30,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


@pytest.mark.parametrize("prefix", ["html", "plain", "other-json", "redirect", "ok-html"])
def test_a_head_answer_that_is_not_an_openai_answer_is_a_502_quoting_nothing(
        tracker: Service, heads: FakeHeads, model: str, prefix: str) -> None:
    node_id = uid("head")
    assert register(tracker, registration(node_id, model, endpoint=heads.endpoint(prefix))).status_code == 200
    answer = chat(tracker, model)
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert error["code"] == "head_bad_answer" and node_id in error["message"]
    assert LEAKED not in answer.text and "location" not in answer.headers
    assert f"/{prefix}/v1/chat/completions" in heads.paths
    assert nodes_of(tracker, model)[node_id]["failures"] == 1


def test_a_heads_openai_error_reaches_the_client_without_anything_else(tracker: Service, heads: FakeHeads,
                                                                       model: str) -> None:
    register(tracker, registration(uid("head"), model, endpoint=heads.endpoint("openai")))
    client = openai.OpenAI(base_url=f"{tracker.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body == {"message": "max_tokens is too large", "type": "invalid_request_error",
                                 "code": "bad_max_tokens", "param": "max_tokens"}
    assert LEAKED not in raised.value.response.text


def test_a_head_blaming_a_node_its_route_does_not_name_is_blamed_itself(tracker: Service, heads: FakeHeads,
                                                                       model: str) -> None:
    """Issue 34, finding 4: a ``failed_node`` in a head's 502 put a node of the head's choosing in backoff."""
    victim_model = f"{model}-elsewhere"
    assert register(tracker, registration("victim-of-a-blame", victim_model)).status_code == 200
    head = uid("head")
    assert register(tracker, registration(head, model, endpoint=heads.endpoint("blames"))).status_code == 200
    assert chat(tracker, model).status_code == 502
    assert nodes_of(tracker, victim_model)["victim-of-a-blame"]["failures"] == 0
    assert nodes_of(tracker, model)[head]["failures"] == 1


# --- leases ---------------------------------------------------------------------------------------------------


def test_a_live_id_cannot_be_taken_over_at_its_public_endpoint_without_the_lease(tracker: Service,
                                                                                 model: str) -> None:
    node_id = uid("n")
    original = registration(node_id, model)
    lease = register(tracker, original).json()["lease"]
    endpoint = nodes_of(tracker, model)[node_id]["endpoint"]  # anyone with a key can read it
    takeover = register(tracker, registration(node_id, model, 0, 1, endpoint=endpoint))
    assert takeover.status_code == 409
    assert takeover.json()["error"]["code"] == "lease_conflict" and "X-Meshnet-Lease" in takeover.text
    forged = register(tracker, registration(node_id, model, 0, 1, endpoint=endpoint), lease="guessed")
    assert forged.status_code == 409
    node = nodes_of(tracker, model)[node_id]
    assert (node["shard_start"], node["shard_end"], node["heartbeats"]) == (0, NUM_LAYERS - 1, 0)
    heartbeat = register(tracker, original, lease=lease)
    assert heartbeat.status_code == 200 and heartbeat.json()["lease"] == lease


def test_leaving_without_the_lease_is_refused_and_with_it_works(tracker: Service, model: str) -> None:
    node_id = uid("n")
    lease = register(tracker, registration(node_id, model)).json()["lease"]
    bare = httpx.delete(f"{tracker.url}/v1/nodes/{node_id}", headers=MESH)
    assert bare.status_code == 403 and bare.json()["error"]["code"] == "lease_required"
    wrong = httpx.delete(f"{tracker.url}/v1/nodes/{node_id}", headers=MESH | {"X-Meshnet-Lease": "guessed"})
    assert wrong.status_code == 403
    assert nodes_of(tracker, model)[node_id]["state"] != "offline"
    gone = httpx.delete(f"{tracker.url}/v1/nodes/{node_id}", headers=MESH | {"X-Meshnet-Lease": lease})
    assert gone.status_code == 200 and nodes_of(tracker, model)[node_id]["state"] == "offline"


# --- layer counts --------------------------------------------------------------------------------------------


def test_a_lying_first_registration_does_not_fix_the_models_layer_count(tracker: Service, model: str) -> None:
    liar = uid("liar")
    assert register(tracker, registration(liar, model, 0, 1, num_layers=2)).status_code == 200
    honest = [uid("honest"), uid("honest")]
    assert register(tracker, registration(honest[0], model, 0, 1)).status_code == 200
    assert register(tracker, registration(honest[1], model, 2, 3)).status_code == 200
    route = httpx.get(f"{tracker.url}/v1/route", params={"model": model}, headers=MESH).json()
    assert [hop["node_id"] for hop in route["nodes"]] == honest
    listed = nodes_of(tracker, model)
    assert not listed[liar]["routable"] and not listed[liar]["num_layers_agreed"]
    coverage = httpx.get(f"{tracker.url}/v1/mesh", headers=MESH).json()["models"]
    assert next(m for m in coverage if m["model"] == model)["num_layers"] == NUM_LAYERS
