"""A node behind NAT serves its layers through the relay, and the chat equals single-process transformers.

Made real with a network namespace: the second node runs inside its own
namespace, listening only on that namespace's loopback, so nothing outside
can dial it. A veth pair joins the namespace to the host (10.200.x.1 on the
host, 10.200.x.2 inside); the relay and the tracker listen on the host end,
which the hidden node reaches by its outbound connections and the head by its
hop client. Routes (signed here, or by the tracker from the registrations) name
the hidden node with an endpoint the head cannot connect to and its
``relay_addr``: the only way in is the relay.

Needs root (``ip netns``, as in CI); skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
import websockets.sync.client as sync_ws
from transformers import AutoModelForCausalLM, AutoTokenizer

from meshwire.auth import bearer_headers
from meshwire.relay_client import RelayCaller, RelayError, rpc_address
from meshwire.routes import Route, RouteNode, sign_route
from tests.procs import (
    TEST_ROUTE_KEY,
    TEST_ROUTE_KEYS,
    TEST_SECRET,
    Service,
    free_port,
    node_hop_key,
    pinned_node_env,
    start_service,
)
from tests.requirements import require

pytestmark = pytest.mark.root

NUM_LAYERS = 4
MAX_TOKENS = 12
READY_S = 120.0
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
NODE_ENV = {"MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu", "MESHNET_THREADS": "1"}
RELAY_ENV = {"MESHNET_ROUTE_KEYS": TEST_ROUTE_KEYS}
"""The routes' keys, so the relay verifies the head's signed, peer-bound handshake (the head shows no secret to
a relay the hidden node chose)."""


@dataclass(frozen=True)
class Namespace:
    """A network namespace joined to the host by a veth pair."""

    name: str
    host_ip: str
    inside_ip: str

    def wrapper(self) -> list[str]:
        """The command prefix that runs a process inside the namespace."""
        return ["ip", "netns", "exec", self.name]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")


@pytest.fixture(scope="module")
def namespace() -> Iterator[Namespace]:
    """A fresh namespace with loopback up and a /30 veth link to the host; always removed."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a network namespace (ip netns); CI runs as root")
    require(shutil.which("ip") is not None, "the `ip` command (iproute2) is not installed")
    tag = uuid.uuid4().hex[:6]
    name, veth_host, veth_inside = f"meshnet-{tag}", f"mn{tag}h", f"mn{tag}n"
    block = random.randrange(1, 1 << 14)  # a /30 inside 10.200.0.0/16
    host_ip = f"10.200.{block >> 6}.{(block & 63) * 4 + 1}"
    inside_ip = f"10.200.{block >> 6}.{(block & 63) * 4 + 2}"
    try:
        _ip("netns", "add", name)
    except RuntimeError as exc:
        pytest.skip(f"cannot create a network namespace here: {exc}")
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("link", "add", veth_host, "type", "veth", "peer", "name", veth_inside)
        _ip("link", "set", veth_inside, "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", veth_host)
        _ip("link", "set", veth_host, "up")
        _ip("-n", name, "addr", "add", f"{inside_ip}/30", "dev", veth_inside)
        _ip("-n", name, "link", "set", veth_inside, "up")
    except RuntimeError as exc:
        subprocess.run(["ip", "link", "del", veth_host], check=False, capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True, timeout=30)
        pytest.skip(f"cannot wire a veth pair into the namespace here: {exc}")
    try:
        yield Namespace(name=name, host_ip=host_ip, inside_ip=inside_ip)
    finally:
        subprocess.run(["ip", "link", "del", veth_host], check=False, capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True, timeout=30)


@dataclass
class HiddenMesh:
    """A tracker and a relay on the host end of the veth, a head on the host, a tail only the relay reaches."""

    namespace: Namespace
    tracker: Service
    relay: Service
    head: Service
    hidden: Service
    hidden_id: str
    hidden_port: int
    model_id: str

    @property
    def relay_addr(self) -> str:
        return rpc_address(f"ws://{self.relay.host}:{self.relay.port}", self.hidden_id)

    def restart_relay(self) -> None:
        """Kill the relay without a goodbye and start it again on the same address."""
        self.relay.kill(signal.SIGKILL)
        self.relay = start_service("relay", RELAY_ENV, port=self.relay.port, host=self.relay.host)

    def route_token(self) -> str:
        """A signed route: the head, then the hidden node at an endpoint nobody can dial, with its relay."""
        route = Route(model=self.model_id, num_layers=NUM_LAYERS, nodes=(
            RouteNode(node_id=_health(self.head)["node_id"], endpoint=self.head.url,
                      shard_start=0, shard_end=1, start_layer=0, hop_key=node_hop_key("head").public_text),
            RouteNode(node_id=self.hidden_id, endpoint=f"http://{self.namespace.inside_ip}:{self.hidden_port}",
                      shard_start=2, shard_end=3, start_layer=2, relay_addr=self.relay_addr,
                      hop_key=node_hop_key("hidden").public_text),
        ))
        return sign_route(route, TEST_ROUTE_KEY)


