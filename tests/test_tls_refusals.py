"""TLS refusals inside the mesh: every client in it refuses a peer it cannot verify, and says so.

test_tls.py shows the mesh working with good certificates. Here each link of
the mesh meets a peer whose certificate it must refuse, with real processes
serving over https/wss (``meshnet <kind>``): one from another CA, or one from
the right CA that names another host. Each refusal is checked by what it
names (the node's log, the answer the client gets), not by a failure of any
kind:

- the hand-written hop client (``services/node/hop/hop_http.py``): a head
  whose next hop serves another CA's certificate fails the request, naming
  the hop and the certificate failure;
- tracker to head: a tracker that does not trust the head's CA answers
  ``head_unreachable`` naming the certificate failure;
- registration: a node never registers with a tracker whose certificate
  names another host, and logs why on every try;
- relay ``wss://``: a node never links to a relay serving another CA's
  certificate, and logs why; the relay holds no peer.
"""

from __future__ import annotations

import contextlib
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import Service, start_service, wait_healthy
from tests.tiny_mesh import wait_until_servable
from tests.tls_pki import Pki, make_pki

HEARTBEAT_S: Final = "1"
EVENT_TIMEOUT_S: Final = 120.0
"""A generous bound on waiting for an event (a log line, a registration) on a loaded machine."""
CHAT_TIMEOUT_S: Final = 120.0
VERIFY_FAILED: Final = "CERTIFICATE_VERIFY_FAILED"
"""What OpenSSL's verification failure is called in every message built from it."""
OTHER_HOST: Final = "other-host.example"


@pytest.fixture(scope="module")
def pkis(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pki]:
    """Two unrelated CAs (``a``, ``b``), each with a certificate for 127.0.0.1; and ``a_elsewhere``: a
    certificate from CA ``a`` that names another host only."""
    folder = tmp_path_factory.mktemp("pkis")
    return {"a": make_pki(folder / "a", "meshnet CA a"), "b": make_pki(folder / "b", "meshnet CA b"),
            "a_elsewhere": make_pki(folder / "a-elsewhere", "meshnet CA a2", hosts=(OTHER_HOST,))}


