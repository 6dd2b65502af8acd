"""A mesh of nodes that joined by their own join tokens, as real processes: who may do what.

One tracker (admin key set, route keys signing at once after a rotation) and
four nodes of the tiny model, each started with a join token made by
``meshnet token create`` and a shared secret that is *not* the tracker's, so
nothing in this mesh works by the shared secret:

* ``front`` 0-1 (heads), ``mid`` 2-2, ``back`` 3-3, ``alt`` 2-3.

The test process plays ``mallory``: an operator whose node holds a valid join
token of its own, and who tries to use it to steer other nodes' traffic.
"""

from __future__ import annotations

import hashlib
import hmac
import http.server
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from websockets.exceptions import InvalidStatus
from websockets.sync import client as sync_ws

from meshwire import headers as h
from meshwire.frames import encode_frame
from meshwire.hop_proof import sign_request
from meshwire.registry import NodeRegistration
from meshwire.route_keys import SigningKey, b64encode
from meshwire.routes import Route, RouteNode, plan_start_layers, sign_route
from tests.procs import REPO_ROOT, TEST_SECRET, Service, free_port, service_env, start_service, wait_healthy

ADMIN_KEY = "test-admin-key"
CLIENT_KEY = "test-client-key"
NODES_SECRET = "a-secret-that-is-not-the-trackers"
"""What the nodes are given as MESHNET_SECRET: useless, so the mesh must run on tokens and keys."""
HEARTBEAT_S = 0.5
NODE_TTL_S = 30.0
"""Long, so no node expires on a loaded machine: a revoked node leaves at once, not by its TTL."""
LAYERS = {"front": (0, 1), "mid": (2, 2), "back": (3, 3), "alt": (2, 3)}
NUM_LAYERS = 4
HIDDEN = 64
PROMPT = [{"role": "user", "content": "Where does the river run before it reaches the sea?"}]
SETTLE_S = 120.0