def _health(service: Service) -> dict[str, object]:
    return httpx.get(f"{service.url}/health", timeout=10).json()


def wait_ready_through_relay(mesh: HiddenMesh) -> None:
    """Poll the hidden node's /health through the relay until it is 200 (the relay is its only way in)."""

    async def poll() -> None:
        caller = RelayCaller(TEST_SECRET)
        deadline = time.monotonic() + READY_S
        try:
            while True:
                if not mesh.hidden.alive():
                    pytest.fail(f"the hidden node exited:\n{mesh.hidden.log()}")
                try:
                    status, _, _ = await caller.request(mesh.relay_addr, "GET", "/health", {}, b"", 10)
                    if status == 200:
                        return
                except RelayError:
                    pass  # not connected yet (unknown_peer) or just dropped
                if time.monotonic() > deadline:
                    pytest.fail("the hidden node never answered through the relay (does a node start a RelayPeer "
                                f"when MESHNET_RELAY is set?); its log:\n{mesh.hidden.log()}")
                await asyncio.sleep(0.2)
        finally:
            await caller.close()

    asyncio.run(poll())


@pytest.fixture(scope="module")
def mesh(namespace: Namespace, tiny_model_dir: Path) -> Iterator[HiddenMesh]:
    tracker = start_service("tracker", host=namespace.host_ip)
    services = [tracker]
    try:
        relay = start_service("relay", RELAY_ENV, host=namespace.host_ip)
        services.append(relay)
        hidden_id = f"behind-nat-{uuid.uuid4().hex[:6]}"
        hidden_port = free_port()
        # It registers an endpoint nobody can dial (it listens on its namespace's loopback only).
        hidden = start_service(
            "node", {**NODE_ENV, "MESHNET_MODEL": str(tiny_model_dir), "MESHNET_LAYERS": "2-3",
                     "MESHNET_NODE_ID": hidden_id, "MESHNET_TRACKER": tracker.url, **pinned_node_env("hidden", tracker),
                     "MESHNET_ADVERTISE": f"http://{namespace.inside_ip}:{hidden_port}",
                     "MESHNET_RELAY": f"ws://{namespace.host_ip}:{relay.port}"},
            port=hidden_port, host="127.0.0.1", wrapper=namespace.wrapper(), wait_ready=False)
        services.append(hidden)
        head = start_service("node", {**NODE_ENV, "MESHNET_MODEL": str(tiny_model_dir), "MESHNET_LAYERS": "0-1",
                                      "MESHNET_TRACKER": tracker.url, **pinned_node_env("head", tracker)},
                             ready_timeout_s=READY_S)
        services.append(head)
        built = HiddenMesh(namespace=namespace, tracker=tracker, relay=relay, head=head, hidden=hidden,
                           hidden_id=hidden_id, hidden_port=hidden_port, model_id=str(_health(head)["model"]))
        wait_ready_through_relay(built)
        yield built
        services[1] = built.relay  # it may have been restarted
    finally:
        for service in reversed(services):
            service.stop()


@pytest.fixture(scope="module")
def expected_answer(tiny_model_dir: Path) -> str:
    """What single-process transformers answers, greedy, float32."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokenizer.decode(output[0, len(prompt):], skip_special_tokens=True, clean_up_tokenization_spaces=False)


def chat(mesh: HiddenMesh) -> tuple[str, int]:
    """The head's answer to :data:`MESSAGES` along the signed route, and how many tokens it generated."""
    response = httpx.post(f"{mesh.head.url}/v1/chat/completions", timeout=READY_S,
                          headers={"X-Meshnet-Route": mesh.route_token(), **bearer_headers(TEST_SECRET)},
                          json={"model": mesh.model_id, "messages": MESSAGES, "max_tokens": MAX_TOKENS,
                                "temperature": 0})
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["choices"][0]["message"]["content"], int(answer["usage"]["completion_tokens"])


