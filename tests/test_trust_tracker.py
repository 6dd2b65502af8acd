"""Issue 34 against real processes: what a member that joined with its own token can no longer do to the mesh.

A tracker with an admin key, an honest node holding every layer of the tiny
model, and a dishonest member: the test itself, holding a join token, with a
fake head process behind its registration (``tests/fake_head.py``, slow on
purpose). Each test does what the attack did and shows it fails.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import orjson
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync import client as sync_ws

from services.relay.join_tokens import ADMIT_TTL_S
from services.tracker.settings import ROUTE_TTL_S
from tests.procs import REPO_ROOT, Service, free_port, service_env, start_service, wait_healthy
from tests.tiny_mesh import wait_until_servable

ADMIN: Final = "admin-key-for-the-attack-tests"
LIAR: Final = "a-liar"  # first in id order, so a tie in the planner goes its way
HONEST: Final = "honest"
FAKE_DELAY_S: Final = "1.0"
REQUESTS: Final = 8
WAIT_S: Final = 60.0


@dataclass
class Mesh:
    tracker: Service
    model: str
    fake_url: str
    relay: Service


def _admin(tracker: Service) -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN}"}


def issue(tracker: Service, node_id: str, **bindings: str) -> str:
    made = httpx.post(f"{tracker.url}/v1/admin/tokens", json={"node_id": node_id, **bindings},
                      headers=_admin(tracker))
    assert made.status_code == 201, made.text
    return str(made.json()["token"])


def register(tracker: Service, token: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{tracker.url}/v1/nodes", json=body, headers={"Authorization": f"Bearer {token}"})


def nodes(tracker: Service) -> dict[str, dict[str, Any]]:
    return {node["node_id"]: node for node in httpx.get(f"{tracker.url}/v1/nodes").json()["nodes"]}


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path) -> Iterator[Mesh]:
    port = free_port()
    fake = subprocess.Popen([sys.executable, "-m", "uvicorn", "tests.fake_head:app", "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning"], cwd=REPO_ROOT,
                            env={**service_env(), "FAKE_HEAD_DELAY_S": FAKE_DELAY_S})
    tracker = start_service("tracker", {"MESHNET_ADMIN_KEY": ADMIN, "MESHNET_NODE_TTL_S": "120",
                                        "MESHNET_HEARTBEAT_S": "1"})
    node = start_service("node", {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_LAYERS": "0-3",
                                  "MESHNET_TRACKER": tracker.url, "MESHNET_NODE_ID": HONEST,
                                  "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu", "MESHNET_HEARTBEAT_S": "1"},
                         wait_ready=False)
    relay = start_service("relay", {"MESHNET_TRACKER": tracker.url})
    try:
        wait_healthy(node)
        model = wait_until_servable(tracker, tiny_model_dir.name)
        deadline = time.monotonic() + WAIT_S
        while not _up(f"http://127.0.0.1:{port}/health"):
            assert time.monotonic() < deadline, "the fake head never came up"
            time.sleep(0.1)
        yield Mesh(tracker, model, f"http://127.0.0.1:{port}", relay)
    finally:
        relay.stop()
        node.stop()
        tracker.stop()
        fake.terminate()
        fake.wait(10)


def _up(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def _fake_served(mesh: Mesh) -> int:
    return int(httpx.get(f"{mesh.fake_url}/served").json()["served"])


def test_a_node_claiming_infinite_speed_heads_routes_only_until_its_streams_are_measured(mesh: Mesh) -> None:
    """Finding 4: a node that registered ``decode_tokens_per_s`` 1e300 headed 20 of 20 routes."""
    token = issue(mesh.tracker, LIAR)
    claim = {"node_id": LIAR, "model": mesh.model, "endpoint": mesh.fake_url, "shard_start": 0, "shard_end": 3,
             "num_layers": 4, "decode_tokens_per_s": 1e300}
    assert register(mesh.tracker, token, claim).status_code == 200
    client = openai.OpenAI(base_url=f"{mesh.tracker.url}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    for _ in range(REQUESTS):
        client.chat.completions.create(model=mesh.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, temperature=0)
    served = _fake_served(mesh)
    assert 1 <= served <= 2, f"the liar headed {served} of {REQUESTS} routes"
    listed = nodes(mesh.tracker)
    assert listed[LIAR]["measured_streams"] == served
    assert listed[LIAR]["measured_tokens_per_s"] < listed[HONEST]["measured_tokens_per_s"]
    assert httpx.delete(f"{mesh.tracker.url}/v1/admin/tokens/{token.split('_')[1]}",
                        headers=_admin(mesh.tracker)).status_code == 200


def test_a_member_cannot_put_a_node_of_a_route_it_does_not_head_in_backoff(mesh: Mesh) -> None:
    """Finding 4: any member could ``POST /v1/nodes/{any}/failures`` and keep honest nodes in backoff."""
    token = issue(mesh.tracker, "a-reporter")
    auth = {"Authorization": f"Bearer {token}"}
    url = f"{mesh.tracker.url}/v1/nodes/{HONEST}/failures"
    bare = httpx.post(url, json={"reason": "it failed, trust me"}, headers=auth)
    assert bare.status_code == 400 and bare.json()["error"]["code"] == "route_required"
    honest_route = httpx.get(f"{mesh.tracker.url}/v1/route", params={"model": mesh.model}).json()
    assert honest_route["nodes"][0]["node_id"] == HONEST
    other = httpx.post(url, json={"reason": "it failed, trust me", "route": honest_route["token"]}, headers=auth)
    assert other.status_code == 403 and other.json()["error"]["code"] == "not_route_head"
    assert nodes(mesh.tracker)[HONEST]["failures"] == 0
    assert nodes(mesh.tracker)[HONEST]["state"] != "suspect"


def test_token_bindings_hold_and_an_unbound_token_cannot_take_over_a_model_name(mesh: Mesh) -> None:
    """Finding 4: a token without bindings could claim every layer, or serve another model under a name."""
    made = subprocess.run([sys.executable, "-m", "meshnet.cli", "token", "--tracker", mesh.tracker.url,
                           "--admin-key", ADMIN, "create", "--node-id", "bound", "--model", mesh.model,
                           "--layers", "2-3"], cwd=REPO_ROOT, env=service_env(), capture_output=True, text=True,
                          timeout=WAIT_S, check=True)
    bound = made.stdout.strip()
    body = {"node_id": "bound", "model": mesh.model, "endpoint": f"http://127.0.0.1:{free_port()}",
            "shard_start": 0, "shard_end": 3, "num_layers": 4}
    every_layer = register(mesh.tracker, bound, body)
    assert every_layer.status_code == 403 and every_layer.json()["error"]["code"] == "token_layers_mismatch"
    other_model = register(mesh.tracker, bound, {**body, "model": "/models/another", "shard_start": 2})
    assert other_model.status_code == 403 and other_model.json()["error"]["code"] == "token_model_mismatch"

    unbound = issue(mesh.tracker, "taker")
    takeover = {**body, "node_id": "taker", "num_layers": 8, "shard_end": 7}
    refused = register(mesh.tracker, unbound, takeover)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_conflict"
    assert "taker" not in nodes(mesh.tracker)


def test_revoking_a_token_moves_a_stream_through_its_node_at_the_next_token_and_bounds_its_routes(
        mesh: Mesh) -> None:
    """Finding 11: routes already signed opened sessions for 600 s and open streams ran on after a revocation."""
    token = issue(mesh.tracker, "a-revoked")
    claim = {"node_id": "a-revoked", "model": mesh.model, "endpoint": mesh.fake_url, "shard_start": 0,
             "shard_end": 3, "num_layers": 4, "decode_tokens_per_s": 1e300}
    assert register(mesh.tracker, token, claim).status_code == 200
    signed = httpx.get(f"{mesh.tracker.url}/v1/route", params={"model": mesh.model}).json()
    assert signed["nodes"][0]["node_id"] == "a-revoked"  # not measured yet: its claim seeds it
    assert signed["expires_at"] - time.time() <= ROUTE_TTL_S <= 60  # the bound on an issued route
    body = {"model": mesh.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
            "temperature": 0, "stream": True}
    contents: list[str] = []
    finishes: list[str] = []
    with httpx.stream("POST", f"{mesh.tracker.url}/v1/chat/completions", json=body, timeout=WAIT_S) as answer:
        lines = (line for line in answer.iter_lines() if line.startswith("data: {"))
        for line in lines:
            if '"content":"x"' in line:
                break  # the revoked node's first token reached the client
        token_id = token.split("_")[1]
        assert httpx.delete(f"{mesh.tracker.url}/v1/admin/tokens/{token_id}",
                            headers=_admin(mesh.tracker)).json()["evicted"]
        for line in lines:
            assert '"error"' not in line, line
            event = orjson.loads(line[len("data: "):])
            for choice in event["choices"]:
                contents.append(choice["delta"].get("content") or "")
                if choice.get("finish_reason"):
                    finishes.append(choice["finish_reason"])
    assert finishes, "the stream ended without a finish"
    assert (contents, finishes) != (["x", "x"], ["length"]), "the revoked node answered the rest of the stream"
    assert "a-revoked" not in [n["node_id"] for n in httpx.get(
        f"{mesh.tracker.url}/v1/route", params={"model": mesh.model}).json()["nodes"]]
    assert nodes(mesh.tracker)["a-revoked"]["state"] == "offline"
    assert register(mesh.tracker, token, claim).status_code == 403  # refused at its next heartbeat


def _handshake(url: str, credential: str) -> int:
    """The status the relay answers a peer's WebSocket handshake with (101: accepted)."""
    try:
        with sync_ws.connect(url, additional_headers={"Authorization": f"Bearer {credential}"}, open_timeout=30):
            return 101
    except InvalidStatus as refused:
        return refused.response.status_code


def test_a_relay_refuses_a_revoked_token_within_its_stated_bound(mesh: Mesh) -> None:
    """Finding 11: the relay kept admitting a revoked token for its cache lifetime (30 s): now 10 s."""
    token = issue(mesh.tracker, "relayed-peer")
    peer = f"ws://127.0.0.1:{mesh.relay.port}/peer/relayed-peer"
    assert _handshake(peer, token) == 101  # the relay now remembers the tracker's yes
    assert httpx.delete(f"{mesh.tracker.url}/v1/admin/tokens/{token.split('_')[1]}",
                        headers=_admin(mesh.tracker)).status_code == 200
    revoked_at = time.monotonic()
    while _handshake(peer, token) != 403:
        assert time.monotonic() - revoked_at <= ADMIT_TTL_S + 5, "the relay still admits the revoked token"
        time.sleep(0.5)
    assert ADMIT_TTL_S <= 10
