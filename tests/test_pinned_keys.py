"""Issue 34, finding 12, with real processes: a node that pinned route keys trusts nothing a plain-HTTP tracker serves.

A tracker over ``http://``, reached across this machine's network address (not
loopback, where nobody on a network could answer for it), serves its own route
key at ``GET /v1/keys``: to the node, that is a key it did not pin, exactly
what a network attacker answering the node's key fetch would serve. The node
holds every layer, pins the test's route key (``MESHNET_ROUTE_KEYS``) and
registers with that tracker. Before the fix it added the tracker's key to its
pins, so a call signed with it was answered; now the node trusts its pins
alone: the tracker's signed call is refused, and a call signed with the pinned
key still runs.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from meshwire import headers as h
from meshwire.hop_proof import TRACKER_SIGNER_PREFIX, sign_request
from meshwire.routes import Route, RouteNode, plan_start_layers, sign_route
from tests.procs import TEST_ROUTE_KEY, Service, node_hop_key, pinned_node_env, start_service, wait_healthy
from tests.tiny_mesh import wait_until_servable

NODE = "pinned"
NUM_LAYERS = 4
PROMPT = [{"role": "user", "content": "Hello"}]


def network_address() -> str:
    """This machine's address on its network (no packet is sent); skips where it has none but loopback."""
    address = "127.0.0.1"
    for target in ("198.51.100.1", "10.254.254.254", "8.8.8.8"):  # only the route to it is looked up
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((target, 9))
            address = str(probe.getsockname()[0])
            break
        except OSError:
            continue
        finally:
            probe.close()
    if ipaddress.ip_address(address).is_loopback:
        pytest.skip("this machine has no network address besides loopback: no network path to attack")
    return address


@pytest.fixture(scope="module")
def mesh(tiny_model_dir: Path) -> Iterator[tuple[Service, Service, str]]:
    tracker = start_service("tracker", {"MESHNET_HEARTBEAT_S": "1"}, host=network_address())
    node = start_service("node", {"MESHNET_MODEL": str(tiny_model_dir), "MESHNET_LAYERS": f"0-{NUM_LAYERS - 1}",
                                  "MESHNET_TRACKER": tracker.url, "MESHNET_NODE_ID": NODE, "MESHNET_DTYPE": "float32",
                                  "MESHNET_DEVICE": "cpu", "MESHNET_HEARTBEAT_S": "1", **pinned_node_env(NODE)},
                         wait_ready=False)
    try:
        wait_healthy(node)
        model = wait_until_servable(tracker, tiny_model_dir.name)
        yield tracker, node, model
    finally:
        node.stop()
        tracker.stop()


def test_the_trackers_own_key_served_over_http_is_not_added_to_the_pins(mesh: tuple[Service, Service, str]) -> None:
    tracker, node, model = mesh
    served = {key["kid"] for key in httpx.get(f"{tracker.url}/v1/keys").json()["keys"]}
    assert served and TEST_ROUTE_KEY.kid not in served, "the tracker serves a key the node did not pin"
    through_tracker = httpx.post(f"{tracker.url}/v1/chat/completions", timeout=120,
                                 json={"model": model, "messages": PROMPT, "max_tokens": 2, "temperature": 0})
    assert through_tracker.status_code != 200, "the node took a call signed with a key it fetched over http://"
    assert "is not one of the tracker's keys this node holds" in through_tracker.text, through_tracker.text
    assert "trusts its pins alone" in node.log()


def test_a_call_signed_with_the_pinned_key_still_runs(mesh: tuple[Service, Service, str]) -> None:
    _, node, model = mesh
    hop = RouteNode(node_id=NODE, endpoint=node.url, shard_start=0, shard_end=NUM_LAYERS - 1, start_layer=0,
                    hop_key=node_hop_key(NODE).public_text)
    token = sign_route(Route(model=model, nodes=plan_start_layers([hop]), num_layers=NUM_LAYERS), TEST_ROUTE_KEY)
    body = orjson.dumps({"model": model, "messages": PROMPT, "max_tokens": 2, "temperature": 0})
    sent = {"Content-Type": "application/json", h.ROUTE: token}
    signed = {**sent, **sign_request(TEST_ROUTE_KEY, f"{TRACKER_SIGNER_PREFIX}{TEST_ROUTE_KEY.kid}",
                                     "/v1/chat/completions", sent, body)}
    answer = httpx.post(f"{node.url}/v1/chat/completions", headers=signed, content=body, timeout=120)
    assert answer.status_code == 200, answer.text