def relayed_requests(mesh: HiddenMesh) -> float:
    """Requests the relay carried over its binary form with an answer from the peer."""
    for line in httpx.get(f"{mesh.relay.url}/metrics", timeout=10).text.splitlines():
        if line.startswith('meshnet_relay_requests_total{outcome="ok",transport="mux"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_hidden_node_cannot_be_dialled_from_the_host(mesh: HiddenMesh) -> None:
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{mesh.namespace.inside_ip}:{mesh.hidden_port}/health", timeout=5)


def test_a_node_behind_nat_serves_its_layers_through_the_relay(mesh: HiddenMesh, expected_answer: str) -> None:
    before = relayed_requests(mesh)
    text, tokens = chat(mesh)
    assert text == expected_answer
    # Every token is one step along the route, and the hidden node has no way in but the relay.
    assert relayed_requests(mesh) - before >= tokens


def registered_nodes(mesh: HiddenMesh) -> dict[str, dict[str, object]]:
    """The tracker's ``GET /v1/nodes``, by node id."""
    nodes = httpx.get(f"{mesh.tracker.url}/v1/nodes", timeout=10).json()["nodes"]
    return {str(node["node_id"]): node for node in nodes}


def test_the_hidden_node_registers_its_relay_addr_with_the_tracker(mesh: HiddenMesh) -> None:
    deadline = time.monotonic() + READY_S
    while mesh.hidden_id not in registered_nodes(mesh):
        if time.monotonic() > deadline:
            pytest.fail(f"the hidden node never registered; its log:\n{mesh.hidden.log()}")
        time.sleep(0.2)
    assert registered_nodes(mesh)[mesh.hidden_id]["relay_addr"] == mesh.relay_addr


def test_a_client_of_the_tracker_gets_the_same_answer_through_the_hidden_node(mesh: HiddenMesh,
                                                                              expected_answer: str) -> None:
    deadline = time.monotonic() + READY_S
    while len(registered_nodes(mesh)) < 2:  # the head registers too
        if time.monotonic() > deadline:
            pytest.fail("the nodes never both registered with the tracker")
        time.sleep(0.2)
    client = openai.OpenAI(base_url=f"{mesh.tracker.url}/v1", api_key="unused", max_retries=0, timeout=READY_S)
    answer = client.chat.completions.create(model=mesh.model_id, messages=MESSAGES,  # type: ignore[arg-type]
                                            max_tokens=MAX_TOKENS, temperature=0)
    assert answer.choices[0].message.content == expected_answer


def test_after_the_relay_restarts_the_node_reconnects_and_serves_again(mesh: HiddenMesh,
                                                                       expected_answer: str) -> None:
    assert chat(mesh)[0] == expected_answer
    mesh.restart_relay()
    wait_ready_through_relay(mesh)
    assert chat(mesh)[0] == expected_answer


def anonymous_rpc(mesh: HiddenMesh, requests: list[tuple[str, str, bytes]]) -> list[dict[str, object]]:
    """Send ``(method, path, body)`` requests in the reference's envelope, with no credential; their answers."""
    answers = []
    with sync_ws.connect(mesh.relay_addr, open_timeout=READY_S) as ws:
        for n, (method, path, body) in enumerate(requests):
            ws.send(json.dumps({"request_id": f"r{n}", "method": method, "path": path,
                                "headers": {"content-type": "application/json"},
                                "body_base64": base64.b64encode(body).decode()}))
            answers.append(json.loads(ws.recv(timeout=READY_S)))
    return answers


def test_without_a_credential_the_relay_reaches_only_the_hidden_nodes_health(mesh: HiddenMesh) -> None:
    chat_body = json.dumps({"model": mesh.model_id, "messages": MESSAGES, "max_tokens": 1}).encode()
    health, chat_answer, forward, metrics = anonymous_rpc(mesh, [
        ("GET", "/health", b""), ("POST", "/v1/chat/completions", chat_body), ("POST", "/forward", b"\x00" * 16),
        ("GET", "/metrics", b"")])
    assert health["status"] == 200
    assert json.loads(base64.b64decode(str(health["body_base64"])))["node_id"] == mesh.hidden_id
    for refused in (chat_answer, forward, metrics):
        assert refused["status"] == 401
        assert json.loads(base64.b64decode(str(refused["body_base64"])))["error"]["code"] == "unauthorized"