@pytest.fixture(scope="module")
def both_cas(pkis: dict[str, Pki], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bundle trusting CA ``a`` and CA ``b``."""
    bundle = tmp_path_factory.mktemp("bundle") / "both.pem"
    bundle.write_bytes(pkis["a"].ca.read_bytes() + pkis["b"].ca.read_bytes())
    return bundle


def tls_env(serves: Pki, trusts: Path) -> dict[str, str]:
    """Serve with ``serves``' certificate; verify peers with ``trusts``."""
    return {"MESHNET_TLS_CERT": str(serves.cert), "MESHNET_TLS_KEY": str(serves.key), "MESHNET_TLS_CA": str(trusts)}


def node_env(model_dir: Path, layers: str, node_id: str, tracker: Service | None) -> dict[str, str]:
    env = {"MESHNET_MODEL": str(model_dir), "MESHNET_LAYERS": layers, "MESHNET_NODE_ID": node_id,
           "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu", "MESHNET_HEARTBEAT_S": HEARTBEAT_S}
    if tracker is not None:
        env["MESHNET_TRACKER"] = tracker.url
    return env


@contextlib.contextmanager
def stopping(services: list[Service]) -> Iterator[list[Service]]:
    try:
        yield services
    finally:
        for service in reversed(services):
            service.stop()


def wait_for_log(service: Service, needle: str, count: int = 1) -> str:
    """Wait until ``service``'s log holds ``needle`` ``count`` times; answer the log."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while time.monotonic() < deadline:
        log = service.log()
        if log.count(needle) >= count:
            return log
        if not service.alive():
            break
        time.sleep(0.2)
    raise AssertionError(f"{service.kind}'s log never held {needle!r} {count} times:\n{service.log()}")


def chat(tracker: Service, model: str) -> httpx.Response:
    return httpx.post(f"{tracker.url}/v1/chat/completions", verify=tracker.verify, timeout=CHAT_TIMEOUT_S,
                      json={"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                            "temperature": 0})


def test_a_head_refuses_a_next_hop_whose_certificate_is_from_another_ca(
        tiny_model_dir: Path, pkis: dict[str, Pki], both_cas: Path) -> None:
    """The tracker and the tail trust both CAs, so registration and tracker→head work; the head trusts only
    CA ``a`` and the tail serves CA ``b``'s certificate: the head's hop client must refuse the tail."""
    with stopping([]) as services:
        tracker = start_service("tracker", {**tls_env(pkis["a"], both_cas), "MESHNET_HEARTBEAT_S": HEARTBEAT_S},
                                launcher="meshnet")
        services.append(tracker)
        head = start_service("node", {**node_env(tiny_model_dir, "0-1", "head-a", tracker),
                                      **tls_env(pkis["a"], pkis["a"].ca)}, wait_ready=False, launcher="meshnet")
        services.append(head)
        tail = start_service("node", {**node_env(tiny_model_dir, "2-3", "tail-b", tracker),
                                      **tls_env(pkis["b"], both_cas)}, wait_ready=False, launcher="meshnet")
        services.append(tail)
        wait_healthy(head)
        wait_healthy(tail)
        model = wait_until_servable(tracker, tiny_model_dir.name)
        answer = chat(tracker, model)
        assert answer.status_code >= 500, answer.text
        message = answer.json()["error"]["message"]
        assert "tail-b" in message and VERIFY_FAILED in message, message
        assert VERIFY_FAILED in head.log()
        assert "/forward" not in tail.log()  # nothing reached the tail: the refusal came before any request


def test_a_tracker_refuses_a_head_whose_certificate_is_from_another_ca(
        tiny_model_dir: Path, pkis: dict[str, Pki], both_cas: Path) -> None:
    """The nodes trust both CAs and serve CA ``b``'s certificate (they register and reach each other); the
    tracker trusts only CA ``a``: it must refuse the head, and say why."""
    with stopping([]) as services:
        tracker = start_service("tracker", {**tls_env(pkis["a"], pkis["a"].ca), "MESHNET_HEARTBEAT_S": HEARTBEAT_S},
                                launcher="meshnet")
        services.append(tracker)
        for node_id, layers in (("head-b", "0-1"), ("tail-b", "2-3")):
            services.append(start_service("node", {**node_env(tiny_model_dir, layers, node_id, tracker),
                                                   **tls_env(pkis["b"], both_cas)}, wait_ready=False,
                                          launcher="meshnet"))
        for node in services[1:]:
            wait_healthy(node)
        model = wait_until_servable(tracker, tiny_model_dir.name)
        answer = chat(tracker, model)
        assert answer.status_code == 502, answer.text
        error = answer.json()["error"]
        assert error["code"] == "head_unreachable", error
        assert "head-b" in error["message"] and VERIFY_FAILED in error["message"], error


def test_a_node_never_registers_with_a_tracker_whose_certificate_names_another_host(
        tiny_model_dir: Path, pkis: dict[str, Pki]) -> None:
    """The tracker's certificate is from the CA the node trusts, but names another host than the one the node
    dials (the node itself serves plain http): every registration fails on the host name, the node says so, and the tracker lists no node."""
    elsewhere = pkis["a_elsewhere"]
    with stopping([]) as services:
        tracker = start_service("tracker", {**tls_env(elsewhere, elsewhere.ca), "MESHNET_HEARTBEAT_S": HEARTBEAT_S},
                                wait_ready=False, launcher="meshnet")
        services.append(tracker)
        node = start_service("node", {**node_env(tiny_model_dir, "0-3", "lone", tracker),
                                      "MESHNET_TLS_CA": str(elsewhere.ca)}, wait_ready=False, launcher="meshnet")
        services.append(node)
        wait_healthy(node)
        log = wait_for_log(node, "certificate verify failed", count=2)  # it tried at least twice, and failed
        assert "IP address mismatch" in log, log
        assert "registered lone" not in log, log
        lax = ssl.create_default_context(cafile=str(elsewhere.ca))
        lax.check_hostname = False  # the test itself reaches the tracker by its address, knowing the name is wrong
        nodes = httpx.get(f"{tracker.url}/v1/nodes", verify=lax, timeout=10).json()["nodes"]
        assert nodes == []


def relay_peers(relay: Service) -> float:
    answer = httpx.get(f"{relay.url}/metrics", verify=relay.verify, timeout=10)
    return sum(sample.value for family in text_string_to_metric_families(answer.text)
               for sample in family.samples if sample.name == "meshnet_relay_peers")


def test_a_node_refuses_a_relay_whose_certificate_is_from_another_ca(
        tiny_model_dir: Path, pkis: dict[str, Pki]) -> None:
    """A node trusting CA ``a`` is told to serve through a ``wss://`` relay with CA ``b``'s certificate: its
    link fails on the certificate, on every try, and the relay never holds it as a peer."""
    with stopping([]) as services:
        relay = start_service("relay", tls_env(pkis["b"], pkis["b"].ca), launcher="meshnet")
        services.append(relay)
        assert relay.url.startswith("https://")
        relay_url = relay.url.replace("https://", "wss://")
        node = start_service("node", {**node_env(tiny_model_dir, "0-3", "behind", None),
                                      **tls_env(pkis["a"], pkis["a"].ca), "MESHNET_RELAY": relay_url},
                             launcher="meshnet")
        services.append(node)
        log = wait_for_log(node, VERIFY_FAILED, count=2)
        assert f"link to {relay_url}" in log, log
        assert "connected to" not in log, log
        assert relay_peers(relay) == 0