@dataclass
class TrustMesh:
    tracker: Service
    relay: Service
    nodes: dict[str, Service]
    tokens: dict[str, str]
    model: str

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_KEY}"}

    def node_view(self) -> dict[str, dict[str, Any]]:
        return {n["node_id"]: n for n in httpx.get(f"{self.tracker.url}/v1/nodes").json()["nodes"]}

    def route(self, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
        params = {"model": self.model, **({"exclude": ",".join(exclude)} if exclude else {})}
        response = httpx.get(f"{self.tracker.url}/v1/route", params=params, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()

    def kids(self) -> list[str]:
        return [key["kid"] for key in httpx.get(f"{self.tracker.url}/v1/keys").json()["keys"]]


def meshnet(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the ``meshnet`` command line as a user would."""
    return subprocess.run([sys.executable, "-m", "meshnet.cli", *args], check=False, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60, env=service_env(env))


def create_token(tracker: Service, node_id: str, *extra: str) -> str:
    made = meshnet("token", "create", "--node-id", node_id, *extra,
                   env={"MESHNET_TRACKER": tracker.url, "MESHNET_ADMIN_KEY": ADMIN_KEY})
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def wait_for(condition: Any, what: str, timeout_s: float = SETTLE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path) -> Iterator[TrustMesh]:
    services: list[Service] = []
    try:
        tracker = start_service("tracker", {"MESHNET_ADMIN_KEY": ADMIN_KEY, "MESHNET_HEARTBEAT_S": str(HEARTBEAT_S),
                                            "MESHNET_NODE_TTL_S": str(NODE_TTL_S), "MESHNET_ROUTE_KEY_LEAD_S": "0"})
        services.append(tracker)
        relay = start_service("relay", {"MESHNET_TRACKER": tracker.url})
        services.append(relay)
        tokens = {name: create_token(tracker, name, "--layers", f"{start}-{end}", "--model", tiny_model_dir.name)
                  for name, (start, end) in LAYERS.items()}
        tokens["mallory"] = create_token(tracker, "mallory")
        nodes: dict[str, Service] = {}
        for name, (start, end) in LAYERS.items():
            nodes[name] = start_service("node", {
                "MESHNET_MODEL": str(tiny_model_dir), "MESHNET_LAYERS": f"{start}-{end}",
                "MESHNET_TRACKER": tracker.url, "MESHNET_NODE_ID": name, "MESHNET_DTYPE": "float32",
                "MESHNET_DEVICE": "cpu", "MESHNET_HEARTBEAT_S": str(HEARTBEAT_S), "MESHNET_JOIN_TOKEN": tokens[name],
                "MESHNET_SECRET": NODES_SECRET, "MESHNET_API_KEYS": CLIENT_KEY}, wait_ready=False)
            services.append(nodes[name])
        for node in nodes.values():
            wait_healthy(node)
        wait_for(lambda: {n["node_id"] for n in httpx.get(f"{tracker.url}/v1/nodes").json()["nodes"]
                          if n["state"] in ("online", "suspect")} == set(LAYERS), "every node to register")
        model = httpx.get(f"{tracker.url}/v1/models").json()["data"][0]["id"]
        yield TrustMesh(tracker=tracker, relay=relay, nodes=nodes, tokens=tokens, model=model)
    finally:
        for service in reversed(services):
            service.stop()


def expected_answer(model_dir: Path, max_tokens: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=max_tokens)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


# --- the mesh works on tokens and keys alone ----------------------------------------------------------------


def test_nodes_that_joined_by_token_serve_what_transformers_generates(mesh: TrustMesh, tiny_model_dir: Path) -> None:
    client = openai.OpenAI(base_url=f"{mesh.tracker.url}/v1", api_key="unused", max_retries=0, timeout=120)
    for exclude in ((), ("alt",), ("mid", "back")):  # 2 and 3 hops
        route = mesh.route(exclude)
        assert all(node["hop_key"] for node in route["nodes"]), "every hop's key is vouched for in the route"
    answer = client.chat.completions.create(model=mesh.model, messages=PROMPT, max_tokens=24, temperature=0)
    assert answer.choices[0].message.content == expected_answer(tiny_model_dir, 24)


def test_the_tracker_publishes_its_route_keys_to_anyone_as_a_jwk_set(mesh: TrustMesh) -> None:
    response = httpx.get(f"{mesh.tracker.url}/v1/keys")  # no credential
    assert response.status_code == 200
    keys = response.json()["keys"]
    assert keys and all(set(key) == {"kty", "crv", "kid", "x"} and (key["kty"], key["crv"]) == ("OKP", "Ed25519")
                        for key in keys)
    token = mesh.route()["token"]
    header = orjson.loads(b64decode_text(token.split(".")[0]))
    assert header == {"alg": "EdDSA", "kid": header["kid"]} and header["kid"] in {k["kid"] for k in keys}


def b64decode_text(text: str) -> bytes:
    import base64

    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@pytest.mark.parametrize("call", [
    ("POST", "/v1/admin/tokens", {"node_id": "x"}), ("GET", "/v1/admin/tokens", None),
    ("DELETE", "/v1/admin/tokens/0123456789abcdef", None), ("POST", "/v1/admin/keys/rotate", None)])
def test_the_admin_api_refuses_everyone_but_the_operator(mesh: TrustMesh, call: tuple[str, str, Any]) -> None:
    method, path, body = call
    url = f"{mesh.tracker.url}{path}"
    assert httpx.request(method, url, json=body).status_code == 401
    for credential in ("wrong", TEST_SECRET, mesh.tokens["mallory"], CLIENT_KEY):  # nobody's key but the admin's
        refused = httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {credential}"})
        assert refused.status_code == 403, (credential, refused.text)


def test_the_token_check_the_relay_asks_needs_the_token_it_checks(mesh: TrustMesh) -> None:
    url = f"{mesh.tracker.url}/v1/tokens/check"
    assert httpx.post(url, params={"node_id": "front"}).status_code == 401
    assert httpx.post(url, params={"node_id": "front"}, headers={"Authorization": f"Bearer {TEST_SECRET}"}
                      ).status_code == 401, "the shared secret is not a join token"
    front = {"Authorization": f"Bearer {mesh.tokens['front']}"}
    assert httpx.post(url, params={"node_id": "front"}, headers=front).status_code == 200
    assert httpx.post(url, params={"node_id": "mid"}, headers=front).status_code == 403


def test_the_token_list_shows_every_token_without_its_secret(mesh: TrustMesh) -> None:
    listed = meshnet("token", "list", env={"MESHNET_TRACKER": mesh.tracker.url, "MESHNET_ADMIN_KEY": ADMIN_KEY})
    assert listed.returncode == 0, listed.stderr
    for name, token in mesh.tokens.items():
        assert name in listed.stdout and token not in listed.stdout
    assert meshnet("token", "list", env={"MESHNET_TRACKER": mesh.tracker.url}).returncode == 2


# --- a node with a valid token cannot steer another node's traffic ------------------------------------------------


class Sink:
    """An HTTP listener a forged route points at: it counts what reaches it."""

    def __init__(self) -> None:
        self.hits = 0
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                sink.hits += 1
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return

        self.port = free_port()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


MALLORY_KEY = SigningKey.generate()
"""Mallory's own hop key (and the key it would sign routes with if it could)."""


def forged_route(mesh: TrustMesh, sink: Sink) -> Route:
    """mallory (0-1) -> mid (2-2) -> the sink (3-3): mid would send its layers' output wherever mallory says."""
    mid = mesh.node_view()["mid"]
    hops = [RouteNode(node_id="mallory", endpoint="http://127.0.0.1:9", shard_start=0, shard_end=1,
                      hop_key=MALLORY_KEY.public_text),
            RouteNode(node_id="mid", endpoint=mid["endpoint"], shard_start=2, shard_end=2),
            RouteNode(node_id="sink", endpoint=sink.url, shard_start=3, shard_end=3)]
    return Route(model=mesh.model, nodes=plan_start_layers(hops), num_layers=NUM_LAYERS)


def hmac_token(route: Route) -> str:
    payload = {"route": route.model_dump(mode="json"), "exp": time.time() + 60, "iat": time.time(), "v": 1}
    first = b64encode(orjson.dumps(payload))
    return f"{first}.{b64encode(hmac.new(TEST_SECRET.encode(), first.encode(), hashlib.sha256).digest())}"


def impersonating_token(route: Route, kid: str) -> str:
    """Signed with mallory's key, under the id of the tracker's key."""
    payload = {"route": route.model_dump(mode="json", exclude_none=True), "exp": time.time() + 60,
               "iat": time.time(), "v": 2}
    signed = b64encode(orjson.dumps({"alg": "EdDSA", "kid": kid})) + "." + b64encode(orjson.dumps(payload))
    return f"{signed}.{b64encode(MALLORY_KEY.sign(signed.encode()))}"


def frame_to_mid(route_token: str, session: str, signer: str | None = "mallory",
                 key: SigningKey = MALLORY_KEY) -> tuple[dict[str, str], bytes]:
    """Step 0 of ``session`` for hop 1 (mid), signed by ``signer`` with ``key`` (unsigned for ``None``)."""
    hidden = torch.randn((1, 3, HIDDEN), generator=torch.Generator().manual_seed(1))
    headers, body = encode_frame(hidden, session=session, extra={
        h.ROUTE: route_token, h.HOP_INDEX: "1", h.START_LAYER: "2", h.STEP: "0", h.POSITION_OFFSET: "0",
        h.RESERVE: "8", h.SAMPLING: '{"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0}'})
    if signer is None:
        return headers, body
    return {**headers, **sign_request(key, signer, "/forward", headers, body)}, body


def test_a_node_with_a_valid_token_cannot_make_a_route_another_node_accepts(mesh: TrustMesh) -> None:
    sink = Sink()
    try:
        # mallory's token is valid: the tracker gives it routes and lets it register
        assert httpx.get(f"{mesh.tracker.url}/v1/route", params={"model": mesh.model},
                         headers={"Authorization": f"Bearer {mesh.tokens['mallory']}"}).status_code == 200
        route = forged_route(mesh, sink)
        tracker_kid = mesh.kids()[-1]
        forgeries = {
            "HMAC with the old shared secret": hmac_token(route),
            "mallory's key under the tracker's key id": impersonating_token(route, tracker_kid),
            "mallory's key under its own key id": sign_route(route, MALLORY_KEY),
        }
        mid = mesh.nodes["mid"].url
        for name, token in forgeries.items():
            headers, body = frame_to_mid(token, f"s-forged-{len(name)}")
            response = httpx.post(f"{mid}/forward", headers=headers, content=body, timeout=30)
            assert response.status_code == 403, (name, response.text)
            assert response.json()["error"]["code"] == "bad_route", (name, response.text)
        assert sink.hits == 0, "a forged route made mid send its output to the sink"
        assert httpx.get(f"{mid}/health").json()["sessions"] == 0
    finally:
        sink.server.shutdown()


def test_a_node_cannot_send_frames_along_a_real_route_in_another_nodes_place(mesh: TrustMesh) -> None:
    route = mesh.route(exclude=("alt",))
    assert [node["node_id"] for node in route["nodes"]] == ["front", "mid", "back"]
    for signer, key in (("mallory", MALLORY_KEY), ("front", MALLORY_KEY)):
        headers, body = frame_to_mid(route["token"], f"s-steal-{signer}", signer, key)
        response = httpx.post(f"{mesh.nodes['mid'].url}/forward", headers=headers, content=body, timeout=30)
        assert response.status_code == 403 and response.json()["error"]["code"] == "bad_proof", response.text
    headers, body = frame_to_mid(route["token"], "s-steal-secret", signer=None)
    shared = httpx.post(f"{mesh.nodes['mid'].url}/forward", content=body, timeout=30,
                        headers={**headers, "Authorization": f"Bearer {NODES_SECRET}"})
    assert shared.status_code == 401, "a node that joined by token takes no shared secret on /forward"
    assert httpx.get(f"{mesh.nodes['mid'].url}/health").json()["sessions"] == 0


def test_a_second_node_cannot_register_under_an_id_whose_token_it_does_not_hold(mesh: TrustMesh) -> None:
    before = mesh.node_view()["front"]
    takeover = NodeRegistration(node_id="front", model=mesh.model, endpoint="http://127.0.0.1:9", shard_start=0,
                                shard_end=1, hop_key=MALLORY_KEY.public_text).model_dump_json()
    url = f"{mesh.tracker.url}/v1/nodes"
    for credential, status, code in ((mesh.tokens["mallory"], 403, "token_node_mismatch"),
                                     (TEST_SECRET, 403, "token_required"), ("wrong", 403, "invalid_credential"),
                                     (None, 401, "missing_credential")):
        headers = {"Content-Type": "application/json"}
        if credential is not None:
            headers["Authorization"] = f"Bearer {credential}"
        refused = httpx.post(url, content=takeover, headers=headers)
        assert (refused.status_code, refused.json()["error"]["code"]) == (status, code), refused.text
    after = mesh.node_view()["front"]
    assert (after["endpoint"], after["state"]) == (before["endpoint"], "online")
    head = mesh.route(exclude=("alt",))["nodes"][0]
    assert (head["node_id"], head["endpoint"]) == ("front", before["endpoint"])
    assert head["hop_key"] != MALLORY_KEY.public_text


# --- the relay ------------------------------------------------------------------------------------------------


def handshake(url: str, credential: str | None) -> int:
    """The status the relay answers a WebSocket handshake with (101 when it is accepted)."""
    headers = {} if credential is None else {"Authorization": f"Bearer {credential}"}
    try:
        with sync_ws.connect(url, additional_headers=headers, open_timeout=30):
            return 101
    except InvalidStatus as refused:
        return refused.response.status_code


def test_the_relay_admits_a_peer_by_the_join_token_that_binds_its_id(mesh: TrustMesh) -> None:
    peer = f"ws://127.0.0.1:{mesh.relay.port}/peer/front"
    assert handshake(peer, mesh.tokens["front"]) == 101
    assert handshake(peer, mesh.tokens["mallory"]) == 403, "a valid token of another node"
    assert handshake(peer, "mnj_0123456789abcdef_" + "A" * 43) == 403, "a token the tracker never issued"
    assert handshake(peer, None) == 401


# --- key rotation ------------------------------------------------------------------------------------------------


def head_chat(mesh: TrustMesh, route_token: str) -> httpx.Response:
    return httpx.post(f"{mesh.nodes['front'].url}/v1/chat/completions", timeout=60,
                      headers={h.ROUTE: route_token, "Authorization": f"Bearer {CLIENT_KEY}"},
                      json={"model": mesh.model, "messages": PROMPT, "max_tokens": 4, "temperature": 0})


def test_a_rotation_keeps_routes_signed_with_the_old_key_valid_until_they_expire(mesh: TrustMesh) -> None:
    before = mesh.route(exclude=("alt",))["token"]
    old = mesh.kids()
    rotated = httpx.post(f"{mesh.tracker.url}/v1/admin/keys/rotate", headers=mesh.admin())
    assert rotated.status_code == 200, rotated.text
    new_kid = rotated.json()["kid"]
    assert mesh.kids() == [*old, new_kid], "the new key is published beside the old"
    after = mesh.route(exclude=("alt",))["token"]
    assert orjson.loads(b64decode_text(after.split(".")[0]))["kid"] == new_kid
    for token in (before, after):  # the head meets the new key first here: it fetches the tracker's keys again
        answer = head_chat(mesh, token)
        assert answer.status_code == 200, answer.text
    client = openai.OpenAI(base_url=f"{mesh.tracker.url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert client.chat.completions.create(model=mesh.model, messages=PROMPT, max_tokens=4, temperature=0).choices


# --- revocation (last: it takes mid out of the mesh) ---------------------------------------------------------------


def test_a_revoked_tokens_node_is_out_of_every_new_route_and_refused_at_its_next_heartbeat(mesh: TrustMesh) -> None:
    token_id = mesh.tokens["mid"].split("_")[1]
    assert "mid" in [n["node_id"] for n in mesh.route(exclude=("alt",))["nodes"]]
    revoked = meshnet("token", "revoke", token_id, env={"MESHNET_TRACKER": mesh.tracker.url,
                                                        "MESHNET_ADMIN_KEY": ADMIN_KEY})
    assert revoked.returncode == 0, revoked.stderr
    for _ in range(10):
        assert "mid" not in [n["node_id"] for n in mesh.route()["nodes"]]
    no_route = httpx.get(f"{mesh.tracker.url}/v1/route", params={"model": mesh.model, "exclude": "alt"})
    assert no_route.status_code == 503 and no_route.json()["error"]["missing_layers"] == [[2, 2]]
    wait_for(lambda: "refused" in mesh.nodes["mid"].log() and "token_revoked" in mesh.nodes["mid"].log(),
             "mid's next heartbeat to be refused")
    assert mesh.node_view()["mid"]["state"] == "offline"
    listed = httpx.get(f"{mesh.tracker.url}/v1/admin/tokens", headers=mesh.admin()).json()["tokens"]
    assert {t["node_id"]: t["state"] for t in listed}["mid"] == "revoked"
